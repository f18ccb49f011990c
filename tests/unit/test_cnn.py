"""What only the CNN does: ties in its pooling windows, image shapes, its build errors, image data and flags.

The contract every model keeps (gradients, the loss against a plain reference,
the flat buffers, on_grad, evaluate) is tested for the CNN in test_models.py.
"""

import numpy as np
import pytest
from gradients import finite_difference_check

from ringtrain.models import build_model
from ringtrain.models.conv import max_pool, max_unpool, windows


def one_block(seed=3):
    """A one-block CNN in float64 with non-zero biases, so that every gradient is really checked."""
    model = build_model("cnn", 72, 4, hidden=(4,), seed=seed, dtype=np.float64, input_shape=(2, 6, 6),
                        channels=(2,), kernel=3)
    for name, p in model.params.items():
        if name.endswith(".bias"):
            p[...] = np.random.default_rng(seed + 1).normal(0, 0.1, p.shape)
    return model


def images(shape, rows=5, classes=4, seed=1):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((rows, *shape)), rng.integers(0, classes, rows)


def test_ties_in_a_pooling_window_send_the_gradient_to_one_element():
    # Blank images make every conv output equal to its bias: four-way ties in
    # every window. Finite differences see the true gradient only if each
    # window passes it on once.
    model = one_block()
    x = np.zeros((3, *model.input_shape))
    finite_difference_check(model, x, np.array([0, 1, 2]))


def test_flat_nchw_and_nhw_rows_give_the_same_results():
    model = build_model("cnn", 36, 3, hidden=(5,), seed=0, input_shape=(1, 6, 6), channels=(2,), kernel=3)
    x, y = images((1, 6, 6), rows=4, classes=3)
    x = x.astype(np.float32)
    expected = model.loss_and_grad(x, y)[0]
    for shaped in (x.reshape(4, 36), x.reshape(4, 6, 6)):
        assert model.loss_and_grad(shaped, y)[0] == expected
    np.testing.assert_array_equal(model.logits(x.reshape(4, 6, 6)), model.logits(x))
    with pytest.raises(ValueError, match=r"x must have shape \(rows, 36\), \(rows, 6, 6\) or \(rows, 1, 6, 6\), "
                                         r"got \(4, 35\)"):
        model.loss_and_grad(np.zeros((4, 35)), y)
    two = build_model("cnn", 72, 3, hidden=(), seed=0, input_shape=(2, 6, 6), channels=(2,), kernel=3)
    with pytest.raises(ValueError, match=r"x must have shape \(rows, 72\) or \(rows, 2, 6, 6\), got \(4, 6, 6, 2\)"):
        two.logits(np.zeros((4, 6, 6, 2)))  # channels last is not what the datasets store
    with pytest.raises(ValueError, match=r"y must have shape \(4,\)"):
        model.loss_and_grad(x, y[:3])
    with pytest.raises(ValueError, match="empty batch"):
        model.loss_and_grad(x[:0], y[:0])


def test_parameters_are_named_by_block_then_dense_layer_in_hwio():
    model = build_model("cnn", 64, 10, seed=9, input_shape=(1, 8, 8), channels=(4, 8), kernel=3, hidden=(16,))
    assert list(model.params) == ["conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias",
                                  "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    assert model.params["conv2.weight"].shape == (3, 3, 4, 8) and model.params["fc1.weight"].shape == (2 * 2 * 8, 16)


def test_windows_are_every_k_by_k_patch_without_a_copy():
    a = np.arange(2 * 5 * 4 * 3, dtype=np.float64).reshape(2, 5, 4, 3)
    w = windows(np, a, 3)
    assert w.shape == (2, 3, 2, 3, 3, 3) and np.shares_memory(w, a)
    for i in range(3):
        for j in range(2):
            np.testing.assert_array_equal(w[:, i, j], a[:, i:i + 3, j:j + 3, :])


def test_max_pool_takes_each_maximum_and_gives_a_tie_to_the_top_left():
    z = np.array([[1, 1, 0, 2, 9], [1, 1, 3, 4, 9], [7, 7, 7, 7, 7]], dtype=np.float64).reshape(1, 3, 5, 1)
    m1, c1 = np.empty((1, 1, 5, 1)), np.empty((1, 1, 5, 1), dtype=bool)
    out, c2 = np.empty((1, 1, 2, 1)), np.empty((1, 1, 2, 1), dtype=bool)
    max_pool(np, z, m1, c1, c2, out)  # the odd last row and column are dropped
    assert out.ravel().tolist() == [1, 4]
    assert c1.ravel().tolist() == [False, False, True, True, False]  # the lower row only where it is larger
    assert c2.ravel().tolist() == [False, True]


@pytest.mark.gpu
def test_max_unpool_on_gpu_gives_the_bits_numpy_gives():
    from ringtrain import backend

    if not backend.gpu_available():
        pytest.skip("no GPU: backend.gpu_available() is False")
    xp = backend.xp_for("gpu")
    rng = np.random.default_rng(0)
    for dtype in (np.float32, np.float64):
        g = rng.standard_normal((3, 2, 2, 4)).astype(dtype)
        g[0] *= 0.0  # signed zeros: g - g * won must keep their signs as NumPy does
        c1, c2 = rng.random((3, 2, 5, 4)) < 0.5, rng.random((3, 2, 2, 4)) < 0.5
        host = [np.zeros((3, 2, 5, 4), dtype), np.zeros((3, 5, 5, 4), dtype)]
        max_unpool(np, g, c1, c2, *host)
        device = [xp.zeros((3, 2, 5, 4), dtype), xp.zeros((3, 5, 5, 4), dtype)]
        max_unpool(xp, xp.asarray(g), xp.asarray(c1), xp.asarray(c2), *device)
        for want, got in zip(host, device):
            assert backend.to_numpy(got).tobytes() == want.tobytes()


@pytest.mark.parametrize("kwargs, message", [
    (dict(input_shape=None), "model 'cnn' needs image data: digits, mnist5k, or an .npz whose x is N x H x W "
                             "or N x C x H x W"),
    (dict(input_shape=(1, 8, 7)), r"input_shape \(1, 8, 7\) does not hold 64 features"),
    (dict(kernel=4), "kernel must be odd and at least 1 \\('same' padding\\), got 4"),
    (dict(channels=()), r"channels must be one or more positive sizes, got \(\)"),
    (dict(channels=(4, 0)), "conv channels must be at least 1, got 0"),
    (dict(channels=(4, 4, 4, 4)), "images of 8x8 are too small for 4 conv blocks: each 2x2 max-pool halves "
                                  "them, and block 4 would get 1x1"),
    (dict(hidden=(0,)), "hidden layer size must be at least 1, got 0"),
])
def test_build_errors_name_the_value(kwargs, message):
    args = dict(input_shape=(1, 8, 8), channels=(4,), kernel=3, hidden=(8,)) | kwargs
    with pytest.raises(ValueError, match=message):
        build_model("cnn", 64, 10, **args)


def test_flat_models_ignore_the_image_shape_and_refuse_conv_options():
    mlp = build_model("mlp", 64, 10, hidden=(8,), input_shape=(1, 8, 8))
    assert mlp.params["fc1.weight"].shape == (64, 8)
    with pytest.raises(ValueError, match="model 'mlp' takes no option 'channels'"):
        build_model("mlp", 64, 10, hidden=(8,), channels=(4,))


# --- image data ---------------------------------------------------------------

@pytest.mark.parametrize("shape, image_shape", [((30, 8, 8), (1, 8, 8)), ((30, 3, 6, 4), (3, 6, 4)),
                                                ((30, 12), None)])
def test_datasets_flatten_images_and_record_their_shape(tmp_path, shape, image_shape):
    from mpi4py import MPI

    from ringtrain.data.load import load_sharded

    rng = np.random.default_rng(0)
    x, y = rng.random(shape).astype(np.float32), np.arange(shape[0]) % 3
    np.savez(tmp_path / "data.npz", x=x[:20], y=y[:20], x_test=x[20:], y_test=y[20:])
    (tmp_path / "dir").mkdir()
    np.save(tmp_path / "dir" / "x.npy", x)
    np.save(tmp_path / "dir" / "y.npy", y)
    for where in (tmp_path / "data.npz", tmp_path / "dir"):
        shard = load_sharded(str(where), MPI.COMM_SELF, test_fraction=1 / 3)
        assert shard.image_shape == image_shape and shard.num_features == x[0].size
        assert shard.x.shape == (20, x[0].size)
    np.testing.assert_array_equal(load_sharded(str(tmp_path / "data.npz"), MPI.COMM_SELF).x, x[:20].reshape(20, -1))


def test_built_in_image_datasets_know_their_shape_and_synthetic_has_none():
    from mpi4py import MPI

    from ringtrain.data.load import load_sharded

    pytest.importorskip("sklearn")
    assert load_sharded("digits", MPI.COMM_SELF).image_shape == (1, 8, 8)
    assert load_sharded("synthetic", MPI.COMM_SELF, samples=50).image_shape is None


def test_test_images_of_another_shape_are_a_usage_error(tmp_path):
    from mpi4py import MPI

    from ringtrain.data.load import load_sharded
    from ringtrain.errors import UsageError

    np.savez(tmp_path / "data.npz", x=np.zeros((6, 3, 6, 4)), y=np.arange(6) % 2, x_test=np.zeros((2, 3, 4, 6)),
             y_test=np.arange(2))
    with pytest.raises(UsageError, match="data.npz: x_test holds images of 3x4x6 but x holds 3x6x4"):
        load_sharded(str(tmp_path / "data.npz"), MPI.COMM_SELF)


# --- configuration --------------------------------------------------------------

def test_hidden_defaults_by_model_and_conv_flags_parse():
    from ringtrain.cli import build_parser
    from ringtrain.commands.train import config_from_args

    def parse(*argv):
        return config_from_args(build_parser().parse_args(["train", *argv]))

    assert parse().hidden == (256, 128)
    cnn = parse("--model", "cnn")
    assert (cnn.hidden, cnn.channels, cnn.kernel) == ((128,), (16, 32), 5)
    assert parse("--model", "cnn", "--hidden", "64,32", "--channels", "8", "--kernel", "3").channels == (8,)
    assert parse("--model", "cnn", "--hidden", "").hidden == ()  # the logits straight after the conv blocks


@pytest.mark.parametrize("change, needle", [
    ({"kernel": 4}, "--kernel: must be odd, from 1 to 15 ('same' padding), got 4"),
    ({"kernel": 17}, "--kernel: must be odd, from 1 to 15"),
    ({"channels": ()}, "--channels: expected 1 to 8 conv blocks of 1 to 1024 channels each, e.g. 16,32; got none"),
    ({"channels": (16, 0)}, "--channels: expected 1 to 8 conv blocks of 1 to 1024 channels each, e.g. 16,32; "
                            "got 16,0"),
])
def test_bad_conv_settings_are_one_line(change, needle):
    from ringtrain.training.config import TrainConfig, validate
    from ringtrain.errors import UsageError

    with pytest.raises(UsageError) as info:
        validate(TrainConfig(model="cnn", **change))
    assert str(info.value) == needle or str(info.value).startswith(needle)

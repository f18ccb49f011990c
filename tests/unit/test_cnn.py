"""The CNN: gradients against finite differences, the loss against a plain loop, the flat-buffer contract."""

import numpy as np
import pytest
from gradients import finite_difference_check

from ringtrain import backend
from ringtrain.models.cnn import CNN
from ringtrain.models import build_model, flat_layout

NETS = {  # name -> (input_shape, channels, kernel, hidden)
    "one-block": ((2, 6, 6), (2,), 3, (4,)),
    "two-blocks-odd": ((1, 7, 5), (2, 3), 3, ()),  # 7x5 -> 3x2 -> 1x1: pools drop a row and a column
    "kernel-5": ((2, 6, 6), (3,), 5, (4,)),
}


def tiny(name, xp=np, seed=3, dtype=np.float64):
    shape, channels, kernel, hidden = NETS[name]
    model = build_model("cnn", int(np.prod(shape)), 4, hidden=hidden, xp=xp, seed=seed, dtype=dtype,
                        input_shape=shape, channels=channels, kernel=kernel)
    # Biases start at zero; give them values so that their gradients are really checked.
    rng = np.random.default_rng(seed + 1)
    for param_name, p in model.params.items():
        if param_name.endswith(".bias"):
            p[...] = xp.asarray(rng.normal(0, 0.1, p.shape).astype(dtype))
    return model


def images(shape, rows=5, classes=4, seed=1, xp=np):
    rng = np.random.default_rng(seed)
    return xp.asarray(rng.standard_normal((rows, *shape))), xp.asarray(rng.integers(0, classes, rows))


def reference_loss(model, x, y):
    """Mean cross-entropy and correct count, computed the obvious way (loops over offsets, NCHW)."""
    params = {k: backend.to_numpy(v).astype(np.float64) for k, v in model.params.items()}
    c, height, width = model.input_shape
    h = np.asarray(backend.to_numpy(x), np.float64).reshape(len(y), c, height, width)
    k = model.kernel
    for i in range(1, len(model.channels) + 1):
        w, b = params[f"conv{i}.weight"], params[f"conv{i}.bias"]  # (k, k, in, out)
        rows, _, height, width = h.shape
        padded = np.pad(h, ((0, 0), (0, 0), (k // 2, k // 2), (k // 2, k // 2)))
        z = np.zeros((rows, w.shape[3], height, width))
        for di in range(k):
            for dj in range(k):
                z += np.einsum("nchw,cf->nfhw", padded[:, :, di:di + height, dj:dj + width], w[di, dj])
        z = np.maximum(z + b[None, :, None, None], 0)
        ho, wo = height // 2, width // 2
        h = z[:, :, :2 * ho, :2 * wo].reshape(rows, -1, ho, 2, wo, 2).max(axis=(3, 5))
    h = h.transpose(0, 2, 3, 1).reshape(len(y), -1)  # flattened in (height, width, channel) order
    layers = len(model.dense_sizes) - 1
    for i in range(1, layers + 1):
        h = h @ params[f"fc{i}.weight"] + params[f"fc{i}.bias"]
        if i < layers:
            h = np.maximum(h, 0)
    y = backend.to_numpy(y)
    p = np.exp(h - h.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    return float(-np.mean(np.log(p[np.arange(len(y)), y]))), int(np.sum(h.argmax(axis=1) == y))


@pytest.mark.parametrize("name", NETS)
def test_gradients_match_central_finite_differences(name):
    model = tiny(name)
    x, y = images(model.input_shape)
    finite_difference_check(model, x, y)


@pytest.mark.gpu
def test_gradients_match_finite_differences_on_gpu():
    if not backend.gpu_available():
        pytest.skip("no GPU: backend.gpu_available() is False")
    xp = backend.xp_for("gpu")
    model = tiny("two-blocks-odd", xp=xp)
    x, y = images(model.input_shape, xp=xp)
    finite_difference_check(model, x, y)
    cpu = tiny("two-blocks-odd")
    for k in cpu.params:  # built on the host, so the GPU starts from the same values
        np.testing.assert_array_equal(backend.to_numpy(model.params[k]), cpu.params[k])
    assert model.loss_and_grad(x, y)[0] == pytest.approx(cpu.loss_and_grad(*images(cpu.input_shape))[0], rel=1e-12)


@pytest.mark.parametrize("name", NETS)
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_loss_and_correct_match_a_plain_reference(name, dtype):
    model = tiny(name, dtype=dtype)
    x, y = images(model.input_shape, rows=13)
    loss, grads, correct = model.loss_and_grad(x, y)
    want_loss, want_correct = reference_loss(model, x, y)
    assert isinstance(loss, float) and isinstance(correct, int)
    assert loss == pytest.approx(want_loss, rel=1e-5 if dtype == np.float32 else 1e-12)
    assert correct == want_correct
    assert list(grads) == list(model.params)
    for k, p in model.params.items():
        assert grads[k].shape == p.shape and grads[k].dtype == p.dtype == dtype


def test_ties_in_a_pooling_window_send_the_gradient_to_one_element():
    # Blank images make every conv output equal to its bias: four-way ties in
    # every window. Finite differences see the true gradient only if each
    # window passes it on once.
    model = tiny("one-block")
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


def test_on_grad_sees_each_final_gradient_once_last_layer_first():
    model = tiny("two-blocks-odd")
    x, y = images(model.input_shape)
    seen = []
    _, grads, _ = model.loss_and_grad(x, y, on_grad=lambda name, g: seen.append((name, g.copy())))
    assert [name for name, _ in seen] == list(reversed(model.params))
    assert [name for name, _ in seen][-2:] == ["conv1.bias", "conv1.weight"]
    for name, g in seen:
        np.testing.assert_array_equal(g, grads[name])


def test_on_grad_may_change_a_gradient_in_place_without_disturbing_the_rest():
    # The trainer averages gradients in place as they arrive, while backward goes on.
    model = tiny("two-blocks-odd", dtype=np.float32)
    x, y = images(model.input_shape)
    plain = {k: g.copy() for k, g in model.loss_and_grad(x, y)[1].items()}

    def halve(name, g):
        g *= 0.5

    _, grads, _ = model.loss_and_grad(x, y, on_grad=halve)
    for k in plain:
        np.testing.assert_array_equal(grads[k], plain[k] * np.float32(0.5))


def test_gradients_are_views_of_the_grad_buffer_in_on_grad_order():
    model = tiny("two-blocks-odd", dtype=np.float32)
    layout = flat_layout(model)  # raises if any parameter or gradient is not where the layout says
    order = list(reversed(model.params))
    assert list(layout.order) == order
    x, y = images(model.input_shape)
    first = model.loss_and_grad(x, y)[1]
    second = model.loss_and_grad(x[:3], y[:3])[1]  # another batch size: other activations, same gradients
    assert all(first[k] is second[k] is model.grads[k] for k in first)
    np.testing.assert_array_equal(np.concatenate([first[k].ravel() for k in order]), model.grad_buffer)
    assert flat_layout(model) == layout


def test_rebind_moves_the_buffers_and_keeps_the_results():
    model = tiny("two-blocks-odd", dtype=np.float32)
    x, y = images(model.input_shape)
    loss, grads, _ = model.loss_and_grad(x, y)
    expected = {k: g.copy() for k, g in grads.items()}
    params = model.params
    new_p, new_g = np.zeros_like(model.param_buffer), np.zeros_like(model.grad_buffer)
    model.rebind(new_p, new_g)
    assert model.params is params and all(np.shares_memory(v, new_p) for v in params.values())
    again, grads, _ = model.loss_and_grad(x, y)
    assert again == loss and all(np.shares_memory(g, new_g) for g in grads.values())
    for k in expected:
        np.testing.assert_array_equal(grads[k], expected[k])
    flat_layout(model)


def test_identical_builds_give_bitwise_identical_results_and_biases_start_at_zero():
    a, b = (build_model("cnn", 64, 10, seed=9, input_shape=(1, 8, 8), channels=(4, 8), kernel=3, hidden=(16,))
            for _ in range(2))
    assert list(a.params) == ["conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias",
                              "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    assert a.params["conv2.weight"].shape == (3, 3, 4, 8) and a.params["fc1.weight"].shape == (2 * 2 * 8, 16)
    assert not any(p.any() for k, p in a.params.items() if k.endswith(".bias"))
    x, y = images((1, 8, 8), rows=20, classes=10)
    for _ in range(2):  # the second call reuses the buffers
        la, ga, _ = a.loss_and_grad(x, y)
        lb, gb, _ = b.loss_and_grad(x, y)
        assert la == lb and all(np.array_equal(ga[k], gb[k]) for k in ga)
    other = build_model("cnn", 64, 10, seed=10, input_shape=(1, 8, 8), channels=(4, 8), kernel=3, hidden=(16,))
    assert not np.array_equal(a.params["conv1.weight"], other.params["conv1.weight"])


@pytest.mark.parametrize("batch_size", [4, 1024])
def test_evaluate_sums_match_loss_and_grad(batch_size):
    model = tiny("one-block", dtype=np.float32)
    x, y = images(model.input_shape, rows=300)  # more rows than one evaluation chunk
    loss, _, correct = model.loss_and_grad(x, y)
    loss_sum, eval_correct = model.evaluate(x, y, batch_size=batch_size)
    assert isinstance(loss_sum, float) and isinstance(eval_correct, int)
    assert loss_sum == pytest.approx(loss * 300, rel=1e-5)
    assert eval_correct == correct
    assert model.evaluate(x[:0], y[:0]) == (0.0, 0)  # a rank may hold no test rows


def test_logits_are_fresh():
    model = tiny("one-block", dtype=np.float32)
    x, y = images(model.input_shape, rows=200)
    out = model.logits(x)
    model.loss_and_grad(x, y)  # must not overwrite what logits returned
    assert out.shape == (200, 4)
    np.testing.assert_array_equal(out, model.logits(x))
    assert model.logits(x[:0]).shape == (0, 4)


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


def test_a_small_cnn_learns_digits():
    datasets = pytest.importorskip("sklearn.datasets")
    from ringtrain.optim import build_optimizer

    digits = datasets.load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target
    model = CNN((1, 8, 8), 10, channels=(8,), kernel=3, hidden=(32,), seed=0)
    opt = build_optimizer("sgd", model.params, lr=0.05, momentum=0.9)
    rng = np.random.default_rng(0)
    before = model.evaluate(x, y)[1] / len(y)
    for _ in range(200):
        rows = rng.integers(0, len(y), 64)
        _, grads, _ = model.loss_and_grad(x[rows], y[rows])
        opt.step(model.params, grads, 0.05)
    after = model.evaluate(x, y)[1] / len(y)
    assert before < 0.3 and after > 0.9, (before, after)


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

"""Models: the contract every built-in model keeps, then the MLP, the registry and the protocol.

The contract tests run over every built-in model (the MLP in three shapes,
the CNN in three) and check each against a reference: central finite
differences for the gradients, a plain NumPy forward pass for the loss. What
only the CNN does (pooling ties, image shapes, image data) is in test_cnn.py.
"""

import dataclasses

import numpy as np
import pytest
from gradients import finite_difference_check

from ringtrain import backend
from ringtrain.models import (CNN, MODELS, FlatModel, Model, build_model, flat_layout, register_model,
                              softmax_cross_entropy)

CLASSES = 4


@dataclasses.dataclass(frozen=True)
class Case:
    """A built-in model of one shape: how to build it and what its rows look like."""

    model: str
    input_shape: tuple  # one row's shape as the model is given it
    options: dict

    def build(self, xp=np, seed=3, dtype=np.float64):
        features = int(np.prod(self.input_shape))
        image = {"input_shape": self.input_shape} if self.model == "cnn" else {}
        model = build_model(self.model, features, CLASSES, xp=xp, seed=seed, dtype=dtype, **image, **self.options)
        # Biases start at zero; give them values so that their gradients are really checked.
        rng = np.random.default_rng(seed + 1)
        for name, p in model.params.items():
            if name.endswith(".bias"):
                p[...] = xp.asarray(rng.normal(0, 0.1, p.shape).astype(dtype))
        return model

    def batch(self, rows=5, seed=1, xp=np):
        rng = np.random.default_rng(seed)
        x = rng.standard_normal((rows, *self.input_shape))
        return xp.asarray(x), xp.asarray(rng.integers(0, CLASSES, rows))


CASES = {
    "softmax": Case("softmax", (7,), {}),
    "mlp1": Case("mlp", (7,), {"hidden": (6,)}),
    "mlp2": Case("mlp", (7,), {"hidden": (6, 5)}),
    "cnn-one-block": Case("cnn", (2, 6, 6), {"channels": (2,), "kernel": 3, "hidden": (4,)}),
    # 7x5 -> 3x2 -> 1x1: the pools drop a row and a column
    "cnn-two-blocks-odd": Case("cnn", (1, 7, 5), {"channels": (2, 3), "kernel": 3, "hidden": ()}),
    "cnn-kernel-5": Case("cnn", (2, 6, 6), {"channels": (3,), "kernel": 5, "hidden": (4,)}),
}


def reference_logits(model, x):
    """The logits computed the obvious way, in float64: loops over kernel offsets, NCHW, no reused buffers."""
    params = {k: backend.to_numpy(v).astype(np.float64) for k, v in model.params.items()}
    h = np.asarray(backend.to_numpy(x), np.float64)
    if isinstance(model, CNN):
        h = h.reshape(len(h), *model.input_shape)
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
        h = h.transpose(0, 2, 3, 1).reshape(len(h), -1)  # flattened in (height, width, channel) order
    layers = sum(name.startswith("fc") and name.endswith(".weight") for name in params)
    for i in range(1, layers + 1):
        h = h @ params[f"fc{i}.weight"] + params[f"fc{i}.bias"]
        if i < layers:
            h = np.maximum(h, 0)
    return h


def reference_loss(model, x, y):
    """Mean cross-entropy and correct count from :func:`reference_logits`."""
    h, y = reference_logits(model, x), backend.to_numpy(y)
    p = np.exp(h - h.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    return float(-np.mean(np.log(p[np.arange(len(y)), y]))), int(np.sum(h.argmax(axis=1) == y))


# --- the contract, for every built-in model -------------------------------------------

@pytest.mark.parametrize("case", CASES)
def test_gradients_match_central_finite_differences(case):
    model = CASES[case].build()
    finite_difference_check(model, *CASES[case].batch())


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["mlp2", "cnn-two-blocks-odd"])
def test_gradients_match_finite_differences_on_gpu(case):
    if not backend.gpu_available():
        pytest.skip("no GPU: backend.gpu_available() is False")
    xp = backend.xp_for("gpu")
    model = CASES[case].build(xp=xp)
    finite_difference_check(model, *CASES[case].batch(xp=xp))
    cpu = CASES[case].build()
    for k in cpu.params:  # built on the host, so the GPU starts from the same values
        np.testing.assert_array_equal(backend.to_numpy(model.params[k]), cpu.params[k])
    loss_gpu = model.loss_and_grad(*CASES[case].batch(xp=xp))[0]
    assert loss_gpu == pytest.approx(cpu.loss_and_grad(*CASES[case].batch())[0], rel=1e-12)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_loss_and_correct_match_a_plain_reference(case, dtype):
    model = CASES[case].build(dtype=dtype)
    x, y = CASES[case].batch(rows=13)
    loss, grads, correct = model.loss_and_grad(x, y)
    want_loss, want_correct = reference_loss(model, x, y)
    assert isinstance(loss, float) and isinstance(correct, int)
    assert loss == pytest.approx(want_loss, rel=1e-5 if dtype == np.float32 else 1e-12)
    assert correct == want_correct
    assert list(grads) == list(model.params)
    for k, p in model.params.items():
        assert grads[k].shape == p.shape and grads[k].dtype == p.dtype == dtype


@pytest.mark.parametrize("case", CASES)
def test_on_grad_sees_each_final_gradient_once_last_layer_first(case):
    model = CASES[case].build()
    seen = []
    _, grads, _ = model.loss_and_grad(*CASES[case].batch(), on_grad=lambda name, g: seen.append((name, g.copy())))
    assert [name for name, _ in seen] == list(reversed(model.params))
    for name, g in seen:
        np.testing.assert_array_equal(g, grads[name])


@pytest.mark.parametrize("case", CASES)
def test_on_grad_may_change_a_gradient_in_place_without_disturbing_the_rest(case):
    # The trainer averages gradients in place as they arrive, while backward goes on.
    model = CASES[case].build(dtype=np.float32)
    x, y = CASES[case].batch()
    plain = {k: g.copy() for k, g in model.loss_and_grad(x, y)[1].items()}

    def halve(name, g):
        g *= 0.5

    _, grads, _ = model.loss_and_grad(x, y, on_grad=halve)
    for k in plain:
        np.testing.assert_array_equal(grads[k], plain[k] * np.float32(0.5))


@pytest.mark.parametrize("case", CASES)
def test_gradients_are_views_of_the_grad_buffer_in_on_grad_order(case):
    model = CASES[case].build(dtype=np.float32)
    layout = flat_layout(model)  # raises if any parameter or gradient is not where the layout says
    order = list(reversed(model.params))
    assert list(layout.order) == order
    x, y = CASES[case].batch()
    first = model.loss_and_grad(x, y)[1]
    second = model.loss_and_grad(x[:3], y[:3])[1]  # another batch size: other activations, same gradients
    assert all(first[k] is second[k] is model.grads[k] for k in first)
    np.testing.assert_array_equal(np.concatenate([first[k].ravel() for k in order]), model.grad_buffer)
    assert flat_layout(model) == layout


@pytest.mark.parametrize("case", CASES)
def test_rebind_moves_the_buffers_and_keeps_the_results(case):
    model = CASES[case].build(dtype=np.float32)
    x, y = CASES[case].batch()
    loss, grads, _ = model.loss_and_grad(x, y)
    expected = {k: g.copy() for k, g in grads.items()}
    params, before = model.params, {k: v.copy() for k, v in model.params.items()}
    new_p, new_g = np.zeros_like(model.param_buffer), np.zeros_like(model.grad_buffer)
    model.rebind(new_p, new_g)
    assert model.params is params and model.param_buffer is new_p
    assert all(np.shares_memory(v, new_p) and np.array_equal(v, before[k]) for k, v in params.items())
    again, grads, _ = model.loss_and_grad(x, y)
    assert again == loss and all(np.shares_memory(g, new_g) for g in grads.values())
    for k in expected:
        np.testing.assert_array_equal(grads[k], expected[k])
    flat_layout(model)
    size = new_p.size
    with pytest.raises(ValueError, match=f"flat buffers of {size} float32"):
        model.rebind(np.zeros(size - 1, np.float32), new_g)


@pytest.mark.parametrize("case", CASES)
def test_identical_builds_give_bitwise_identical_results_and_biases_start_at_zero(case):
    c = CASES[case]
    features = int(np.prod(c.input_shape))
    image = {"input_shape": c.input_shape} if c.model == "cnn" else {}
    a, b, other = (build_model(c.model, features, CLASSES, seed=seed, **image, **c.options) for seed in (9, 9, 10))
    assert not any(p.any() for k, p in a.params.items() if k.endswith(".bias"))
    first = next(iter(a.params))
    assert not np.array_equal(a.params[first], other.params[first])
    x, y = c.batch(rows=20)
    for _ in range(2):  # the second call reuses the buffers
        la, ga, _ = a.loss_and_grad(x, y)
        lb, gb, _ = b.loss_and_grad(x, y)
        assert la == lb and all(np.array_equal(ga[k], gb[k]) for k in ga)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("batch_size", [4, 1024])
def test_evaluate_sums_match_loss_and_grad(case, batch_size):
    model = CASES[case].build(dtype=np.float32)
    x, y = CASES[case].batch(rows=300)  # more rows than one of the CNN's evaluation chunks
    loss, _, correct = model.loss_and_grad(x, y)
    loss_sum, eval_correct = model.evaluate(x, y, batch_size=batch_size)
    assert isinstance(loss_sum, float) and isinstance(eval_correct, int)
    assert loss_sum == pytest.approx(loss * 300, rel=1e-5)
    assert eval_correct == correct
    assert model.evaluate(x[:0], y[:0]) == (0.0, 0)  # a rank may hold no test rows
    with pytest.raises(ValueError, match="batch_size must be at least 1, got 0"):
        model.evaluate(x, y, batch_size=0)


@pytest.mark.parametrize("case", CASES)
def test_logits_are_fresh_and_agree_with_the_reference(case):
    model = CASES[case].build()
    x, y = CASES[case].batch(rows=200)
    out = model.logits(x)
    model.loss_and_grad(x, y)  # must not overwrite what logits returned
    assert out.shape == (200, CLASSES)
    np.testing.assert_array_equal(out, model.logits(x))
    np.testing.assert_allclose(out, reference_logits(model, x), rtol=1e-10, atol=1e-12)
    assert model.logits(x[:0]).shape == (0, CLASSES)


@pytest.mark.parametrize("case", CASES)
def test_bad_labels_and_empty_batches_are_rejected(case):
    model = CASES[case].build()
    x, y = CASES[case].batch(rows=2)
    with pytest.raises(ValueError, match=r"y must have shape \(2,\) to match x, got \(3,\)"):
        model.loss_and_grad(x, np.zeros(3, dtype=int))
    with pytest.raises(ValueError, match="y must hold integer class labels, got dtype float64"):
        model.loss_and_grad(x, np.zeros(2))
    with pytest.raises(ValueError, match=r"y must have shape \(2,\)"):
        model.evaluate(x, y[:1])
    with pytest.raises(ValueError, match=r"cannot take the loss of an empty batch \(0 rows\)"):
        model.loss_and_grad(x[:0], y[:0])


@pytest.mark.parametrize("model, options, steps, lr", [
    ("mlp", {"hidden": (64,)}, 300, 0.1),
    ("cnn", {"input_shape": (1, 8, 8), "channels": (8,), "kernel": 3, "hidden": (32,)}, 200, 0.05),
])
def test_a_small_model_learns_digits(model, options, steps, lr):
    datasets = pytest.importorskip("sklearn.datasets")
    from ringtrain.optim import build_optimizer

    digits = datasets.load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target
    net = build_model(model, 64, 10, seed=0, **options)
    opt = build_optimizer("sgd", net.params, lr=lr, momentum=0.9)
    rng = np.random.default_rng(0)
    before = net.evaluate(x, y)[1] / len(y)
    for _ in range(steps):
        rows = rng.integers(0, len(y), 64)
        _, grads, _ = net.loss_and_grad(x[rows], y[rows])
        opt.step(net.params, grads, lr)
    after = net.evaluate(x, y)[1] / len(y)
    assert before < 0.3 and after > 0.9, (before, after)


# --- the MLP ------------------------------------------------------------------------

def test_loss_is_stable_for_huge_logits():
    model = build_model("softmax", 3, 2, seed=0, dtype=np.float32)
    model.params["fc1.weight"][...] = [[1e4, -1e4], [0, 0], [0, 0]]
    x = np.array([[1.0, 0, 0], [-1.0, 0, 0]], dtype=np.float32)
    loss, grads, correct = model.loss_and_grad(x, np.array([0, 0]))
    assert np.isfinite(loss) and loss == pytest.approx(1e4, rel=1e-6)  # half the rows are off by 2e4
    assert all(np.isfinite(g).all() for g in grads.values()) and correct == 1


def test_mlp_parameters_are_named_by_layer():
    model = build_model("mlp", 7, 4, hidden=(8,), seed=0)
    assert list(model.params) == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    assert model.params["fc1.weight"].shape == (7, 8)


def test_mlp_rows_of_the_wrong_width_are_rejected():
    model = build_model("mlp", 4, 3, hidden=(5,))
    with pytest.raises(ValueError, match=r"x must have shape \(rows, 4\), got \(2, 5\)"):
        model.loss_and_grad(np.zeros((2, 5)), np.zeros(2, dtype=int))


def test_softmax_cross_entropy_helper():
    logits = np.array([[2.0, 1.0, 0.0], [0.0, 0.0, 5.0]])
    y = np.array([0, 1])
    loss_sum, correct, none = softmax_cross_entropy(logits, y)
    p = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    assert loss_sum == pytest.approx(-np.log(p[[0, 1], y]).sum()) and correct == 1 and none is None
    _, _, d = softmax_cross_entropy(logits.copy(), y, grad_scale=0.5)
    np.testing.assert_allclose(d, 0.5 * (p - np.eye(3)[y]))


def test_flat_layout_finds_the_mlp_buffers_in_backward_order():
    model = build_model("mlp", 6, 3, hidden=(5, 4), seed=0)
    layout = flat_layout(model)
    assert list(layout.order) == list(reversed(model.params))
    base = model.param_buffer.__array_interface__["data"][0]
    offsets = [(model.params[n].__array_interface__["data"][0] - base) // 4 for n in layout.order]
    assert offsets == [layout.bounds[n][0] for n in layout.order] and offsets[0] == 0
    assert layout.size == model.param_buffer.size == sum(p.size for p in model.params.values())


def test_only_a_flat_model_has_a_layout_and_a_broken_one_is_named():
    model = build_model("mlp", 6, 3, hidden=(5,), seed=0)

    class Duck:  # the same attributes, but it never opted in: the plain path, no guessing
        params, grads = model.params, model.grads
        param_buffer, grad_buffer = model.param_buffer, model.grad_buffer

    assert flat_layout(Duck()) is None
    assert flat_layout(object()) is None

    class Forgot(FlatModel):
        pass

    with pytest.raises(ValueError, match="never called _init_flat"):
        flat_layout(Forgot())
    broken = build_model("mlp", 6, 3, hidden=(5,), seed=0)
    broken.grads["fc1.bias"] = np.zeros(5, np.float32)  # a loose array where a view belongs
    with pytest.raises(ValueError, match="gradient 'fc1.bias' is not the view of its flat buffer"):
        flat_layout(broken)


def test_contiguous_span_needs_one_allocation_back_to_back():
    from ringtrain.backend import contiguous_span

    flat = np.arange(10, dtype=np.float32)
    assert np.shares_memory(contiguous_span([flat[2:5], flat[5:9]]), flat)
    np.testing.assert_array_equal(contiguous_span([flat[2:5], flat[5:9]]), flat[2:9])
    assert contiguous_span([flat[5:9], flat[2:5]]) is None          # out of order
    assert contiguous_span([flat[2:4], flat[5:9]]) is None          # a gap
    assert contiguous_span([flat[:3], np.zeros(3, np.float32)]) is None  # two allocations
    assert contiguous_span([flat[::2]]) is None                     # strided
    assert contiguous_span([]) is None


# --- the registry and the protocol --------------------------------------------------

class TinyLinear(Model):
    """What a user writes: params, loss_and_grad, logits; evaluate comes from Model."""

    def __init__(self, features, classes):
        self.params = {"w": np.zeros((features, classes))}

    def logits(self, x):
        return x @ self.params["w"]

    def loss_and_grad(self, x, y, on_grad=None):
        loss_sum, correct, d = softmax_cross_entropy(self.logits(x), y, grad_scale=1.0 / len(x))
        grads = {"w": x.T @ d}
        if on_grad:
            on_grad("w", grads["w"])
        return loss_sum / len(x), grads, correct


def test_a_user_model_plugs_in_through_the_protocol():
    x, y = Case("softmax", (3,), {}).batch(rows=6)
    y = y % 2
    model = TinyLinear(3, 2)
    loss, grads, _ = model.loss_and_grad(x, y)
    assert loss == pytest.approx(np.log(2))
    assert model.evaluate(x, y, batch_size=4)[0] == pytest.approx(6 * np.log(2))
    register_model("tiny-test", lambda f, c, hidden, xp, seed, dtype: TinyLinear(f, c))
    try:
        assert isinstance(build_model("tiny-test", 3, 2), TinyLinear)
        with pytest.raises(ValueError, match="already registered"):
            register_model("tiny-test", TinyLinear)
    finally:
        del MODELS["tiny-test"]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(name="mlpp"), "unknown model 'mlpp'; choose one of cnn, mlp, softmax"),
        (dict(num_features=0), "num_features must be at least 1, got 0"),
        (dict(num_classes=1), "num_classes must be at least 2, got 1"),
        (dict(num_features=2.5), "num_features must be an integer, got 2.5"),
        (dict(hidden=(8, 0)), "hidden layer size must be at least 1, got 0"),
        (dict(hidden=("x",)), "hidden layer size must be an integer, got 'x'"),
        (dict(name="softmax", hidden=(8,)), r"model 'softmax' has no hidden layers, got hidden=\(8,\)"),
        (dict(dtype=np.float16), "dtype must be float32 or float64, got float16"),
    ],
)
def test_build_errors_name_the_value(kwargs, message):
    args = dict(name="mlp", num_features=4, num_classes=3, hidden=(5,)) | kwargs
    with pytest.raises(ValueError, match=message):
        build_model(**args)

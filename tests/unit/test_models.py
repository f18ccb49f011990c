"""Models: gradients against finite differences, the loss against plain NumPy, the protocol."""

import numpy as np
import pytest
from gradients import finite_difference_check

from ringtrain import backend
from ringtrain.models import MODELS, Model, build_model, register_model, softmax_cross_entropy

SHAPES = {  # name -> (model, hidden)
    "softmax": ("softmax", ()),
    "mlp1": ("mlp", (6,)),
    "mlp2": ("mlp", (6, 5)),
}


def batch(features=7, classes=4, rows=9, seed=1, xp=np):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, features))
    y = rng.integers(0, classes, rows)
    return xp.asarray(x), xp.asarray(y)


def reference_loss(params, x, y):
    """Mean cross-entropy written the obvious way, independent of ringtrain's code."""
    h = np.asarray(x, dtype=np.float64)
    n_layers = len(params) // 2
    for i in range(1, n_layers + 1):
        h = h @ params[f"fc{i}.weight"].astype(np.float64) + params[f"fc{i}.bias"].astype(np.float64)
        if i < n_layers:
            h = np.maximum(h, 0)
    p = np.exp(h - h.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    return float(-np.mean(np.log(p[np.arange(len(y)), y]))), int(np.sum(h.argmax(axis=1) == y))


@pytest.mark.parametrize("shape", SHAPES)
def test_gradients_match_central_finite_differences(shape):
    name, hidden = SHAPES[shape]
    model = build_model(name, 7, 4, hidden=hidden, seed=3, dtype=np.float64)
    x, y = batch()
    finite_difference_check(model, x, y)


@pytest.mark.gpu
def test_gradients_match_finite_differences_on_gpu():
    if not backend.gpu_available():
        pytest.skip("no GPU: backend.gpu_available() is False")
    xp = backend.xp_for("gpu")
    model = build_model("mlp", 7, 4, hidden=(6, 5), xp=xp, seed=3, dtype=np.float64)
    x, y = batch(xp=xp)
    finite_difference_check(model, x, y)
    cpu = build_model("mlp", 7, 4, hidden=(6, 5), seed=3, dtype=np.float64)
    for k in cpu.params:  # built on the host, so the GPU starts from the same values
        np.testing.assert_array_equal(backend.to_numpy(model.params[k]), cpu.params[k])
    loss_gpu = model.loss_and_grad(x, y)[0]
    loss_cpu = cpu.loss_and_grad(*batch())[0]
    assert loss_gpu == pytest.approx(loss_cpu, rel=1e-12)


@pytest.mark.parametrize("shape", SHAPES)
def test_loss_and_correct_match_plain_numpy(shape):
    name, hidden = SHAPES[shape]
    model = build_model(name, 7, 4, hidden=hidden, seed=5)
    x, y = batch(rows=33)
    loss, grads, correct = model.loss_and_grad(x, y)
    want_loss, want_correct = reference_loss(model.params, x, y)
    assert isinstance(loss, float) and isinstance(correct, int)
    assert loss == pytest.approx(want_loss, rel=1e-5)
    assert correct == want_correct
    assert list(grads) == list(model.params)
    for k, p in model.params.items():
        assert grads[k].shape == p.shape and grads[k].dtype == p.dtype == np.float32


def test_loss_is_stable_for_huge_logits():
    model = build_model("softmax", 3, 2, seed=0, dtype=np.float32)
    model.params["fc1.weight"][...] = [[1e4, -1e4], [0, 0], [0, 0]]
    x = np.array([[1.0, 0, 0], [-1.0, 0, 0]], dtype=np.float32)
    loss, grads, correct = model.loss_and_grad(x, np.array([0, 0]))
    assert np.isfinite(loss) and loss == pytest.approx(1e4, rel=1e-6)  # half the rows are off by 2e4
    assert all(np.isfinite(g).all() for g in grads.values()) and correct == 1


def test_on_grad_sees_each_final_gradient_once_last_layer_first():
    model = build_model("mlp", 7, 4, hidden=(6, 5), seed=0)
    x, y = batch()
    seen = []
    _, grads, _ = model.loss_and_grad(x, y, on_grad=lambda name, g: seen.append((name, g.copy())))
    assert [name for name, _ in seen] == list(reversed(model.params))
    for name, g in seen:
        np.testing.assert_array_equal(g, grads[name])


def test_on_grad_may_change_a_gradient_in_place_without_disturbing_the_rest():
    # The trainer averages gradients in place as they arrive, while backward goes on.
    model = build_model("mlp", 7, 4, hidden=(6, 5), seed=0)
    x, y = batch()
    plain = {k: g.copy() for k, g in model.loss_and_grad(x, y)[1].items()}

    def halve(name, g):
        g *= 0.5

    _, grads, _ = model.loss_and_grad(x, y, on_grad=halve)
    for k in plain:
        np.testing.assert_array_equal(grads[k], plain[k] * np.float32(0.5))


def test_grads_are_reused_buffers_in_on_grad_order():
    model = build_model("mlp", 7, 4, hidden=(6,), seed=0)
    x, y = batch()
    first = model.loss_and_grad(x, y)[1]
    second = model.loss_and_grad(x[:5], y[:5])[1]
    assert all(first[k] is second[k] for k in first)
    order = list(reversed(model.params))
    assert np.shares_memory(first[order[0]], model.grad_buffer)
    flat = np.concatenate([first[k].ravel() for k in order])
    np.testing.assert_array_equal(flat, model.grad_buffer)


def test_identical_inputs_give_bitwise_identical_results():
    x, y = batch(rows=20)
    a, b = (build_model("mlp", 7, 4, hidden=(8, 8), seed=9) for _ in range(2))
    for k in a.params:
        np.testing.assert_array_equal(a.params[k], b.params[k])
    for _ in range(2):  # the second call reuses the buffers
        la, ga, _ = a.loss_and_grad(x, y)
        lb, gb, _ = b.loss_and_grad(x, y)
        assert la == lb
        for k in ga:
            np.testing.assert_array_equal(ga[k], gb[k])


def test_seeds_differ_and_biases_start_at_zero():
    a = build_model("mlp", 7, 4, hidden=(8,), seed=0)
    b = build_model("mlp", 7, 4, hidden=(8,), seed=1)
    assert not np.array_equal(a.params["fc1.weight"], b.params["fc1.weight"])
    assert not a.params["fc1.bias"].any()
    assert list(a.params) == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    assert a.params["fc1.weight"].shape == (7, 8)


@pytest.mark.parametrize("batch_size", [4, 1024])
def test_evaluate_sums_match_loss_and_grad(batch_size):
    model = build_model("mlp", 7, 4, hidden=(6,), seed=2)
    x, y = batch(rows=11)
    loss, _, correct = model.loss_and_grad(x, y)
    loss_sum, eval_correct = model.evaluate(x, y, batch_size=batch_size)
    assert isinstance(loss_sum, float) and isinstance(eval_correct, int)
    assert loss_sum == pytest.approx(loss * 11, rel=1e-6)
    assert eval_correct == correct
    assert model.evaluate(x[:0], y[:0]) == (0.0, 0)  # a rank may hold no test rows


def test_logits_are_fresh_and_agree_with_the_reference():
    model = build_model("mlp", 7, 4, hidden=(6,), seed=2)
    x, y = batch(rows=5)
    out = model.logits(x)
    model.loss_and_grad(x, y)  # must not overwrite what logits returned
    assert out.shape == (5, 4)
    np.testing.assert_array_equal(out, model.logits(x))
    assert int((out.argmax(axis=1) == y).sum()) == reference_loss(model.params, x, y)[1]


def test_softmax_cross_entropy_helper():
    logits = np.array([[2.0, 1.0, 0.0], [0.0, 0.0, 5.0]])
    y = np.array([0, 1])
    loss_sum, correct, none = softmax_cross_entropy(logits, y)
    p = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    assert loss_sum == pytest.approx(-np.log(p[[0, 1], y]).sum()) and correct == 1 and none is None
    _, _, d = softmax_cross_entropy(logits.copy(), y, grad_scale=0.5)
    np.testing.assert_allclose(d, 0.5 * (p - np.eye(3)[y]))


def test_a_small_mlp_learns_digits():
    datasets = pytest.importorskip("sklearn.datasets")
    from ringtrain.optim import build_optimizer

    digits = datasets.load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target
    model = build_model("mlp", 64, 10, hidden=(64,), seed=0)
    opt = build_optimizer("sgd", model.params, lr=0.1, momentum=0.9)
    rng = np.random.default_rng(0)
    before = model.evaluate(x, y)[1] / len(y)
    for _ in range(300):
        rows = rng.integers(0, len(y), 64)
        _, grads, _ = model.loss_and_grad(x[rows], y[rows])
        opt.step(model.params, grads, 0.1)
    after = model.evaluate(x, y)[1] / len(y)
    assert before < 0.3 and after > 0.9, (before, after)


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
    x, y = batch(features=3, classes=2, rows=6)
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


def test_bad_batches_are_rejected():
    model = build_model("mlp", 4, 3, hidden=(5,))
    with pytest.raises(ValueError, match=r"x must have shape \(rows, 4\), got \(2, 5\)"):
        model.loss_and_grad(np.zeros((2, 5)), np.zeros(2, dtype=int))
    with pytest.raises(ValueError, match=r"y must have shape \(2,\)"):
        model.loss_and_grad(np.zeros((2, 4)), np.zeros(3, dtype=int))
    with pytest.raises(ValueError, match="integer class labels"):
        model.loss_and_grad(np.zeros((2, 4)), np.zeros(2))
    with pytest.raises(ValueError, match="empty batch"):
        model.loss_and_grad(np.zeros((0, 4)), np.zeros(0, dtype=int))


def test_flat_layout_finds_the_mlp_buffers_in_backward_order():
    from ringtrain.models import flat_layout

    model = build_model("mlp", 6, 3, hidden=(5, 4), seed=0)
    layout = flat_layout(model)
    assert list(layout.order) == list(reversed(model.params))
    base = model.param_buffer.__array_interface__["data"][0]
    offsets = [(model.params[n].__array_interface__["data"][0] - base) // 4 for n in layout.order]
    assert offsets == [layout.bounds[n][0] for n in layout.order] and offsets[0] == 0
    assert layout.size == model.param_buffer.size == sum(p.size for p in model.params.values())
    loss, grads, _ = model.loss_and_grad(np.ones((2, 6), np.float32), np.array([0, 2]))
    assert np.shares_memory(grads["fc1.weight"], model.grad_buffer)


def test_only_a_flat_model_has_a_layout_and_a_broken_one_is_named():
    from ringtrain.models import FlatModel, flat_layout

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


def test_rebind_moves_the_buffers_and_keeps_the_dicts():
    model = build_model("mlp", 6, 3, hidden=(5,), seed=0)
    params, grads = model.params, model.grads
    before = {k: v.copy() for k, v in params.items()}
    x, y = np.ones((2, 6), np.float32), np.array([0, 2])
    expected = model.loss_and_grad(x, y)[0]
    new_p, new_g = np.zeros_like(model.param_buffer), np.zeros_like(model.grad_buffer)
    model.rebind(new_p, new_g)
    assert model.params is params and model.grads is grads
    assert model.param_buffer is new_p and all(np.shares_memory(v, new_p) for v in params.values())
    assert all(np.array_equal(params[k], before[k]) for k in before)
    assert model.loss_and_grad(x, y)[0] == expected
    assert all(np.shares_memory(v, new_g) for v in grads.values())
    with pytest.raises(ValueError, match="flat buffers of 53 float32"):
        model.rebind(np.zeros(52, np.float32), new_g)

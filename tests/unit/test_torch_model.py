"""TorchModel against PyTorch itself: autograd's gradients, torch's SGD, the flat-buffer contract.

Every reference is a deep copy of the same module trained by plain PyTorch.
Skipped, with the reason, where torch is not installed.
"""

import copy

import numpy as np
import pytest

from ringtrain import backend
from ringtrain.models.base import flat_layout
from ringtrain.optim import build_optimizer

torch = pytest.importorskip("torch", reason="torch is not installed (pip install torch==2.13.0)")
from ringtrain.torch import TorchModel  # noqa: E402 - after the skip

SHAPE = (1, 8, 8)


def small_cnn(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(4 * 4 * 4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3),
    ).to(dtype)


def batch(rows=6, seed=1, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((rows, int(np.prod(SHAPE)))).astype(dtype), rng.integers(0, 3, rows)


def reference_step(module, x, y):
    """Loss, gradients and correct count from plain PyTorch on a copy of the module."""
    module.zero_grad(set_to_none=True)
    scores = module(torch.from_numpy(x).reshape(len(x), *SHAPE))
    loss = torch.nn.functional.cross_entropy(scores, torch.from_numpy(y))
    loss.backward()
    grads = {name: p.grad.numpy().copy() for name, p in module.named_parameters()}
    return float(loss.detach()), grads, int((scores.argmax(1) == torch.from_numpy(y)).sum())


def assert_close(got, want):
    torch.testing.assert_close(torch.as_tensor(np.asarray(got)), torch.as_tensor(np.asarray(want)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gradients_equal_torch_autograd_step_after_step(dtype):
    module = small_cnn(dtype=dtype)
    reference = copy.deepcopy(module)
    model = TorchModel(module, input_shape=SHAPE)
    np_dtype = np.float32 if dtype == torch.float32 else np.float64
    for seed in (1, 2):  # the second step must not add to the first's gradients
        x, y = batch(seed=seed, dtype=np_dtype)
        loss, grads, correct = model.loss_and_grad(x, y)
        want_loss, want_grads, want_correct = reference_step(reference, x, y)
        assert isinstance(loss, float) and isinstance(correct, int)
        assert loss == pytest.approx(want_loss, rel=1e-6) and correct == want_correct
        assert grads is model.grads and list(grads) == list(want_grads)
        for name in want_grads:
            assert_close(grads[name], want_grads[name])


def test_parameters_and_gradients_are_views_of_the_flat_buffers():
    module = small_cnn()
    values = {name: p.detach().clone() for name, p in module.named_parameters()}
    model = TorchModel(module, input_shape=SHAPE)
    layout = flat_layout(model)  # verifies every view
    assert layout.order == tuple(reversed(model.params))
    for name, p in module.named_parameters():
        assert torch.equal(p.detach(), values[name])  # moved, not changed
        assert p.data_ptr() == model.params[name].__array_interface__["data"][0]
        assert p.grad.data_ptr() == model.grads[name].__array_interface__["data"][0]
    model.param_buffer[...] = 0.5  # what ringtrain's optimizer does: the module sees it
    assert all(bool((p == 0.5).all()) for p in module.parameters())


def test_ringtrain_sgd_on_the_buffers_equals_torch_sgd_on_the_module():
    module = small_cnn()
    reference = copy.deepcopy(module)
    model = TorchModel(module, input_shape=SHAPE)
    opt = build_optimizer("sgd", model.params, lr=0.1, momentum=0.9, order=flat_layout(model).order)
    torch_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for seed in range(4):
        x, y = batch(seed=seed)
        _, grads, _ = model.loss_and_grad(x, y)
        opt.step(model.params, grads, 0.1)
        reference_step(reference, x, y)
        torch_opt.step()
    for (name, p), q in zip(module.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), msg=name)


def test_on_grad_delivers_each_gradient_once_in_reverse_order_during_backward():
    model = TorchModel(small_cnn(), input_shape=SHAPE)
    first = next(iter(model.params))  # the input layer: its gradient comes last
    seen = []

    def on_grad(name, grad):
        # While the last layer's gradient is delivered, the first layer's is not yet computed.
        seen.append((name, grad.copy(), bool((model.grads[first] == 0).all())))

    x, y = batch()
    _, grads, _ = model.loss_and_grad(x, y, on_grad=on_grad)
    assert [name for name, _, _ in seen] == list(reversed(model.params))
    assert seen[0][2], "the first delivery waited for the whole of backward"
    for name, delivered, _ in seen:
        np.testing.assert_array_equal(delivered, grads[name])  # final when delivered


def test_an_unused_parameter_gets_a_zero_gradient_delivered():
    class WithSpare(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net, self.spare = small_cnn(), torch.nn.Linear(2, 2)  # spare: never in forward

        def forward(self, x):
            return self.net(x)

    model = TorchModel(WithSpare(), input_shape=SHAPE)
    model.grad_buffer[...] = 7.0  # stale values from "an earlier step"
    seen = []
    _, grads, _ = model.loss_and_grad(*batch(), on_grad=lambda name, g: seen.append(name))
    assert sorted(seen) == sorted(model.params) and len(seen) == len(set(seen))
    assert not grads["spare.weight"].any() and not grads["spare.bias"].any()


def test_rebind_moves_the_module_into_the_new_buffers():
    module = small_cnn()
    model = TorchModel(module, input_shape=SHAPE)
    x, y = batch()
    want_loss, grads, _ = model.loss_and_grad(x, y)
    want_grads = {name: g.copy() for name, g in grads.items()}
    params, before = model.params, model.param_buffer.copy()
    new_p, new_g = np.zeros_like(model.param_buffer), np.zeros_like(model.grad_buffer)
    model.rebind(new_p, new_g)  # as the sharded step does with its shared-memory window
    assert model.params is params and model.param_buffer is new_p and model.grad_buffer is new_g
    np.testing.assert_array_equal(new_p, before)
    flat_layout(model)  # the views are where the layout says
    for name, p in module.named_parameters():
        assert p.data_ptr() == model.params[name].__array_interface__["data"][0]
        assert p.grad.data_ptr() == model.grads[name].__array_interface__["data"][0]
    new_g[...] = 0
    loss, grads, _ = model.loss_and_grad(x, y)
    assert loss == want_loss
    for name in want_grads:
        np.testing.assert_array_equal(grads[name], want_grads[name])
        assert np.shares_memory(grads[name], new_g)
    new_p[...] = 0  # the optimizer writing the new buffer reaches the module
    assert all(not p.detach().any() for p in module.parameters())


def test_evaluate_and_logits_match_torch_in_eval_mode():
    module = small_cnn()
    reference = copy.deepcopy(module).eval()
    model = TorchModel(module, input_shape=SHAPE)
    x, y = batch(rows=11)
    with torch.no_grad():
        scores = reference(torch.from_numpy(x).reshape(11, *SHAPE))
        want = float(torch.nn.functional.cross_entropy(scores, torch.from_numpy(y), reduction="sum"))
    loss_sum, correct = model.evaluate(x, y, batch_size=4)  # three chunks
    assert loss_sum == pytest.approx(want, rel=1e-6)
    assert correct == int((scores.argmax(1) == torch.from_numpy(y)).sum())
    np.testing.assert_allclose(model.logits(x), scores.numpy(), rtol=1e-6)


def test_a_custom_mean_loss_is_used_for_training_and_summed_for_evaluation():
    def loss(scores, labels):
        return torch.nn.functional.nll_loss(torch.log_softmax(scores, dim=1), labels)

    model = TorchModel(small_cnn(), loss, input_shape=SHAPE)
    plain = TorchModel(small_cnn(), input_shape=SHAPE)
    x, y = batch(rows=9)
    assert model.loss_and_grad(x, y)[0] == pytest.approx(plain.loss_and_grad(x, y)[0], rel=1e-6)
    assert model.evaluate(x, y)[0] == pytest.approx(plain.evaluate(x, y)[0], rel=1e-6)


@pytest.mark.parametrize("build, message", [
    (lambda: torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)),
     "module buffer '1.running_mean' would be neither averaged across ranks nor checkpointed"),
    (lambda: torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2).double()),
     "one device with one dtype, got cpu and torch.float32, torch.float64"),
    (lambda: torch.nn.Linear(4, 2).requires_grad_(False), "no parameters that require gradients"),
])
def test_modules_it_cannot_train_faithfully_are_refused_by_name(build, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        TorchModel(build())


def test_a_batch_of_the_wrong_width_is_one_clear_error():
    model = TorchModel(small_cnn(), input_shape=SHAPE)
    with pytest.raises(ValueError, match=r"x must have shape \(rows, 64\) for input_shape \(1, 8, 8\), got \(2, 63\)"):
        model.loss_and_grad(np.zeros((2, 63), np.float32), np.zeros(2, np.int64))


@pytest.mark.gpu
def test_cuda_module_trains_through_cupy_views():
    if not torch.cuda.is_available() or not backend.gpu_available():
        pytest.skip("no GPU: torch.cuda.is_available() or backend.gpu_available() is False")
    xp = backend.xp_for("gpu")
    module = small_cnn().cuda()
    reference = copy.deepcopy(module)
    model = TorchModel(module, input_shape=SHAPE)
    assert backend.is_gpu_array(model.param_buffer)
    x, y = batch()
    _, grads, _ = model.loss_and_grad(xp.asarray(x), xp.asarray(y))
    reference.zero_grad()
    torch.nn.functional.cross_entropy(reference(torch.from_numpy(x).cuda().reshape(6, *SHAPE)),
                                      torch.from_numpy(y).cuda()).backward()
    for name, p in reference.named_parameters():
        assert_close(backend.to_numpy(grads[name]), p.grad.cpu().numpy())

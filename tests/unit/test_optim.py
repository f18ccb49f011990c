"""Optimisers against straightforward reference implementations; schedules; exact resume."""

import math

import numpy as np
import pytest

from ringtrain.optim import build_optimizer, learning_rate, scaled_lr


def make_params(seed=0, dtype=np.float64):
    rng = np.random.default_rng(seed)
    return {"fc1.weight": rng.standard_normal((4, 3)).astype(dtype), "fc1.bias": rng.standard_normal(3).astype(dtype)}


def grads_for(step, params):
    rng = np.random.default_rng(100 + step)
    return {k: rng.standard_normal(p.shape).astype(p.dtype) for k, p in params.items()}


def reference_sgd(params, steps, lrs, momentum, weight_decay, nesterov):
    params = {k: p.copy() for k, p in params.items()}
    buf = {k: np.zeros_like(p) for k, p in params.items()}
    for t in range(steps):
        for k, g in grads_for(t, params).items():
            g = g + weight_decay * params[k]
            buf[k] = momentum * buf[k] + g
            update = g + momentum * buf[k] if nesterov else buf[k]
            params[k] = params[k] - lrs[t] * update
    return params


def reference_adamw(params, steps, lrs, betas, eps, weight_decay):
    params = {k: p.copy() for k, p in params.items()}
    m = {k: np.zeros_like(p) for k, p in params.items()}
    v = {k: np.zeros_like(p) for k, p in params.items()}
    b1, b2 = betas
    for t in range(1, steps + 1):
        for k, g in grads_for(t - 1, params).items():
            params[k] = params[k] * (1 - lrs[t - 1] * weight_decay)
            m[k] = b1 * m[k] + (1 - b1) * g
            v[k] = b2 * v[k] + (1 - b2) * g * g
            m_hat, v_hat = m[k] / (1 - b1**t), v[k] / (1 - b2**t)
            params[k] = params[k] - lrs[t - 1] * m_hat / (np.sqrt(v_hat) + eps)
    return params


def run(opt, params, steps, lrs, start=0):
    for t in range(start, start + steps):
        opt.step(params, grads_for(t, params), lrs[t])
    return params


LRS = [0.1, 0.05, 0.2, 0.1, 0.01]


@pytest.mark.parametrize(
    "momentum, weight_decay, nesterov",
    [(0.0, 0.0, False), (0.9, 0.0, False), (0.9, 0.01, False), (0.8, 0.01, True)],
)
def test_sgd_matches_reference(momentum, weight_decay, nesterov):
    start = make_params()
    opt = build_optimizer("sgd", start, lr=0.1, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov)
    params = {k: p.copy() for k, p in start.items()}
    same_arrays = dict(params)
    run(opt, params, 5, LRS)
    want = reference_sgd(start, 5, LRS, momentum, weight_decay, nesterov)
    for k in params:
        assert params[k] is same_arrays[k]  # updated in place
        np.testing.assert_allclose(params[k], want[k], rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adam_matches_reference_adamw(weight_decay):
    start = make_params()
    opt = build_optimizer("adam", start, lr=0.1, weight_decay=weight_decay, betas=(0.8, 0.99), eps=1e-6)
    params = run(opt, {k: p.copy() for k, p in start.items()}, 5, LRS)
    want = reference_adamw(start, 5, LRS, (0.8, 0.99), 1e-6, weight_decay)
    for k in params:
        np.testing.assert_allclose(params[k], want[k], rtol=1e-12, atol=1e-14)
    assert int(opt.state_dict()["adam.step"]) == 5


def test_step_leaves_gradients_alone():
    params = make_params(dtype=np.float32)
    grads = grads_for(0, params)
    kept = {k: g.copy() for k, g in grads.items()}
    for name in ("sgd", "adam"):
        build_optimizer(name, params, lr=0.1, weight_decay=0.1).step(params, grads, 0.1)
    for k in grads:
        np.testing.assert_array_equal(grads[k], kept[k])
        assert params[k].dtype == np.float32


@pytest.mark.parametrize("name, keys", [
    ("sgd", ["momentum/fc1.weight", "momentum/fc1.bias"]),
    ("adam", ["adam.m/fc1.weight", "adam.m/fc1.bias", "adam.v/fc1.weight", "adam.v/fc1.bias", "adam.step"]),
])
def test_state_dict_round_trip_continues_bitwise(name, keys):
    lrs = LRS * 2
    straight = make_params(dtype=np.float32)
    opt = build_optimizer(name, straight, lr=0.1, weight_decay=0.01)
    run(opt, straight, 10, lrs)

    first = make_params(dtype=np.float32)
    opt = build_optimizer(name, first, lr=0.1, weight_decay=0.01)
    run(opt, first, 4, lrs)
    state, resumed = opt.state_dict(), {k: p.copy() for k, p in first.items()}  # the checkpoint
    assert list(state) == keys and all(isinstance(a, np.ndarray) for a in state.values())
    run(opt, first, 1, lrs, start=4)  # the saved state is a copy, not a view of live buffers

    fresh = build_optimizer(name, resumed, lr=0.1, weight_decay=0.01)
    fresh.load_state_dict(state)
    run(fresh, resumed, 6, lrs, start=4)
    for k in straight:
        np.testing.assert_array_equal(resumed[k], straight[k])


def test_sgd_without_momentum_keeps_no_state():
    opt = build_optimizer("sgd", make_params(), lr=0.1, momentum=0.0)
    assert opt.state_dict() == {}
    opt.load_state_dict({})


def test_load_state_dict_rejects_mismatches():
    opt = build_optimizer("sgd", make_params(), lr=0.1)
    state = opt.state_dict()
    with pytest.raises(ValueError, match=r"missing \['momentum/fc1.bias'\], unexpected \['momentum/fc9.bias'\]"):
        opt.load_state_dict({"momentum/fc1.weight": state["momentum/fc1.weight"],
                             "momentum/fc9.bias": state["momentum/fc1.bias"]})
    bad = dict(state, **{"momentum/fc1.bias": np.zeros(4)})
    with pytest.raises(ValueError, match=r"'momentum/fc1.bias' has shape \(4,\)"):
        opt.load_state_dict(bad)
    with pytest.raises(ValueError, match="step expects parameters and gradients named"):
        opt.step(make_params(), {"fc1.weight": np.zeros((4, 3))}, 0.1)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda p: build_optimizer("sgdd", p, lr=0.1), "unknown optimizer 'sgdd'; choose one of adam, sgd"),
        (lambda p: build_optimizer("sgd", p, lr=0.0), "learning rate must be above 0, got 0.0"),
        (lambda p: build_optimizer("sgd", p, lr=0.1, momentum=1.0), r"momentum must be in \[0, 1\), got 1.0"),
        (lambda p: build_optimizer("sgd", p, lr=0.1, weight_decay=-1), "weight_decay must be at least 0, got -1"),
        (lambda p: build_optimizer("sgd", p, lr=0.1, momentum=0, nesterov=True), "nesterov needs a momentum"),
        (lambda p: build_optimizer("adam", p, lr=0.1, betas=(0.9, 1.0)), r"betas must each be in \[0, 1\)"),
        (lambda p: build_optimizer("adam", p, lr=0.1, eps=0), "eps must be above 0, got 0"),
        (lambda p: build_optimizer("adam", {}, lr=0.1), "empty parameter dict"),
    ],
)
def test_optimizer_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call(make_params())


def test_warmup_is_linear_up_to_the_base_rate():
    lrs = [learning_rate(s, 0.4, warmup_steps=4) for s in range(6)]
    assert lrs == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.4, 0.4])
    assert learning_rate(0, 0.4) == 0.4


def test_cosine_decays_to_zero_after_warmup():
    assert learning_rate(1, 1.0, warmup_steps=2, total_steps=12, schedule="cosine") == pytest.approx(1.0)
    assert learning_rate(2, 1.0, warmup_steps=2, total_steps=12, schedule="cosine") == pytest.approx(1.0)
    assert learning_rate(7, 1.0, warmup_steps=2, total_steps=12, schedule="cosine") == pytest.approx(0.5)
    want = 0.5 * (1 + math.cos(math.pi * 0.3))
    assert learning_rate(5, 1.0, warmup_steps=2, total_steps=12, schedule="cosine") == pytest.approx(want)
    assert learning_rate(12, 1.0, warmup_steps=2, total_steps=12, schedule="cosine") == pytest.approx(0.0)
    assert learning_rate(50, 1.0, warmup_steps=2, total_steps=12, schedule="cosine") == pytest.approx(0.0)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(schedule="linear"), "unknown schedule 'linear'; choose one of constant, cosine"),
        (dict(step=-1), "step must be at least 0, got -1"),
        (dict(warmup_steps=-2), "warmup_steps must be at least 0, got -2"),
        (dict(schedule="cosine"), "schedule 'cosine' needs total_steps above warmup_steps"),
        (dict(schedule="cosine", warmup_steps=5, total_steps=5), "needs total_steps above warmup_steps"),
    ],
)
def test_schedule_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        learning_rate(**(dict(step=0, base_lr=0.1) | kwargs))


def test_linear_scaling_is_off_by_default():
    assert scaled_lr(0.1, 8) == 0.1
    assert scaled_lr(0.1, 8, enabled=True) == pytest.approx(0.8)
    assert scaled_lr(0.1, 1, enabled=True) == 0.1
    with pytest.raises(ValueError, match="world_size must be at least 1, got 0"):
        scaled_lr(0.1, 0, enabled=True)


# -- the flat layout and step_slice (what the sharded step uses) ----------------

SLICE_CASES = [
    ("sgd", dict(momentum=0.9)),
    ("sgd", dict(momentum=0.9, weight_decay=0.01, nesterov=True)),
    ("sgd", dict(momentum=0.0)),
    ("adam", dict(weight_decay=0.05)),
]


def flat_copy(params, order):
    """``params`` copied into one flat buffer laid out in ``order``: (buffer, name -> view)."""
    flat = np.concatenate([params[k].ravel() for k in order])
    views, offset = {}, 0
    for k in order:
        views[k] = flat[offset:offset + params[k].size].reshape(params[k].shape)
        offset += params[k].size
    return flat, {k: views[k] for k in params}


@pytest.mark.parametrize("name, settings", SLICE_CASES)
@pytest.mark.parametrize("pieces", [1, 2, 3, 7])
def test_step_slice_over_any_cut_of_the_layout_is_bitwise_the_whole_step(name, settings, pieces):
    # As the sharded step uses it: one optimizer per piece (per rank), each
    # updating only its range of one shared flat buffer, once per step.
    params = make_params(seed=3, dtype=np.float32)
    order = list(reversed(params))  # the MLP's backward order
    whole = {k: p.copy() for k, p in params.items()}
    whole_opt = build_optimizer(name, whole, lr=0.1, **settings)
    flat_p, sliced = flat_copy(params, order)
    cuts = np.linspace(0, flat_p.size, pieces + 1).astype(int)
    opts = [build_optimizer(name, sliced, lr=0.1, order=order, **settings) for _ in range(pieces)]
    for t in range(4):
        grads = grads_for(t, params)
        whole_opt.step(whole, grads, 0.1 * (t + 1))
        flat_g, _ = flat_copy(grads, order)
        for opt, a, b in zip(opts, cuts, cuts[1:]):
            opt.step_slice(flat_p[a:b], flat_g[a:b], 0.1 * (t + 1), a, b)
    for k in params:
        assert np.array_equal(sliced[k], whole[k]), k
    expected = whole_opt.state_dict()
    slots = sorted({key.split("/")[0] for key in expected if "/" in key})
    for opt, a, b in zip(opts, cuts, cuts[1:]):
        state = opt.state_dict()
        assert state.keys() == expected.keys()
        for slot, mine in zip(slots, opt.flat_state()):
            reference, _ = flat_copy({k: expected[f"{slot}/{k}"] for k in params}, order)
            assert np.array_equal(mine[a:b], reference[a:b]), slot
        for key in expected:
            if "/" not in key:  # scalar counters (Adam's step)
                assert state[key] == expected[key], key


def test_flat_state_is_laid_out_in_the_given_order():
    params = make_params(dtype=np.float32)
    opt = build_optimizer("adam", params, lr=0.1, order=["fc1.bias", "fc1.weight"])
    m = opt.flat_state()[0]
    opt.load_state_dict({**opt.state_dict(), "adam.m/fc1.bias": np.arange(3, dtype=np.float32)})
    assert opt.flat and m.size == 15 and list(m[:3]) == [0, 1, 2]


def test_step_slice_needs_one_dtype_and_a_range_that_fits():
    mixed = {"a": np.zeros(3, np.float32), "b": np.zeros(2, np.float64)}
    opt = build_optimizer("sgd", mixed, lr=0.1)
    assert not opt.flat and opt.flat_state() == []
    with pytest.raises(ValueError, match="same dtype"):
        opt.step_slice(np.zeros(3, np.float32), np.zeros(3, np.float32), 0.1, 0, 3)
    flat = build_optimizer("sgd", make_params(dtype=np.float32), lr=0.1)
    with pytest.raises(ValueError, match="do not fit"):
        flat.step_slice(np.zeros(4, np.float32), np.zeros(4, np.float32), 0.1, 13, 17)
    with pytest.raises(ValueError, match="name each parameter once"):
        build_optimizer("sgd", make_params(), lr=0.1, order=["fc1.bias"])


@pytest.mark.parametrize("name, settings", [("sgd", dict(momentum=0.9, weight_decay=0.01, nesterov=True)),
                                            ("sgd", dict(momentum=0.0)), ("adam", dict(weight_decay=0.05))])
def test_a_flat_models_update_in_one_pass_is_bitwise_the_per_parameter_update(name, settings):
    # A FlatModel's parameters and gradients are views of one buffer each: step()
    # then updates the buffers in one pass (on a GPU a few kernels, not a few per
    # parameter). The same parameters in separate arrays take the per-parameter path.
    from ringtrain.models import build_model, flat_layout

    model = build_model("mlp", 9, 3, hidden=(7, 5), seed=2)
    order = flat_layout(model).order
    loose = {n: p.copy() for n, p in model.params.items()}
    flat_opt = build_optimizer(name, model.params, lr=0.1, order=order, **settings)
    loose_opt = build_optimizer(name, loose, lr=0.1, order=order, **settings)
    rng = np.random.default_rng(4)
    for step in range(3):
        model.grad_buffer[...] = rng.standard_normal(model.grad_buffer.size)
        flat_opt.step(model.params, model.grads, 0.1 / (step + 1))
        loose_opt.step(loose, {n: g.copy() for n, g in model.grads.items()}, 0.1 / (step + 1))
    assert all(np.array_equal(model.params[n], loose[n]) for n in loose)
    assert all(np.array_equal(a, b) for a, b in zip(flat_opt.state_dict().values(), loose_opt.state_dict().values()))

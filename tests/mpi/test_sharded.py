"""The sharded optimizer step against the allreduce and the whole step it replaces.

Runs at 1, 2, 3 and 4 ranks. The reference is computed in the same process
with ringtrain's own allreduce over the same transport, then
``Optimizer.step``; the sharded step must match it bitwise. Each test ends
its collectives before asserting.
"""

import numpy as np
import pytest
from mpi4py import MPI

from ringtrain.comm import allreduce_
from ringtrain.comm.policy import WINDOW_BYTES
from ringtrain.models import build_model, flat_layout
from ringtrain.optim import build_optimizer
from ringtrain.training.sharded import ShardedStep

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
OPTIMIZERS = [("sgd", dict(momentum=0.9, weight_decay=0.01, nesterov=True)), ("adam", dict(weight_decay=0.05))]
# 7-5-3: 58 parameters (a few per rank at 4 ranks); 40-48-24-4: 3,244.
SHAPES = [(7, (5,), 3), (40, (48, 24), 4)]


def model_and_optimizer(shape, name, settings):
    features, hidden, classes = shape
    model = build_model("mlp", features, classes, hidden=hidden, seed=1)
    return model, build_optimizer(name, model.params, lr=0.1, order=flat_layout(model).order, **settings)


def batch(shape, step):
    """This rank's batch for ``step``: different on every rank."""
    rng = np.random.default_rng(100 * step + rank)
    features, _, classes = shape
    return rng.standard_normal((6, features)).astype(np.float32), rng.integers(0, classes, 6)


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", ["shm", "ring", "mpi", "hierarchical"])
@pytest.mark.parametrize("name, settings", OPTIMIZERS)
@pytest.mark.parametrize("shape", SHAPES)
def test_sharded_step_is_bitwise_the_allreduce_then_the_whole_step(algorithm, name, settings, shape):
    reference, ref_opt = model_and_optimizer(shape, name, settings)
    model, opt = model_and_optimizer(shape, name, settings)
    sharded = ShardedStep.create(model, opt, comm, algorithm)
    # Moved into the window: read in place by the peers (only on shared memory).
    arena = getattr(sharded.transport, "arena", None)
    in_place = arena is not None and np.shares_memory(model.param_buffer, arena.extras[rank])
    metrics = np.zeros(3)
    for step in range(5):
        x, y = batch(shape, step)
        reference.loss_and_grad(x, y)
        allreduce_(reference.grad_buffer, op="mean", comm=comm, transport=algorithm)
        ref_opt.step(reference.params, reference.grads, 0.1)
        loss, _, correct = model.loss_and_grad(x, y)
        sharded.reduce_gradients()
        metrics[:] = (loss, correct, 1.0)
        sharded.sum_small(metrics)
        sharded.update(0.1)
        sharded.allgather()
    sharded.gather_state()
    kind = sharded.kind
    sharded.close()  # moves the buffers back out: the window is gone
    everyone = comm.allgather(model.param_buffer.tobytes())
    assert kind == (algorithm if size > 1 else "local")  # one rank: the same loop, no communication
    assert in_place == (algorithm == "shm" and size > 1)
    assert metrics[2] == size
    assert all(e == everyone[0] for e in everyone)
    expected = ref_opt.state_dict()
    if algorithm == "mpi":  # MPI's Reduce_scatter and Allreduce may add in different orders
        np.testing.assert_allclose(model.param_buffer, reference.param_buffer, rtol=1e-5, atol=1e-6)
        for key, value in opt.state_dict().items():
            np.testing.assert_allclose(value, expected[key], rtol=1e-4, atol=1e-6, err_msg=key)
        return
    assert np.array_equal(model.param_buffer, reference.param_buffer)
    for key, value in opt.state_dict().items():
        assert np.array_equal(value, expected[key]), key


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", ["shm", "ring", "mpi", "hierarchical"])
def test_small_sum_is_mpis_sum_and_a_bad_chunk_is_known_everywhere(algorithm):
    model, opt = model_and_optimizer(SHAPES[0], "sgd", {})
    sharded = ShardedStep.create(model, opt, comm, algorithm)
    values = np.array([rank + 1.0, 0.25 * rank, 2.0**-rank])
    expected = comm.allreduce(values.copy(), op=MPI.SUM)
    sharded.sum_small(values)
    # Phases may come in any order: three sums back to back, each with its own values.
    more = [np.array([rank * k, -1.0]) for k in range(3)]
    for m in more:
        sharded.sum_small(m)
    # The last rank alone has a NaN gradient, in a chunk some rank owns.
    model.grad_buffer[:] = 1.0
    if rank == size - 1:
        model.grad_buffer[model.grad_buffer.size // 2] = np.nan
    chunk = sharded.reduce_gradients()
    bad = np.array([0.0 if np.isfinite(chunk).all() else 1.0])
    sharded.sum_small(bad)
    sharded.close()
    np.testing.assert_allclose(values, expected, rtol=1e-15)
    assert [list(m) for m in more] == [[k * size * (size - 1) / 2, -size] for k in range(3)]
    assert bad[0] == 1.0


@pytest.mark.mpi
def test_create_declines_where_the_step_cannot_be_sharded():
    model, opt = model_and_optimizer(SHAPES[0], "sgd", {})
    unordered = build_optimizer("sgd", model.params, lr=0.1)  # state in the params' order, not the buffer's
    big = build_model("mlp", 1024, 10, hidden=(WINDOW_BYTES // 4096 + 64,), seed=0)  # past the window's cap for "auto"
    big_opt = build_optimizer("sgd", big.params, lr=0.1, order=flat_layout(big).order)

    class Loose:  # not a FlatModel: no flat buffers to shard
        params = {k: v.copy() for k, v in model.params.items()}
        grads = {k: v.copy() for k, v in model.grads.items()}

    declined = [ShardedStep.create(model, unordered, comm, "auto"),
                ShardedStep.create(Loose(), build_optimizer("sgd", Loose.params, lr=0.1), comm, "auto")]
    # Every host (here one) runs the same number of ranks: the hierarchical transport has both phases.
    hierarchical = ShardedStep.create(model, opt, comm, "hierarchical")
    hierarchical_kind = hierarchical.kind
    kinds = []
    for m, o, algorithm in [(big, big_opt, "auto"), (big, big_opt, "shm"), (model, opt, "mpi"), (model, opt, "auto")]:
        made = ShardedStep.create(m, o, comm, algorithm)
        kinds.append(made.kind)
        made.close()
    hierarchical.close()
    assert declined == [None] * len(declined)
    assert hierarchical_kind == ("local" if size == 1 else "hierarchical")
    # Past the cap: the ring; "shm" forced takes any size; "mpi" forced; small on one host: shared memory.
    assert kinds == (["local"] * 4 if size == 1 else ["ring", "shm", "mpi", "shm"])


@pytest.mark.mpi
def test_a_window_that_cannot_take_the_buffers_falls_back_instead_of_dying(monkeypatch):
    # CUDA IPC maps two model-sized allocations after the transport is made;
    # where any rank cannot (every rank hears it: the mapping is agreed), the
    # step must give way to the allreduce, not end the run. The same path on
    # the CPU window, whose share() is made to fail on every rank.
    from ringtrain.comm.transports.shm import WindowTransport

    def refuse(self, n, dtype):
        raise RuntimeError("CUDA IPC is unavailable (rank 1: OutOfMemoryError)")

    monkeypatch.setattr(WindowTransport, "share", refuse)
    model, opt = model_and_optimizer(SHAPES[1], "sgd", {})
    before = model.param_buffer
    made = ShardedStep.create(model, opt, comm, "shm")
    x = np.full(5, rank + 1.0)
    allreduce_(x, "sum", comm)  # the ranks are still in step
    kind = made.kind if made is not None else None
    if made is not None:
        made.close()
    assert (kind == "local") if size == 1 else (made is None and model.param_buffer is before)
    assert np.array_equal(x, np.full(5, size * (size + 1) / 2))

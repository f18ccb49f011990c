"""The CUDA IPC peer window on CuPy arrays: against MPI's own Allreduce, against itself, in the sharded step.

Runs at 1 to 4 ranks where CuPy sees a GPU (several ranks may share one);
elsewhere every test is collected and skipped with the reason. Each test
finishes its collectives before it asserts.
"""

import numpy as np
import pytest
from mpi4py import MPI
from references import data, reference, same_everywhere

from ringtrain import backend
from ringtrain.comm import allreduce_
from ringtrain.comm.state import CommState
from ringtrain.comm.transports import create_transport
from ringtrain.models import build_model, flat_layout
from ringtrain.optim import build_optimizer
from ringtrain.training.sharded import ShardedStep

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
pytestmark = pytest.mark.skipif(not backend.gpu_available(), reason="no CUDA GPU visible to CuPy on this machine")
LENGTHS = [3, 100_003, (64 << 20) // 4 + 5]


@pytest.fixture(scope="module")
def cp():
    backend.use_device(rank % backend.device_count())
    import cupy

    return cupy


@pytest.mark.mpi
@pytest.mark.parametrize("n", LENGTHS)
def test_cuda_ipc_allreduce_matches_mpi_and_its_phases(cp, n):
    dup = comm.Dup()
    transport = create_transport("cuda-ipc", dup)
    host = data(n, np.float32, 5)
    fused, phased = cp.asarray(host), cp.asarray(host)
    transport.allreduce(fused)
    transport.reduce_scatter(phased)
    transport.allgather(phased)
    want = reference(host)
    got, again = cp.asnumpy(fused), cp.asnumpy(phased)
    everywhere = same_everywhere(got)
    transport.close()
    dup.Free()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    assert np.array_equal(got, again) and everywhere


@pytest.mark.mpi
def test_back_to_back_fused_allreduces_reuse_the_halves_safely_and_give_the_phases_bits(cp):
    # The fused allreduce stages a whole call in one half and reads its peers'
    # slots after its last barrier: calls that follow at once, fused or phased,
    # must not overwrite a half a slow peer still reads.
    dup = comm.Dup()
    transport = create_transport("cuda-ipc", dup)
    wants, fused, phased = [], [], []
    for trial, (n, dtype, op) in enumerate([(100_003, np.float32, "sum"), (65_537, np.float64, "max"),
                                            (3, np.float32, "sum"), (200_001, np.int64, "min"),
                                            (100_003, np.float32, "sum"), (1 << 20, np.float32, "sum")]):
        combine = {"sum": np.add, "max": np.maximum, "min": np.minimum}[op]
        host = data(n, dtype, 40 + trial)
        x, y = cp.asarray(host), cp.asarray(host)
        transport.allreduce(x, combine)
        transport.reduce_scatter(y, combine)
        transport.allgather(y)
        fused.append(cp.asnumpy(x))
        phased.append(cp.asnumpy(y))
        wants.append(reference(host, op))
    everywhere = [same_everywhere(f) for f in fused]
    transport.close()
    dup.Free()
    for got, again, want in zip(fused, phased, wants):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
        assert np.array_equal(got, again)
    assert all(everywhere)


@pytest.mark.mpi
def test_allreduce_of_a_cupy_array_takes_cuda_ipc_on_one_host(cp):
    x = cp.asarray(data(1 << 20, np.float64, 6))
    want = reference(cp.asnumpy(x), "mean")
    allreduce_(x, "mean", comm)
    names = [t.name for t in CommState.of(comm)._transports.values() if t is not None]
    got = cp.asnumpy(x)
    assert np.allclose(got, want, rtol=1e-12) and same_everywhere(got)
    assert size == 1 or "cuda-ipc" in names


@pytest.mark.mpi
@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_sharded_step_on_the_gpu_is_bitwise_the_allreduce_then_the_whole_step(cp, name):
    def made():
        model = build_model("mlp", 40, 4, hidden=(48, 24), xp=cp, seed=1)
        return model, build_optimizer(name, model.params, lr=0.1, order=flat_layout(model).order)

    reference_model, ref_opt = made()
    model, opt = made()
    sharded = ShardedStep.create(model, opt, comm)
    for step in range(4):
        rng = np.random.default_rng(100 * step + rank)
        x = cp.asarray(rng.standard_normal((6, 40)).astype(np.float32))
        y = cp.asarray(rng.integers(0, 4, 6))
        reference_model.loss_and_grad(x, y)
        allreduce_(reference_model.grad_buffer, op="mean", comm=comm, transport="shm")
        ref_opt.step(reference_model.params, reference_model.grads, 0.1)
        model.loss_and_grad(x, y)
        sharded.reduce_gradients()
        sharded.update(0.1)
        sharded.allgather()
    kind = sharded.kind
    sharded.close()
    got, want = cp.asnumpy(model.param_buffer), cp.asnumpy(reference_model.param_buffer)
    assert kind == ("cuda-ipc" if size > 1 else "local")
    assert np.array_equal(got, want) and same_everywhere(got)

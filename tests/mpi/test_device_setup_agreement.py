"""Setting up device memory that peers map is agreed by every rank: checked here without a GPU.

CUDA IPC's set-up (:class:`ringtrain.comm.transports.cuda_ipc._Mapped`) and
the sharded step's move into a window may fail on one rank only (out of
memory with many ranks on one GPU, a container that forbids IPC). Every
rank must then learn it in the same call and take the same fallback, or the
others wait for ever in the next collective. The device calls are stood in
for by host ones, so the agreement itself runs at 1 to 4 ranks anywhere.
Each test finishes its collectives before it asserts.
"""

import warnings

import numpy as np
import pytest
from mpi4py import MPI

from ringtrain import backend
from ringtrain.comm.transports import cuda_ipc
from ringtrain.comm.transports.shm import WindowTransport
from ringtrain.models import build_model, flat_layout
from ringtrain.optim import build_optimizer
from ringtrain.training.sharded import ShardedStep

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()


class HostStandIns:
    """backend's device-memory calls on host memory; ``fail`` names (rank, call) pairs that raise."""

    def __init__(self, fail):
        self.fail, self.opened, self.closed = fail, [], []

    def device_buffer(self, nbytes):
        self._maybe_fail("device_buffer")
        return np.zeros(max(nbytes, 1), np.uint8)

    def ipc_handle(self, array):
        return f"handle of rank {rank}".encode(), 0

    def open_ipc(self, handle, offset, nbytes):
        self._maybe_fail("open_ipc")
        self.opened.append(handle)
        return np.zeros(nbytes, np.uint8), handle

    def close_ipc(self, pointer):
        self.closed.append(pointer)

    def _maybe_fail(self, call):
        if (rank, call) in self.fail:
            raise MemoryError(f"{call} refused on rank {rank}")


@pytest.fixture
def stand_ins(monkeypatch):
    def install(fail=()):
        fake = HostStandIns(set(fail))
        for name in ("device_buffer", "ipc_handle", "open_ipc", "close_ipc"):
            monkeypatch.setattr(backend, name, getattr(fake, name))
        return fake
    return install


@pytest.mark.mpi
@pytest.mark.parametrize("call", ["device_buffer", "open_ipc"])
def test_one_rank_failing_to_set_up_cuda_ipc_is_heard_by_every_rank(stand_ins, call):
    if size == 1 and call == "open_ipc":
        pytest.skip("one rank has no peer to map")
    fake = stand_ins(fail={(size - 1, call)})
    mapped = cuda_ipc._Mapped(comm, 256)
    everyone = comm.allgather((mapped.ok, mapped.problems, sorted(fake.opened) == sorted(fake.closed)))
    mapped.close()
    assert all(ok is False for ok, _, _ in everyone)
    assert all(problems == everyone[0][1] and problems[size - 1] and call in problems[size - 1]
               for _, problems, _ in everyone)
    assert all(unmapped for _, _, unmapped in everyone)  # whatever a rank had opened, it closed again
    assert f"rank {size - 1}: MemoryError: {call} refused" in cuda_ipc.describe_refusal(everyone[0][1])


@pytest.mark.mpi
def test_cuda_ipc_set_up_where_every_rank_succeeds_maps_every_peer(stand_ins):
    fake = stand_ins()
    mapped = cuda_ipc._Mapped(comm, 256)
    ok, views, opened = mapped.ok, len(mapped.views), len(fake.opened)
    mapped.close()
    assert ok and views == size and opened == size - 1 and len(fake.closed) == size - 1


@pytest.mark.mpi
def test_the_sharded_step_falls_back_to_the_allreduce_when_its_buffers_cannot_be_shared(monkeypatch):
    # Review #10: a model-sized share() that fails (on every rank alike: the
    # mapping's success is agreed) once ended training on every rank.
    def refused(self, n, dtype):
        raise RuntimeError("CUDA IPC is unavailable (rank 0: MemoryError: out of memory)")

    monkeypatch.setattr(WindowTransport, "share", refused)
    model = build_model("mlp", 12, 3, hidden=(8,), seed=1)
    opt = build_optimizer("sgd", model.params, lr=0.1, order=flat_layout(model).order)
    grads_before = model.grad_buffer
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = ShardedStep.create(model, opt, comm, transport="shm")
    said = [str(w.message) for w in caught if "falls back to the allreduce" in str(w.message)]
    outcomes = comm.allgather((step is None, model.grad_buffer is grads_before, len(said)))
    if step is not None:
        step.close()
    if size == 1:  # one rank has nothing to share: the step applies as it is
        assert outcomes == [(False, True, 0)]
    else:  # every rank falls back alike, its buffers untouched; rank 0 says why, once
        assert outcomes == [(True, True, 1 if r == 0 else 0) for r in range(size)]


@pytest.mark.mpi
def test_cuda_ipc_slots_that_could_not_grow_are_grown_again_by_the_next_call(stand_ins):
    # An out-of-memory growing the slots raised on every rank; every later
    # call then found the old size but no slots, and failed with an IndexError.
    fake = stand_ins()
    transport = cuda_ipc.CudaIpcTransport(comm)
    transport._grow(1 << 10)
    fake.fail = {(size - 1, "device_buffer")}
    try:
        transport._stage(np.zeros(4096, np.float32))
        first = None
    except RuntimeError as exc:
        first = str(exc)
    fake.fail = set()
    later = len(transport._stage(np.zeros(16, np.float32)))
    outcomes = comm.allgather((first is not None and "device_buffer refused" in first, later))
    transport.close()
    assert outcomes == [(True, size)] * size

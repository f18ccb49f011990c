"""The peer window on GPUs: ranks on one host map each other's device memory with CUDA IPC.

Without a CUDA-aware MPI a CuPy allreduce is staged through pinned host
memory and reduced on the CPU, at a small part of device-memory speed. But
ranks on one host can map each other's device allocations
(``cudaIpcOpenMemHandle``) and reduce in place with CuPy kernels, at
device-memory speed (both measured on an H200: docs/performance.md; this
transport's own figures come from scripts/gpu_acceptance.sh, docs/gpu.md);
NCCL refuses two ranks on one GPU, so where ranks share a GPU this is the
only fast path.

:class:`CudaIpcTransport` is the CPU window's structure on device memory
(:mod:`ringtrain.comm.transports.shm`), in one round:

1. reduce-scatter: each rank copies its buffer into its own slot (or, for an
   array made by :meth:`~CudaIpcTransport.share`, already lives there);
   stream sync and an MPI barrier; then one kernel per rank sums its chunk
   from every rank's slot in rank order (:func:`ringtrain.backend.rank_order_kernel`);
2. allgather: each owner writes its reduced chunk to its slot; stream sync
   and a barrier; every rank copies the other chunks from their owners.

Summing in rank order makes every element's result independent of which
rank owns it: bitwise the same on every rank and from run to run, and the
phases give the fused allreduce's bits.

Slots alternate between two halves, as the CPU window's do: a phase writes
its half before its barrier and reads after it, and a rank's reads are
finished (the stream synchronised) before it enters the next barrier, so the
half a phase overwrites was last read before a barrier every rank has passed.

Each rank's memory is its own ``cudaMalloc`` (an IPC handle names a whole
allocation); the handles are exchanged once per allocation and kept with the
transport, which lives in the communicator's state. The mappings are closed
before the memory is freed (:meth:`CudaIpcTransport.close`).

This module needs CuPy and a GPU only when a transport is made; it imports
CuPy through :mod:`ringtrain.backend` alone. Set-up is collective and every
rank learns whether every rank could allocate and map: on any failure all
of them unmap and go on without it (the collectives then stage through the
host), and rank 0 warns once with every rank's reason, so a run that falls
to host speed says why.
"""

import atexit
import warnings
import weakref

import numpy as np

from ... import backend
from ...backend import address
from .base import Transport
from ..schedule import chunk_bounds

__all__ = ["CudaIpcTransport", "describe_refusal"]

_COMBINE_NAMES = {np.add: "add", np.minimum: "minimum", np.maximum: "maximum"}


class _Mapped:
    """One device allocation per rank, mapped by every other rank (collective to make and to close)."""

    def __init__(self, comm, nbytes):
        self.comm, self.nbytes = comm, nbytes
        rank = comm.Get_rank()
        self.mine, self.views, self.opened = None, [], []
        problem, handle = None, None
        try:
            self.mine = backend.device_buffer(nbytes)
            handle = backend.ipc_handle(self.mine)
        except Exception as exc:  # noqa: BLE001 - out of memory, IPC unsupported: every rank must hear
            problem = f"{type(exc).__name__}: {exc}"
        handles = comm.allgather(handle)
        if problem is None and all(h is not None for h in handles):
            problem = self._open(handles, rank, nbytes)
        # Every rank learns every rank's problem: all keep the mappings, or none does, and all know why.
        self.problems = comm.allgather(problem)
        self.ok = not any(p is not None for p in self.problems)
        if not self.ok:
            self._unmap()

    def _open(self, handles, rank, nbytes):
        """Map every peer's allocation; returns a problem, or None."""
        for peer, (handle, offset) in enumerate(handles):
            if peer == rank:
                self.views.append(self.mine)
                continue
            try:
                view, pointer = backend.open_ipc(handle, offset, nbytes)
            except Exception as exc:  # noqa: BLE001 - containers may forbid IPC
                return f"{type(exc).__name__}: {exc}"
            self.views.append(view)
            self.opened.append(pointer)
        return None

    def _unmap(self):
        for pointer in self.opened:
            backend.close_ipc(pointer)
        self.opened, self.views = [], []

    def close(self):
        """Unmap the peers' memory, then let ours go: nobody may still map it when it is freed."""
        if self.mine is not None:
            backend.synchronize(self.mine)
        self.comm.Barrier()  # every rank is done reading its peers
        self._unmap()
        self.comm.Barrier()  # every mapping of our memory is closed: it may be freed
        self.mine = None


class CudaIpcTransport(Transport):
    """Reduce-scatter and allgather through CUDA IPC mappings; every rank on one host."""

    name = "cuda-ipc"
    on_device = True

    def __init__(self, comm):
        super().__init__(comm)
        self._slots = None      # _Mapped: two halves of staging per rank, grown on demand
        self._half = 0
        self._units = 0
        self._shared = []       # _Mapped allocations holding arrays made by share()
        self._peers_of = {}     # address of this rank's shared array -> every rank's array
        self._kernels = {}

    @classmethod
    def create(cls, comm, device=None, shared_bytes=0):
        """Collective; None unless every rank of ``comm`` shares one host and can map its peers' memory.

        Where every rank has a GPU but the mapping fails, rank 0 warns with
        every rank's reason (the collectives then run at host speed).
        """
        transport, why = cls.attempt(comm)
        if why is not None and comm.Get_rank() == 0:
            warnings.warn(why, RuntimeWarning, stacklevel=2)
        return transport

    @classmethod
    def attempt(cls, comm):
        """``(transport, None)``, or ``(None, why not)`` (collective; ``ringtrain info`` asks this too).

        ``why`` is None where CUDA IPC does not apply at all: ranks on
        several hosts, or a rank without a GPU.
        """
        from mpi4py import MPI

        node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
        usable = int(node.Get_size() == comm.Get_size() and backend.gpu_available())
        node.Free()
        if not comm.allreduce(usable, op=MPI.MIN):
            return None, None
        transport = cls(comm)
        if not transport._grow(1 << 20):
            why = describe_refusal(transport._slots.problems)
            transport.close()
            return None, why
        # A transport on COMM_WORLD is never closed by its communicator: peers
        # would still map our memory when it is freed at exit (undefined
        # behaviour, says cudaIpcOpenMemHandle's documentation). Every rank
        # made its transports in the same order, so every rank closes them in
        # the same order, collectively, before mpi4py finalizes MPI.
        atexit.register(_close_at_exit, weakref.ref(transport))
        return transport, None

    def share(self, n, dtype):
        """A 1-D CuPy array of ``n`` elements in this rank's own mapped memory (collective).

        Every rank must make the same calls; the peers then read the array
        in place when it is handed to a phase.
        """
        dtype = np.dtype(dtype)
        mapped = _Mapped(self.comm, n * dtype.itemsize)
        if not mapped.ok:  # on every rank alike
            raise RuntimeError(describe_refusal(mapped.problems))
        self._shared.append(mapped)
        everyone = [view.view(dtype) for view in mapped.views]
        self._peers_of[address(everyone[self.rank])] = everyone
        return everyone[self.rank]

    def reduce_scatter(self, x, combine=np.add):
        peers = self._peers(x)
        a, b = self.owned(x.size)
        if peers is None:
            peers = self._stage(x)
            # Peers read only their own chunks from my slot; mine the kernel reads from x itself.
            peers[self.rank][:a] = x[:a]
            peers[self.rank][b:] = x[b:]
            peers = [x if r == self.rank else p for r, p in enumerate(peers)]
        self._sync(x)
        kernel = self._kernel(combine)
        kernel(*[p[a:b] for p in peers], x[a:b])

    def allgather(self, x):
        peers = self._peers(x)
        a, b = self.owned(x.size)
        if peers is None:
            peers = self._stage(x)
            peers[self.rank][a:b] = x[a:b]
        self._sync(x)
        bounds = chunk_bounds(x.size, self.size)
        for owner in range(self.size):
            if owner != self.rank:
                lo, hi = bounds[owner], bounds[owner + 1]
                x[lo:hi] = peers[owner][lo:hi]

    def close(self):
        """Unmap and free every allocation (collective; a second call does nothing)."""
        for mapped in self._shared:
            mapped.close()
        if self._slots is not None:
            self._slots.close()
        self._shared, self._peers_of, self._slots = [], {}, None

    # -- the slots --------------------------------------------------------------
    def _peers(self, x):
        everyone = self._peers_of.get(address(x))
        return everyone if everyone is not None and everyone[self.rank].size == x.size else None

    def _grow(self, nbytes):
        """Make the slots hold two halves of at least ``nbytes`` (collective: every rank grows alike)."""
        half = -(-nbytes // 256) * 256
        if self._slots is not None:
            self._slots.close()
        self._slots = _Mapped(self.comm, 2 * half)
        # Where a rank could not map (on every rank alike), no half is usable:
        # the next call grows again rather than staging into slots that are gone.
        self._half = half if self._slots.ok else 0
        return self._slots.ok

    def _stage(self, x):
        """Every rank's view of the next half, as ``x``'s dtype and length."""
        if x.nbytes > self._half:
            # Every rank reaches this with the same length (the callers checked), so all grow together.
            if not self._grow(max(x.nbytes, 2 * self._half)):
                raise RuntimeError(describe_refusal(self._slots.problems))
        start = (self._units % 2) * self._half
        return [slot[start:start + x.nbytes].view(x.dtype) for slot in self._slots.views]

    def _sync(self, x):
        # The writes of this phase (and the reads of the last) must be done on
        # the device before any peer is let past the barrier to read them.
        self._units += 1
        backend.synchronize(x)
        self.comm.Barrier()

    def _kernel(self, combine):
        name = _COMBINE_NAMES[combine] if combine in _COMBINE_NAMES else combine.__name__
        kernel = self._kernels.get(name)
        if kernel is None:
            kernel = self._kernels[name] = backend.rank_order_kernel(self.size, name)
        return kernel


def describe_refusal(problems):
    """One line saying why CUDA IPC could not be set up, from every rank's problem (or None) (pure)."""
    reasons = "; ".join(f"rank {rank}: {problem}" for rank, problem in enumerate(problems) if problem is not None)
    return (f"CUDA IPC is unavailable ({reasons}); GPU allreduces stage through pinned host memory instead, "
            "at host speed. Containers need a shared IPC namespace (docker --ipc=host); MIG and GPUs without "
            "peer access cannot map each other's memory")


def _close_at_exit(ref):
    from mpi4py import MPI

    transport = ref()
    if transport is not None and transport._slots is not None and not MPI.Is_finalized():
        transport.close()

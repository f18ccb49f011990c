"""Hierarchical allreduce: within each host through shared memory, across hosts among chunk owners.

On a cluster the links between hosts are much slower than memory within a
host. The flat ring (:mod:`ringtrain.comm.transports.ring`) sends ``2 (N - 1) / N`` of the
vector over every link, the slow ones included, and takes ``2 (N - 1)``
latency-bound steps. Where every host runs the same number ``L`` of ranks,
:class:`HierarchicalTransport` splits the vector into ``L`` chunks and runs
both phases in two levels:

* reduce-scatter: within each host through the shared-memory window
  (:mod:`ringtrain.comm.transports.shm`), which leaves local rank ``l`` its host's sum
  of chunk ``l``; then, on that chunk, the ring's reduce-scatter among the
  ``H`` ranks (one per host) that own chunk ``l``, which leaves each of them
  the global sum of one piece of it;
* allgather: the ring's allgather of chunk ``l`` among those ``H`` ranks,
  then the window's allgather within each host.

So only ranks that own the same chunk talk across hosts, all ``L`` pairs at
once on disjoint data: each host sends and receives ``2 (H - 1) / H`` of the
vector, as with one leader per host, but spread over ``L`` ranks, and the
cross-host rings have ``2 (H - 1)`` steps instead of ``2 (N - 1)``. With both
phases, the sharded optimizer step runs on it too (``two_phase``).

Where hosts run different numbers of ranks the chunks would not line up,
and the transport keeps the leader-based algorithm (:func:`hierarchical_reduce`:
reduce onto one leader per host, ring among the leaders, broadcast within
each host), which has no reduce-scatter: ``two_phase`` is then False. Which
of the two a communicator gets is decided once, collectively, when the
transport is made.

Every sum is made along a fixed path (the window's rank order within the
host, then the ring across hosts) and the result is then only copied, so
every rank gets bitwise the same result, a repeated call gives bitwise the
same result again, and the allreduce is bitwise its two phases. The order
of additions differs from the flat ring's, so the two agree only to rounding.

The host and leader sub-communicators are cached on the communicator with
MPI attribute caching (:meth:`Hierarchy.of`), made on first use by a
collective call, and freed when the communicator is freed.
"""

import atexit
import weakref

import numpy as np

from ...backend import get_array_module
from .base import LocalTransport, Transport
from .cuda_ipc import CudaIpcTransport
from ..policy import SEGMENT_BYTES
from .ring import RingTransport, ring_allgather, ring_allreduce, ring_reduce_scatter
from ..schedule import chunk_bounds
from .shm import WindowTransport

__all__ = ["Hierarchy", "HierarchicalTransport", "hierarchical_reduce", "owned_span"]


def owned_span(n, local_size, local_chunk, hosts, cross_rank):
    """``(start, stop)`` a rank holds reduced after the two-level reduce-scatter (pure).

    ``n`` elements cut into ``local_size`` chunks; this rank's host reduces
    chunk ``local_chunk`` onto it, and the ring among the ``hosts`` owners of
    that chunk leaves cross rank ``cross_rank`` the ring's chunk
    ``(cross_rank + 1) % hosts`` of it (:func:`ringtrain.comm.schedule.ring_schedule`).
    """
    outer = chunk_bounds(n, local_size)
    start, stop = outer[local_chunk], outer[local_chunk + 1]
    inner = chunk_bounds(stop - start, hosts)
    piece = (cross_rank + 1) % hosts
    return start + inner[piece], start + inner[piece + 1]


class HierarchicalTransport(Transport):
    """The two-level transport (``transport="hierarchical"``); see the module docstring.

    Made by :meth:`create`. With the same number of ranks on every host it
    has both phases (``two_phase``); otherwise only the leader-based allreduce.
    """

    name = "hierarchical"

    def __init__(self, comm, local=None, across=None):
        super().__init__(comm)
        self.local, self.across = local, across
        self.two_phase = local is not None
        self._stages = {}

    @classmethod
    def create(cls, comm, device=None, shared_bytes=0, local=None):
        """Collective over ``comm``: every rank gets the same kind of transport.

        Args:
            comm: the communicator; its :class:`Hierarchy` (which ranks share a
                host) is made on first use, or the one attached to it.
            device: None for host buffers, else the GPU they live on.
            shared_bytes: unused (the within-host window keeps no shared arrays here).
            local: the transport within each host: ``"shm"``, the window, for
                host buffers and ``"cuda-ipc"`` for device buffers by default
                (the window is NumPy-only); the pipelined ring where neither
                can serve a "host". The ring across hosts runs on the array
                it is given, so device memory goes to MPI directly when MPI
                is CUDA-aware (:attr:`on_device` says when MPI sees none).
        """
        local = local or ("shm" if device is None else "cuda-ipc")
        intra = Hierarchy.of(comm).intra
        sizes = comm.allgather(intra.Get_size())
        if min(sizes) != max(sizes):
            return cls(comm)
        inner = _within_host(local, intra)
        # Ranks pair up across hosts by the chunk they own, which need not be
        # their local rank (the ring's is local rank + 1): the split says so.
        across = comm.Split(inner.owned_chunk(), key=comm.Get_rank())
        transport = cls(comm, inner, across)
        # A transport on MPI_COMM_WORLD is never closed by its communicator,
        # and across hosts MPICH's network module refuses to finalize with the
        # window still open ("fabricclose failed: Device or resource busy").
        # Every rank made its transports in the same order, so every rank
        # closes them in the same order too, before mpi4py's own exit handler.
        atexit.register(_close_at_exit, weakref.ref(transport))
        return transport

    @property
    def on_device(self):
        """True where device buffers never reach MPI: CUDA IPC within the host, and one host."""
        return self.local is not None and self.local.on_device and self.across.Get_size() == 1

    def owned(self, n):
        if not self.two_phase:
            return super().owned(n)
        return owned_span(n, self.local.size, self.local.owned_chunk(), self.across.Get_size(),
                          self.across.Get_rank())

    def reduce_scatter(self, x, combine=np.add):
        if not self.two_phase:
            raise NotImplementedError("hosts with different numbers of ranks: the leader-based allreduce only")
        self.local.reduce_scatter(x, combine)
        if self.across.Get_size() > 1:
            a, b = self.local.owned(x.size)
            stages = self._stages_for(x)
            ring_reduce_scatter(self.across, x[a:b], getattr(get_array_module(x), combine.__name__), stages,
                                stages[0].size)

    def allgather(self, x):
        if not self.two_phase:
            raise NotImplementedError("hosts with different numbers of ranks: the leader-based allreduce only")
        if self.across.Get_size() > 1:
            a, b = self.local.owned(x.size)
            ring_allgather(self.across, x[a:b], chunk_bounds(b - a, self.across.Get_size()))
        self.local.allgather(x)

    def allreduce(self, x, combine=np.add, source=None):
        if self.two_phase:
            return super().allreduce(x, combine, source)
        if source is not None:
            x[...] = source
        stages = self._stages_for(x)
        return hierarchical_reduce(self.comm, x, getattr(get_array_module(x), combine.__name__), stages,
                                   stages[0].size)

    def close(self):
        if self.local is not None:
            self.local.close()
            self.across.Free()
            self.local = self.across = None

    def _stages_for(self, x):
        xp = get_array_module(x)
        key = (np.dtype(x.dtype), xp.__name__)
        if key not in self._stages:
            segment = max(1, SEGMENT_BYTES // x.itemsize)
            self._stages[key] = (xp.empty(segment, x.dtype), xp.empty(segment, x.dtype))
        return self._stages[key]


def _close_at_exit(ref):
    from mpi4py import MPI

    transport = ref()
    if transport is not None and transport.local is not None and not MPI.Is_finalized():
        transport.close()


class Hierarchy:
    """The two sub-communicators of one communicator: this rank's host, and the leaders.

    Attributes:
        intra: the ranks of this rank's host (ordered by rank); its rank 0 is the leader.
        cross: the leaders, one per host, ordered by rank; ``None`` on non-leaders.
        num_hosts: number of hosts (groups).
    """

    _keyval = None  # one MPI attribute key for the process, made on first use

    def __init__(self, comm, intra):
        from mpi4py import MPI

        self.intra = intra
        leader = intra.Get_rank() == 0
        # Split is collective over comm: every rank calls it, non-leaders with
        # UNDEFINED, which gives them COMM_NULL.
        cross = comm.Split(0 if leader else MPI.UNDEFINED, key=comm.Get_rank())
        self.cross = cross if leader else None
        self.num_hosts = comm.allreduce(1 if leader else 0)

    @classmethod
    def _key(cls, comm):
        if cls._keyval is None:
            cls._keyval = comm.Create_keyval(delete_fn=_free_hierarchy)
        return cls._keyval

    @classmethod
    def of(cls, comm):
        """The hierarchy cached on ``comm``; made on first use from MPI's shared-memory split.

        Collective on first use (every rank of ``comm`` must call it); later
        calls return the cached object without communicating.
        """
        hierarchy = comm.Get_attr(cls._key(comm))
        if hierarchy is None:
            from mpi4py import MPI

            hierarchy = cls.attach(comm, comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank()))
        return hierarchy

    @classmethod
    def attach(cls, comm, intra_or_color):
        """Group ``comm``'s ranks into hosts your own way, and cache that on ``comm``.

        Collective. Useful where "sharing memory" is not the grouping you
        want (a rack, a NUMA domain), and in tests that emulate several hosts
        on one machine.

        Args:
            comm: the communicator.
            intra_or_color: an int "host" colour for this rank (ranks with the
                same colour form one group), or a ready intra-group
                communicator whose ranks are ordered as in ``comm`` (it is
                owned, and freed, by the hierarchy from then on).

        Returns:
            The new :class:`Hierarchy`, which replaces any cached one.
        """
        if isinstance(intra_or_color, int):
            intra = comm.Split(intra_or_color, key=comm.Get_rank())
        else:
            intra = intra_or_color
        hierarchy = cls(comm, intra)
        key = cls._key(comm)
        old = comm.Get_attr(key)
        if old is not None:
            comm.Delete_attr(key)
            old.free()
        comm.Set_attr(key, hierarchy)
        return hierarchy

    def free(self):
        """Free the sub-communicators (done for you when the communicator is freed)."""
        for sub in (self.intra, self.cross):
            if sub is not None:
                sub.Free()
        self.intra = self.cross = None


def _free_hierarchy(comm, keyval, hierarchy):
    from mpi4py import MPI

    # At MPI_Finalize the world's attributes are deleted inside MPI itself;
    # freeing communicators from there is not allowed, and pointless.
    if hierarchy is not None and not MPI.Is_finalized() and comm not in (MPI.COMM_WORLD, MPI.COMM_SELF):
        hierarchy.free()


def hierarchical_reduce(comm, buf, combine, stages, segment):
    """Reduce the 1-D contiguous ``buf`` across ``comm`` in place, host by host.

    The engine behind ``transport="hierarchical"`` in
    :mod:`ringtrain.comm.collectives`, with the signature of
    :func:`ringtrain.comm.transports.ring.ring_allreduce`. Collective: every rank of ``comm``
    must call it with the same length, dtype and ``combine``, in the same
    order (the callers in :mod:`ringtrain.comm.collectives` check that first).

    Args:
        comm: the communicator; its :class:`Hierarchy` is made on first use.
        buf: 1-D contiguous NumPy (or, with CUDA-aware MPI, CuPy) array.
        combine: ``f(a, b, out)``, e.g. ``numpy.add``.
        stages: two 1-D arrays of ``buf``'s dtype and at least ``segment``
            elements, the reused receive buffers.
        segment: pipeline segment length in elements.
    """
    from mpi4py import MPI

    if comm.Get_size() == 1 or buf.size == 0:
        return buf
    hierarchy = Hierarchy.of(comm)
    intra = hierarchy.intra
    byte = MPI.BYTE
    item = buf.itemsize
    if intra.Get_size() > 1:
        bounds = ring_reduce_scatter(intra, buf, combine, stages, segment, tag=21)
        size, rank = intra.Get_size(), intra.Get_rank()
        owned = (rank + 1) % size
        if rank == 0:
            # Each rank's finished chunk lands at its own place in the
            # leader's vector; the leader's own chunk is already there.
            counts = [(bounds[(r + 1) % size + 1] - bounds[(r + 1) % size]) * item for r in range(size)]
            displs = [bounds[(r + 1) % size] * item for r in range(size)]
            intra.Gatherv(MPI.IN_PLACE, [buf, (counts, displs), byte], root=0)
        else:
            intra.Gatherv([buf[bounds[owned]:bounds[owned + 1]], byte], None, root=0)
    if hierarchy.cross is not None and hierarchy.cross.Get_size() > 1:
        ring_allreduce(hierarchy.cross, buf, combine, stages, segment)
    if intra.Get_size() > 1:
        intra.Bcast([buf, byte], root=0)
    return buf


def _within_host(local, intra):
    """The transport among one host's ranks (collective over ``intra``): the window asked for, else the ring."""
    if intra.Get_size() == 1:
        return LocalTransport(intra)
    kind = {"shm": WindowTransport, "cuda-ipc": CudaIpcTransport}[local]
    return kind.create(intra) or RingTransport(intra)

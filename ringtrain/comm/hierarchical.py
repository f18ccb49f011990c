"""Hierarchical allreduce: reduce within each host, ring across hosts, broadcast within each host.

On a cluster the links between hosts are much slower than memory within a
host. The flat ring (:mod:`ringtrain.comm.ring`) sends ``2 (N - 1) / N`` of the
vector over every link, the slow ones included, and takes ``2 (N - 1)``
latency-bound steps. The hierarchical variant moves data between hosts only
among one leader rank per host:

1. reduce within the host onto its leader (a ring reduce-scatter over the
   host's ranks, then a gather of the reduced chunks to the leader);
2. the ring allreduce among the leaders, one per host;
3. a broadcast from each leader to the other ranks of its host.

Each host then sends and receives ``2 (H - 1) / H`` of the vector over its
network link (``H`` hosts), once, instead of once per rank pair that the ring
crosses at the host boundary, and the cross-host ring has ``2 (H - 1)`` steps
instead of ``2 (N - 1)``. It helps when several ranks share a host and the
network, not memory, is the bottleneck; with one rank per host it is the flat
ring plus nothing.

Every sum is made along a fixed path (the intra-host ring, then the leaders'
ring) and the result is then only copied, so every rank gets bitwise the same
result, and a repeated call gives bitwise the same result again. The order of
additions differs from the flat ring's, so the two agree only to rounding.

The host and leader sub-communicators are cached on the communicator with
MPI attribute caching (:meth:`Hierarchy.of`), made on first use by a
collective call, and freed when the communicator is freed.
"""

import numpy as np

from ..backend import get_array_module
from .base import Transport
from .policy import SEGMENT_BYTES
from .ring import ring_allreduce, ring_reduce_scatter

__all__ = ["Hierarchy", "HierarchicalTransport", "hierarchical_reduce"]


class HierarchicalTransport(Transport):
    """The hierarchical allreduce behind the transport interface (``algorithm="hierarchical"``).

    It reduces onto one leader per host and rings among the leaders, so it
    has no reduce-scatter that leaves each rank a chunk: ``two_phase`` is
    False, and the sharded step keeps the allreduce under it.
    """

    name = "hierarchical"
    two_phase = False

    def __init__(self, comm):
        super().__init__(comm)
        self._stages = {}

    def allreduce(self, x, combine=np.add):
        xp = get_array_module(x)
        key = (np.dtype(x.dtype), xp.__name__)
        if key not in self._stages:
            segment = max(1, SEGMENT_BYTES // x.itemsize)
            self._stages[key] = (xp.empty(segment, x.dtype), xp.empty(segment, x.dtype))
        stages = self._stages[key]
        return hierarchical_reduce(self.comm, x, getattr(xp, combine.__name__), stages, stages[0].size)


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

    The engine behind ``algorithm="hierarchical"`` in
    :mod:`ringtrain.comm.collectives`, with the signature of
    :func:`ringtrain.comm.ring.ring_allreduce`. Collective: every rank of ``comm``
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

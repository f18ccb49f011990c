"""The transport interface: one small base class every transport implements.

A transport reduces one 1-D contiguous buffer of ``n`` elements among the
ranks of its communicator, split into one chunk per rank
(:func:`ringtrain.comm.schedule.chunk_bounds`), in two phases:

* :meth:`Transport.reduce_scatter`: afterwards this rank's chunk
  (:meth:`Transport.owned`) holds the reduction of that chunk over every
  rank; the rest of the buffer is scratch;
* :meth:`Transport.allgather`: every rank's chunk is copied to every rank;

and :meth:`Transport.allreduce`, the two in a row. The allreduce, the
overlapping :class:`~ringtrain.comm.reducer.Reducer` and the sharded
optimizer step all reduce through a transport, so a sharded step
(reduce-scatter, update the chunk, allgather) and an allreduce followed by
the whole update give bitwise the same result by construction: the same code
adds the same operands in the same order.

Contract: every method but :meth:`~Transport.owned` is collective over the
transport's communicator: every rank calls it, with buffers of the same
length and dtype, in the same order. The callers check that first
(:mod:`ringtrain.comm.header`); transports trust it.
"""

import numpy as np

from ..schedule import chunk_bounds

__all__ = ["Transport", "LocalTransport"]


class Transport:
    """One way to move a reduction among the ranks of ``comm``; see the module docstring.

    Subclasses implement :meth:`reduce_scatter` and :meth:`allgather` (and
    may override :meth:`allreduce` where fusing the phases is faster, as long
    as the result stays bitwise that of the two phases), and say which chunk
    a rank owns (:meth:`owned_chunk`). A transport that cannot split its
    reduction into the two phases sets ``two_phase = False``: it still
    allreduces, and the sharded step does not use it.
    """

    name = None
    two_phase = True
    # True where device buffers never reach MPI (CUDA IPC, one rank): GPU
    # arrays then go to the transport whether or not MPI is CUDA-aware.
    on_device = False

    def __init__(self, comm):
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()

    def owned_chunk(self):
        """Which chunk this rank holds reduced after :meth:`reduce_scatter`."""
        return self.rank

    def owned(self, n):
        """``(start, stop)``: this rank's chunk of a buffer of ``n`` elements (pure)."""
        bounds = chunk_bounds(n, self.size)
        chunk = self.owned_chunk()
        return bounds[chunk], bounds[chunk + 1]

    def reduce_scatter(self, x, combine=np.add):
        """Reduce this rank's chunk of the 1-D ``x`` over every rank, in place (collective)."""
        raise NotImplementedError

    def allgather(self, x):
        """Copy every rank's chunk of the 1-D ``x`` to every rank, in place (collective)."""
        raise NotImplementedError

    def allreduce(self, x, combine=np.add, source=None):
        """Reduce the whole 1-D ``x`` over every rank, in place (collective); returns ``x``.

        ``source``: the values to reduce when they are not ``x``'s (an array
        like ``x``, left untouched; ``x`` is then only written). A transport
        that can read them where they are skips this copy in.
        """
        if source is not None:
            x[...] = source
        self.reduce_scatter(x, combine)
        self.allgather(x)
        return x

    def sum_small(self, values):
        """Sum a few float64 ``values`` over every rank, in place, the same on every rank (collective).

        At most :data:`~ringtrain.comm.policy.SMALL_VALUES` of them (the
        sharded step's metrics and its non-finite count).
        """
        from mpi4py import MPI

        self.comm.Allreduce(MPI.IN_PLACE, values, op=MPI.SUM)
        return values

    @classmethod
    def create(cls, comm, device=None, shared_bytes=0):
        """Build the transport over ``comm`` (collective); None where it cannot serve ``comm``.

        ``device``: None for host buffers, else the GPU index the buffers
        live on; ``shared_bytes``: room for ``share()`` (the windows only).
        """
        return cls(comm)

    def close(self):
        """Release what the transport holds (collective)."""


class LocalTransport(Transport):
    """One rank: it owns every element, and every phase is nothing."""

    name = "local"
    on_device = True

    def reduce_scatter(self, x, combine=np.add):
        pass

    def allgather(self, x):
        pass

    def allreduce(self, x, combine=np.add, source=None):
        if source is not None:
            x[...] = source
        return x

    def sum_small(self, values):
        return values

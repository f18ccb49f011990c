"""MPI's own collectives behind the transport interface.

For latency-bound sizes MPI's tuned algorithms (recursive halving, Rabenseifner)
beat a ring of ``2 (N - 1)`` steps; across hosts "auto" uses them between
:data:`~ringtrain.comm.policy.SMALL_BYTES` and
:data:`~ringtrain.comm.policy.RING_BYTES`, and ``--allreduce mpi`` forces them.

MPI chooses its own order of additions, so the results are bitwise the same
on every rank (MPICH and Open MPI reduce deterministically for a fixed
communicator and size) but equal to the other transports' only to rounding;
likewise :meth:`MpiTransport.allreduce` (MPI's ``Allreduce``, the point of
this transport) and its two phases agree to rounding, not bitwise.
"""

import numpy as np

from ...backend import get_array_module
from .base import Transport
from ..schedule import chunk_bounds

__all__ = ["MpiTransport"]


class MpiTransport(Transport):
    """``Reduce_scatter``, ``Allgatherv`` and ``Allreduce``; rank r owns chunk r."""

    name = "mpi"

    def __init__(self, comm):
        from mpi4py import MPI

        super().__init__(comm)
        self.MPI = MPI
        self._ops = {np.add: MPI.SUM, np.minimum: MPI.MIN, np.maximum: MPI.MAX}
        self._received = {}

    def _spec(self, x):
        bounds = chunk_bounds(x.size, self.size)
        counts = [b - a for a, b in zip(bounds, bounds[1:])]
        return bounds, counts, self.MPI.Datatype.fromcode(np.dtype(x.dtype).char)

    def reduce_scatter(self, x, combine=np.add):
        bounds, counts, datatype = self._spec(x)
        xp = get_array_module(x)
        key = (np.dtype(x.dtype), xp.__name__)
        received = self._received.get(key)
        if received is None or received.size < counts[self.rank]:
            received = self._received[key] = xp.empty(counts[self.rank], x.dtype)
        mine = received[:counts[self.rank]]
        self.comm.Reduce_scatter([x, datatype], [mine, datatype], counts, op=self._ops[combine])
        x[bounds[self.rank]:bounds[self.rank + 1]] = mine

    def allgather(self, x):
        bounds, counts, datatype = self._spec(x)
        self.comm.Allgatherv(self.MPI.IN_PLACE, [x, counts, bounds[:-1], datatype])

    def allreduce(self, x, combine=np.add, source=None):
        # MPI asks for IN_PLACE at every rank or at none, and whether a rank reduces from a source of its
        # own is its choice alone (reduce_into): every rank copies its source in and passes IN_PLACE.
        if source is not None:
            x[...] = source
        datatype = self.MPI.Datatype.fromcode(np.dtype(x.dtype).char)
        self.comm.Allreduce(self.MPI.IN_PLACE, [x, datatype], self._ops[combine])
        return x

"""The ring allreduce: reduce-scatter, then allgather, between ring neighbours.

Rank ``r`` sends only to ``r + 1`` and receives only from ``r - 1``. The
vector is cut into one chunk per rank. In the reduce-scatter, each of ``N - 1``
steps passes one partial chunk to the right, where it is added to the local
chunk; afterwards rank ``r`` holds the full sum of chunk ``(r + 1) % N``. The
allgather then passes the finished chunks round the ring, ``N - 1`` more steps.
Every rank sends and receives ``2 (N - 1) / N`` of the vector whatever ``N``
is (Baidu's bandwidth-optimal algorithm).

Each chunk is summed exactly once, along a fixed path round the ring, and then
copied to everyone: every rank ends with bitwise the same result, and a
repeated call gives bitwise the same result again.

The schedules are pure and live in :mod:`ringtrain.comm.schedule`; this
module is where they meet MPI: the two phases as functions
(:func:`ring_reduce_scatter`, :func:`ring_allgather`, used by the hierarchical
transport too) and :class:`RingTransport`, the ring behind the transport
interface.
"""

import numpy as np

from ...backend import get_array_module, synchronize
from .base import Transport
from ..policy import SEGMENT_BYTES
from ..schedule import chunk_bounds, ring_schedule, segments

__all__ = ["RingTransport", "ring_allreduce", "ring_reduce_scatter", "ring_allgather"]


class RingTransport(Transport):
    """The pipelined ring over MPI point-to-point messages; works across hosts.

    After the reduce-scatter rank ``r`` owns chunk ``(r + 1) % N`` (where the
    ring leaves it finished). The receive segments are this transport's own,
    grown to the largest dtype and segment seen and reused.
    """

    name = "ring"

    def __init__(self, comm):
        super().__init__(comm)
        self._stages = {}

    def owned_chunk(self):
        return (self.rank + 1) % self.size

    def _stages_for(self, x):
        xp = get_array_module(x)
        key = (np.dtype(x.dtype), xp.__name__)
        stages = self._stages.get(key)
        if stages is None:
            segment = max(1, SEGMENT_BYTES // x.itemsize)
            stages = self._stages[key] = (xp.empty(segment, x.dtype), xp.empty(segment, x.dtype))
        return stages

    def reduce_scatter(self, x, combine=np.add):
        stages = self._stages_for(x)
        ring_reduce_scatter(self.comm, x, getattr(get_array_module(x), combine.__name__), stages, stages[0].size)

    def allgather(self, x):
        ring_allgather(self.comm, x, chunk_bounds(x.size, self.size))


def ring_allreduce(comm, buf, combine, stages, segment):
    """Reduce the 1-D contiguous ``buf`` across ``comm`` in place, with the ring.

    Collective: every rank of ``comm`` must call it with the same length, dtype
    and ``combine``, in the same order (:mod:`ringtrain.comm.collectives` checks
    that first; this function trusts it).

    The reduce-scatter is pipelined: each step's chunk travels as segments of
    at most ``segment`` elements, all sends posted at once, and the receive of
    the next segment is posted before the current one is combined, so the
    combine works on data that has just arrived (still in cache) while MPI
    moves the next piece (segmented against unsegmented: docs/performance.md).

    Args:
        comm: the communicator.
        buf: 1-D contiguous NumPy (or, with CUDA-aware MPI, CuPy) array.
        combine: ``f(a, b, out)``, e.g. ``numpy.add``; called as
            ``combine(local, received, out=local)``.
        stages: two 1-D arrays of ``buf``'s dtype and at least ``segment``
            elements, the reused receive buffers.
        segment: pipeline segment length in elements.
    """
    size = comm.Get_size()
    if size == 1 or buf.size == 0:
        return buf
    bounds = ring_reduce_scatter(comm, buf, combine, stages, segment)
    ring_allgather(comm, buf, bounds)
    return buf


def ring_reduce_scatter(comm, buf, combine, stages, segment, tag=11):
    """The ring's first phase: afterwards rank r holds the reduced chunk ``(r + 1) % size``.

    Collective over ``comm``; the arguments are those of :func:`ring_allreduce`.
    Returns the chunk bounds. (The hierarchical allreduce stops here within a
    host: only the host's leader needs the whole reduced vector.)
    """
    from mpi4py import MPI

    size, rank = comm.Get_size(), comm.Get_rank()
    right, left = (rank + 1) % size, (rank - 1) % size
    bounds = chunk_bounds(buf.size, size)
    byte = MPI.BYTE
    for send_chunk, recv_chunk in ring_schedule(rank, size)[0]:
        sends = [comm.Isend([buf[a:b], byte], right, tag)
                 for a, b in segments(bounds[send_chunk], bounds[send_chunk + 1], segment)]
        pieces = segments(bounds[recv_chunk], bounds[recv_chunk + 1], segment)
        if pieces:
            a, b = pieces[0]
            request = comm.Irecv([stages[0][: b - a], byte], left, tag)
        for k, (a, b) in enumerate(pieces):
            request.Wait()
            if k + 1 < len(pieces):
                c, d = pieces[k + 1]
                request = comm.Irecv([stages[(k + 1) % 2][: d - c], byte], left, tag)
            local = buf[a:b]
            combine(local, stages[k % 2][: b - a], out=local)
            # The combined chunk is the next step's send: on a GPU the kernel
            # must finish before MPI reads it.
            synchronize(local)
        MPI.Request.Waitall(sends)
    return bounds


def ring_allgather(comm, buf, bounds, tag=12):
    """The ring's second phase: pass the reduced chunks around until every rank has all.

    Collective over ``comm``. A distinct tag from the reduce-scatter keeps a
    late message of one phase from matching a receive of the other.
    """
    from mpi4py import MPI

    size, rank = comm.Get_size(), comm.Get_rank()
    right, left = (rank + 1) % size, (rank - 1) % size
    byte = MPI.BYTE
    for send_chunk, recv_chunk in ring_schedule(rank, size)[1]:
        # Finished chunks are received straight into place: no staging, no copy.
        comm.Sendrecv([buf[bounds[send_chunk]:bounds[send_chunk + 1]], byte], right, tag,
                      [buf[bounds[recv_chunk]:bounds[recv_chunk + 1]], byte], left, tag)
    return buf

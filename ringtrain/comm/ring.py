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

The index maths (:func:`chunk_bounds`, :func:`ring_schedule`,
:func:`segments`, :func:`doubling_schedule`) is pure and tested without MPI;
:func:`ring_allreduce` is the only function here that talks to MPI.
"""

from ..backend import synchronize

__all__ = [
    "chunk_bounds",
    "ring_schedule",
    "segments",
    "doubling_schedule",
    "ring_allreduce",
    "ring_reduce_scatter",
    "ring_allgather",
]


def chunk_bounds(n, size):
    """Offsets of ``size`` near-equal chunks of ``n`` elements.

    Returns a list of ``size + 1`` offsets; chunk ``i`` is
    ``[bounds[i], bounds[i + 1])``. The first ``n % size`` chunks hold one
    element more, and chunks may be empty when ``n < size``.
    """
    if size < 1:
        raise ValueError(f"number of ranks must be at least 1, got {size}")
    if n < 0:
        raise ValueError(f"length must be non-negative, got {n}")
    q, extra = divmod(n, size)
    bounds = [0]
    for i in range(size):
        bounds.append(bounds[-1] + q + (1 if i < extra else 0))
    return bounds


def ring_schedule(rank, size):
    """The chunk each step sends and receives, for one rank.

    Returns ``(reduce_scatter, allgather)``, each a list of ``size - 1``
    ``(send_chunk, recv_chunk)`` pairs. In the reduce-scatter the received
    chunk is added to the local one; in the allgather it replaces it. After the
    reduce-scatter rank ``rank`` owns the finished chunk ``(rank + 1) % size``,
    which is what it sends first in the allgather.
    """
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is outside a ring of {size}")
    reduce_scatter = [((rank - s) % size, (rank - s - 1) % size) for s in range(size - 1)]
    allgather = [((rank + 1 - s) % size, (rank - s) % size) for s in range(size - 1)]
    return reduce_scatter, allgather


def segments(start, stop, length):
    """``[start, stop)`` cut into pieces of at most ``length`` (the pipeline's segments)."""
    if length < 1:
        raise ValueError(f"segment length must be at least 1, got {length}")
    return [(a, min(a + length, stop)) for a in range(start, stop, length)]


def doubling_schedule(rank, size):
    """Recursive doubling for any number of ranks, as a list of steps.

    The latency-bound path (small messages) uses it: ``ceil(log2 N)``-ish
    rounds in place of the ring's ``2 (N - 1)``. With ``p`` the largest power
    of two not above ``size`` and ``rem = size - p``, the first ``2 * rem``
    ranks pair up: each even one hands its message to the odd one above it
    (``"fold"``), sits out, and gets the result back at the end
    (``"unfold"``). The remaining ``p`` ranks exchange with the partner whose
    index differs in one bit, one bit per round (``"exchange"``).

    Returns a list of ``(kind, peer)``, with kind one of ``"send"`` (send my
    message to peer, then wait for the result), ``"recv"`` (fold peer's
    message into mine), ``"exchange"``, ``"unfold"`` (send the result to peer).
    Combining in rank order (the lower rank's operand first) makes the pairs
    compute bitwise the same thing.
    """
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is outside a group of {size}")
    p = 1 << (size.bit_length() - 1)
    rem = size - p
    if rank < 2 * rem and rank % 2 == 0:
        return [("send", rank + 1)]
    steps = []
    if rank < 2 * rem:
        steps.append(("recv", rank - 1))
        virtual = rank // 2
    else:
        virtual = rank - rem
    mask = 1
    while mask < p:
        partner = virtual ^ mask
        steps.append(("exchange", partner * 2 + 1 if partner < rem else partner + rem))
        mask <<= 1
    if rank < 2 * rem:
        steps.append(("unfold", rank - 1))
    return steps


def ring_allreduce(comm, buf, combine, stages, segment):
    """Reduce the 1-D contiguous ``buf`` across ``comm`` in place, with the ring.

    Collective: every rank of ``comm`` must call it with the same length, dtype
    and ``combine``, in the same order (:mod:`ringtrain.comm.collectives` checks
    that first; this function trusts it).

    The reduce-scatter is pipelined: each step's chunk travels as segments of
    at most ``segment`` elements, all sends posted at once, and the receive of
    the next segment is posted before the current one is combined, so the
    combine works on data that has just arrived (still in cache) while MPI
    moves the next piece. Measured at 2 ranks on a 2-core machine, 64 MiB:
    6.0 GB/s unsegmented, 7.6 GB/s with 1 MiB segments.

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

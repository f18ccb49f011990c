"""The index maths of the collectives: chunks, the ring's steps, pipeline segments, recursive doubling.

Pure: no MPI, tested on its own. The ring (:mod:`ringtrain.comm.transports.ring`), the
window (:mod:`ringtrain.comm.transports.shm`) and the header exchange
(:mod:`ringtrain.comm.header`) follow these schedules.
"""

__all__ = ["chunk_bounds", "ring_schedule", "segments", "doubling_schedule"]


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

"""The shared-memory window: ranks on one host read each other's memory directly.

The ring moves every byte through MPI's shared-memory channel: the sender
copies a segment into MPI's cells and the receiver copies it out again. When
every rank of the communicator runs on one host, the ranks can read each
other's memory instead. :class:`WindowTransport` keeps the ring's structure
(rank r owns chunk r: the reduce-scatter leaves each chunk reduced by its
owner, the allgather hands it to everyone), but each rank *reads* its peers'
contributions from an MPI shared-memory window (:class:`SharedArena`): one
copy less per byte, and no per-segment handshakes.

A buffer goes in rounds; round ``k`` handles piece ``k`` of every chunk:

1. publish: each rank copies piece ``k`` of the chunks its peers own into
   its own slot; sync;
2. reduce: each owner combines, into its own piece, every rank's values in
   rank order (rank 0's, then rank 1's, ...: its own join at its place);
3. allgather: the owner publishes the reduced piece; sync; every rank copies
   every other owner's piece from its slot.

:meth:`WindowTransport.allreduce` runs the three per round, while the piece
is still in cache; the reduce-scatter alone is 1-2 and the allgather alone
is 3. Every element is summed in rank order whoever owns it, so the result
depends on nothing but the values: not on the round size, nor on how a
caller cuts a gradient into buckets. The phases, the fused allreduce, a
bucketed allreduce and the sharded step over the whole buffer all give
bitwise the same result, at any rank count; and every rank gets the same bits.

Arrays that a model keeps in the window itself (:meth:`WindowTransport.share`)
are read by the peers in place: no publish copy at all.

Rounds alternate between two halves of each rank's slot, so one sync per
step is enough: the half a round writes was last read two rounds earlier,
before the sync that every rank has since passed.
"""

import numpy as np

from ...backend import address
from ..arena import SharedArena
from .base import Transport
from ..policy import SMALL_VALUES, WINDOW_BYTES
from ..schedule import chunk_bounds

__all__ = ["WindowTransport", "HALF_BYTES", "ROUND_BYTES", "round_plan", "piece_bounds", "region_views",
           "publish_others", "gather_piece", "sum_in_rank_order"]

# Each half of a rank's slot stages one round. A buffer of up to HALF_BYTES
# goes in one round; a larger one in rounds of ROUND_BYTES, so that what a
# round publishes is still in cache when the peers read it.
HALF_BYTES = WINDOW_BYTES
ROUND_BYTES = 1 << 20
# The tail of each half carries sum_small's values.
_TAIL_BYTES = SMALL_VALUES * 8


def piece_bounds(bounds, owner, k, piece):
    """``(start, stop)`` of round ``k``'s piece of chunk ``owner``, ``piece`` elements a round (pure)."""
    start = min(bounds[owner] + k * piece, bounds[owner + 1])
    return start, min(start + piece, bounds[owner + 1])


def round_plan(n, itemsize, size, half_bytes=HALF_BYTES):
    """``(bounds, piece, rounds)`` for a buffer of ``n`` elements over ``size`` ranks (pure).

    A buffer that fits one half goes in one round; a larger one in rounds of
    :data:`ROUND_BYTES`. Every rank computes the same plan.
    """
    bounds = chunk_bounds(n, size)
    largest = bounds[1] - bounds[0]  # chunk 0 is never shorter than another
    region = _region_bytes(half_bytes, size) // itemsize
    if n * itemsize <= half_bytes - _TAIL_BYTES and largest <= region:
        piece = max(largest, 1)
    else:
        piece = max(1, min(region, ROUND_BYTES // size // itemsize))
    return bounds, piece, -(-largest // piece)


def _region_bytes(half_bytes, size):
    # One region per owner in each half, 64-byte aligned, before the small-values tail.
    return (half_bytes - _TAIL_BYTES) // size // 64 * 64


# -- one round's pieces, pure: every rank's slots are plain arrays here, so
# a whole round among N "ranks" is tested without MPI (tests/unit/test_window_rounds.py).

def region_views(slots, half, half_bytes, dtype):
    """``[rank][owner]`` views of half ``half`` of every rank's slot: one region per owner (pure).

    Rank ``r``'s region for owner ``o`` is where ``r`` publishes its values
    of ``o``'s chunk (and, for ``o == r``, the reduced chunk itself).
    """
    size = len(slots)
    width, base = _region_bytes(half_bytes, size), half * half_bytes
    return [[slot[base + o * width: base + (o + 1) * width].view(dtype) for o in range(size)] for slot in slots]


def publish_others(x, mine, bounds, k, piece, rank):
    """Copy round ``k``'s piece of every chunk a peer owns from ``x`` into this rank's regions ``mine`` (pure)."""
    for owner in range(len(mine)):
        if owner != rank:
            a, b = piece_bounds(bounds, owner, k, piece)
            mine[owner][:b - a] = x[a:b]


def gather_piece(x, regions, bounds, k, piece, rank):
    """Copy round ``k``'s reduced piece of every other owner's chunk into ``x``, from the owner's region (pure)."""
    for owner in range(len(regions)):
        if owner != rank:
            a, b = piece_bounds(bounds, owner, k, piece)
            x[a:b] = regions[owner][owner][:b - a]


def sum_in_rank_order(chunk, contribution, rank, size, combine, scratch=None, mine=None):
    """``chunk`` (this rank's own values) becomes rank 0's values combined with rank 1's, ..., in rank order (pure).

    Every element is combined in the same order whoever owns it, so the
    result does not depend on how the buffer is cut into chunks, pieces or
    buckets: the allreduce of a gradient in buckets and the sharded step
    over the whole buffer give the same bits at any rank count.
    ``contribution(peer)`` is that peer's values for ``chunk``; ``scratch``,
    an array like ``chunk`` that no peer reads, holds the running partial
    of the ranks before this one (needed from rank 2 on). ``mine``: this
    rank's values when they are not in ``chunk`` (which then gets only the result).
    """
    own = chunk if mine is None else mine
    first = rank + 1
    if rank == 0:
        if size > 1:
            combine(own, contribution(1), out=chunk)
            first = 2
        elif mine is not None:  # (one rank: the result is its own values)
            chunk[...] = mine
    elif rank == 1:
        combine(contribution(0), own, out=chunk)  # a + b is b + a, bitwise
    else:
        combine(contribution(0), contribution(1), out=scratch)
        for peer in range(2, rank):
            combine(scratch, contribution(peer), out=scratch)
        combine(scratch, own, out=chunk)
    for peer in range(first, size):
        combine(chunk, contribution(peer), out=chunk)
    return chunk


class WindowTransport(Transport):
    """The reduce-scatter and allgather through a shared-memory window; every rank on one host.

    Each phase (and each round of the fused allreduce) uses one half of every
    slot, alternating, and writes its half before its sync and reads after:
    what it overwrites was last read two rounds back, before the sync of the
    round in between, which every rank has since passed. So no call needs a
    closing barrier, and calls may come in any order. Arrays made by
    :meth:`share` live in the window, and the peers read them in place.
    """

    name = "shm"

    def __init__(self, arena):
        super().__init__(arena.comm)
        self.arena = arena
        self._units = 0
        self._base = 0
        self._regions = {}  # (dtype, half) -> [rank][owner] region views
        self._shared = {}   # address of this rank's shared array -> every rank's array
        self._partial = None  # private scratch for the rank-order sum (see _sum)
        self._shared_used = 0

    @classmethod
    def create(cls, comm, device=None, shared_bytes=0):
        """Collective; None unless every rank of ``comm`` shares one host, and for device buffers.

        ``shared_bytes``: room for :meth:`share` (each array 64-byte aligned).
        The window is host memory written with NumPy: GPU buffers (``device``
        not None) take CUDA IPC instead.
        """
        if device is not None:
            return None
        arena = SharedArena.create(comm, slot_bytes=2 * HALF_BYTES, extra_bytes=shared_bytes)
        return cls(arena) if arena is not None else None

    def share(self, n, dtype):
        """A 1-D array of ``n`` elements of ``dtype`` in this rank's part of the window (collective).

        Every rank must make the same calls; the peers then read the array in
        place when it is handed to a phase. Only its owner writes it, where no
        peer reads it at the time: the sharded step writes its gradients after
        the step's last sync, its parameter chunk after the next reduce-scatter's.
        """
        dtype = np.dtype(dtype)
        start = self._shared_used
        stop = start + n * dtype.itemsize
        if stop > self.arena.extras[self.rank].size:
            raise ValueError(f"the window has {self.arena.extras[self.rank].size - start} bytes left to share, "
                             f"{n * dtype.itemsize} asked for; create it with a larger shared_bytes")
        self._shared_used = -(-stop // 64) * 64
        everyone = [extra[start:stop].view(dtype) for extra in self.arena.extras]
        self._shared[address(everyone[self.rank])] = everyone
        return everyone[self.rank]

    def unshare(self):
        """Forget the shared arrays (their memory stays the window's until :meth:`close`)."""
        self._shared.clear()
        self._shared_used = 0

    def _peers(self, x):
        """Every rank's array when ``x`` is this rank's whole shared array, else None."""
        everyone = self._shared.get(address(x))
        return everyone if everyone is not None and everyone[self.rank].size == x.size else None

    def _next_half(self, dtype):
        half = self._units % 2
        self._units += 1
        key = (np.dtype(dtype), half)
        regions = self._regions.get(key)
        if regions is None:
            regions = self._regions[key] = region_views(self.arena.slots, half, self.arena.half, dtype)
        self._base = half * self.arena.half
        return regions

    def _sum(self, chunk, contribution, combine, mine=None):
        # The running partial of the lower ranks' values is private: no peer may read it mid-sum.
        if self.rank > 1 and (self._partial is None or self._partial.nbytes < chunk.nbytes):
            self._partial = np.empty(chunk.nbytes, np.uint8)
        scratch = self._partial[:chunk.nbytes].view(chunk.dtype) if self.rank > 1 else None
        sum_in_rank_order(chunk, contribution, self.rank, self.size, combine, scratch, mine)

    def reduce_scatter(self, x, combine=np.add):
        peers = self._peers(x)
        if peers is not None:
            self._next_half(x.dtype)
            self.arena.sync()
            a, b = self.owned(x.size)
            self._sum(x[a:b], lambda peer: peers[peer][a:b], combine)
            return
        bounds, piece, rounds = round_plan(x.size, x.itemsize, self.size, self.arena.half)
        for k in range(rounds):
            self._reduce_round(x, bounds, k, piece, combine)

    def allgather(self, x):
        peers = self._peers(x)
        bounds = chunk_bounds(x.size, self.size)
        if peers is not None:
            self._next_half(x.dtype)
            self.arena.sync()
            for owner in range(self.size):
                if owner != self.rank:
                    x[bounds[owner]:bounds[owner + 1]] = peers[owner][bounds[owner]:bounds[owner + 1]]
            return
        bounds, piece, rounds = round_plan(x.size, x.itemsize, self.size, self.arena.half)
        for k in range(rounds):
            regions = self._next_half(x.dtype)
            a, b = piece_bounds(bounds, self.rank, k, piece)
            regions[self.rank][self.rank][:b - a] = x[a:b]
            self.arena.sync()
            gather_piece(x, regions, bounds, k, piece, self.rank)

    def allreduce(self, x, combine=np.add, source=None):
        if self._peers(x) is not None:
            return super().allreduce(x, combine, source)
        bounds, piece, rounds = round_plan(x.size, x.itemsize, self.size, self.arena.half)
        for k in range(rounds):
            # From source (when given) straight into x: no pass copies it in first.
            regions, (a, b) = self._reduce_round(x, bounds, k, piece, combine, source)
            # My own region of this half is free: the peers read only the regions of their chunks.
            regions[self.rank][self.rank][:b - a] = x[a:b]
            self.arena.sync()
            gather_piece(x, regions, bounds, k, piece, self.rank)
        return x

    def _reduce_round(self, x, bounds, k, piece, combine, source=None):
        """Publish round ``k``'s pieces of the peers' chunks, sync, reduce my own piece; ``(regions, my piece)``.

        ``source``: where this rank's values are, when not in ``x`` (which then gets only the result).
        """
        regions = self._next_half(x.dtype)
        publish_others(x if source is None else source, regions[self.rank], bounds, k, piece, self.rank)
        self.arena.sync()
        a, b = piece_bounds(bounds, self.rank, k, piece)
        self._sum(x[a:b], lambda peer: regions[peer][self.rank][:b - a], combine,
                  None if source is None else source[a:b])
        return regions, (a, b)

    def sum_small(self, values):
        self._next_half(np.float64)
        end = self._base + self.arena.half
        tails = [slot[end - _TAIL_BYTES:end].view(np.float64)[:values.size] for slot in self.arena.slots]
        tails[self.rank][:] = values
        self.arena.sync()
        values[:] = tails[0]
        for tail in tails[1:]:
            values += tail
        return values

    def close(self):
        self.unshare()
        self._regions.clear()
        self.arena.free()

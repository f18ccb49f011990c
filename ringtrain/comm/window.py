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
   its own slot, and raises its flag;
2. reduce: each owner combines, into its own piece, every rank's values in
   rank order (rank 0's, then rank 1's, ...: its own join at its place),
   waiting on each peer's flag just before it reads it;
3. allgather: the owner publishes the reduced piece and raises its flag
   again; every rank copies every other owner's piece from its slot.

:meth:`WindowTransport.allreduce` runs the three per round, while the piece
is still in cache; the reduce-scatter alone is 1-2 and the allgather alone
is 3. Every element is summed in rank order whoever owns it, so the result
depends on nothing but the values: not on the round size, nor on how a
caller cuts a gradient into buckets. The phases, the fused allreduce, a
bucketed allreduce and the sharded step over the whole buffer all give
bitwise the same result, at any rank count; and every rank gets the same bits.

No barriers: flags, so that a late rank delays only the ranks that need its
data, and only by as long as it is late. Every round (every phase, every
``sum_small``) is one *unit* with a sequence number that every rank counts
alike (the calls are collective). Unit ``u`` stages through stage
``u % STAGES`` of the slots, a ring of :data:`STAGES` buffers. Each rank's
slot starts with two counters:

* ``posted``: the last publication it made: ``2u + 1`` once its pieces for
  the owners of unit ``u`` are in, ``2u + 2`` once its own reduced piece is
  (:func:`posted_value`). A reader waits until the producer's counter reaches
  the value it needs; counters only grow, so a producer that has run ahead
  satisfies it too.
* ``done``: how many units it has finished reading. Before a rank writes
  unit ``u`` into its stage it waits until every peer's ``done`` reaches
  ``u - STAGES + 1`` (:func:`reusable_after`): the peers have finished with
  unit ``u - STAGES``, the last that used that stage. So a fast rank runs up
  to ``STAGES - 1`` units ahead of a slow reader and never overwrites what
  it still needs.

``Win.Sync`` is the memory barrier on either side of a counter: data is
written before the counter that announces it, and read after. A wait polls
with ``os.sched_yield`` (then short sleeps), which releases the GIL: the
ranks oversubscribe their cores in tests (4 ranks on 2), and a stalled peer
must still be caught by the watchdog thread.

Arrays that a model keeps in the window itself (:meth:`WindowTransport.share`)
are read by the peers in place: no publish copy, and one barrier per phase
(:meth:`SharedArena.sync`), which the sharded step's write ordering relies on.
"""

import os
import time

import numpy as np

from ..flat import address
from .base import Transport
from .policy import SMALL_VALUES
from .schedule import chunk_bounds

__all__ = ["SharedArena", "WindowTransport", "STAGES", "STAGE_BYTES", "round_plan", "piece_bounds",
           "posted_value", "reusable_after"]

# The ring of stage buffers in each rank's slot, and each stage's size. A
# buffer whose chunks fit one stage goes in one round; a larger one in
# rounds of one stage. Every round is a few waits, and on a busy host a
# wait is where a rank loses its core: 4 MiB stages beat 1 MiB ones at 16
# and 64 MiB (2 ranks, scripts/bench_window.py's figures in the commit
# message), though 1 MiB would fit the 2 MiB L2. Three stages let a fast
# rank publish two units ahead of a slow reader; the fused allreduce needs
# its peers' data each round, so it never runs further ahead than that.
STAGES = 3
STAGE_BYTES = 4 << 20
# The tail of each stage carries sum_small's values.
_TAIL_BYTES = SMALL_VALUES * 8
# Each slot starts with the rank's two counters, a cache line apart.
_CONTROL_BYTES = 128
_POSTED, _DONE = 0, 8  # int64 indices into the control block
# A wait spins for _SPIN_SECONDS (the producer is usually a few microseconds
# away, and a rank that yields its core on a busy host may not get it back
# for milliseconds), then yields the core on every poll; after
# _YIELD_SECONDS it sleeps between polls, so a long wait (a peer in a slow
# backward) costs almost no CPU.
_SPIN_SECONDS = 50e-6
_YIELD_SECONDS = 2e-3
_SLEEP_SECONDS = 50e-6


def posted_value(unit, reduced):
    """The ``posted`` counter once unit ``unit``'s pieces (or, ``reduced``, its reduced piece) are in (pure)."""
    return 2 * unit + (2 if reduced else 1)


def reusable_after(unit, stages=STAGES):
    """The ``done`` count every peer must reach before unit ``unit`` may overwrite its stage (pure).

    Unit ``unit - stages`` used the same stage last; a reader that has
    finished it has done ``unit - stages + 1`` units.
    """
    return unit - stages + 1


class SharedArena:
    """Each rank's slot in one MPI shared-memory window, and the ranks' views of all slots.

    Made collectively by :meth:`create` over a communicator whose ranks share
    one host; every rank then holds NumPy views of every rank's slot: its
    counters (``control``), its ``stages`` and its ``extras``.
    """

    def __init__(self, comm, node, win, slots, stages, stage_bytes):
        self.comm, self._node, self._win = comm, node, win
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.stage_bytes = stage_bytes
        self.control = [slot[:_CONTROL_BYTES].view(np.int64) for slot in slots]
        data = _CONTROL_BYTES + stages * stage_bytes
        self.stages = [[slot[_CONTROL_BYTES + s * stage_bytes:_CONTROL_BYTES + (s + 1) * stage_bytes]
                        for s in range(stages)] for slot in slots]
        self.extras = [slot[data:] for slot in slots]
        self.win_sync = win.Sync

    @classmethod
    def create(cls, comm, stages=STAGES, stage_bytes=STAGE_BYTES + _TAIL_BYTES, extra_bytes=0):
        """The arena for ``comm``, or None unless every rank of ``comm`` shares one host.

        Each rank gets its counters, ``stages`` stages of ``stage_bytes``
        and, after them, ``extra_bytes`` of its own (``self.extras``) for an
        owner to keep arrays that its peers read in place. Collective: every
        rank of ``comm`` must call it with the same sizes; all get the same
        answer.
        """
        from mpi4py import MPI

        node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
        together = comm.allreduce(int(node.Get_size() == comm.Get_size()), op=MPI.MIN)
        if not together:
            node.Free()
            return None
        stage_bytes = -(-stage_bytes // 64) * 64
        total = _CONTROL_BYTES + stages * stage_bytes + extra_bytes
        win = MPI.Win.Allocate_shared(total, 64, comm=node)
        slots = [np.frombuffer(win.Shared_query(r)[0], np.uint8, total) for r in range(node.Get_size())]
        # One passive-target epoch for the arena's life: Win.Sync then orders
        # each rank's plain loads and stores around the counters and barriers.
        win.Lock_all()
        arena = cls(comm, node, win, slots, stages, stage_bytes)
        arena.control[arena.rank][:] = 0
        arena.sync()  # every counter starts at 0 before anyone reads one
        return arena

    def sync(self):
        """Every rank's writes so far are visible to every rank (collective)."""
        self._win.Sync()
        self._node.Barrier()
        self._win.Sync()

    def post(self, index, value):
        """Set this rank's counter ``index`` to ``value``, after every write before it."""
        self.win_sync()
        self.control[self.rank][index] = value

    def wait(self, peer, index, value):
        """Return once ``peer``'s counter ``index`` is at least ``value``; its writes before are then visible."""
        counter = self.control[peer]
        if counter[index] < value:
            _poll(counter, index, value, self.win_sync)
        self.win_sync()

    def free(self):
        """Release the window (collective)."""
        if self._win is not None:
            self._win.Unlock_all()
            self._win.Free()
            self._node.Free()
            self._win = self._node = None


def _poll(counter, index, value, sync):
    # Past the spin, give the core away on every poll: with more ranks than
    # cores the producer may be waiting for this very core. sched_yield and
    # sleep both release the GIL, and the spin is short, so the watchdog
    # thread runs however long the wait lasts.
    now = time.perf_counter()
    spin_until, yield_until = now + _SPIN_SECONDS, now + _YIELD_SECONDS
    while True:
        sync()
        if counter[index] >= value:
            return
        now = time.perf_counter()
        if now < spin_until:
            continue
        if now < yield_until:
            os.sched_yield()
        else:
            time.sleep(_SLEEP_SECONDS)


def piece_bounds(bounds, owner, k, piece):
    """``(start, stop)`` of round ``k``'s piece of chunk ``owner``, ``piece`` elements a round (pure)."""
    start = min(bounds[owner] + k * piece, bounds[owner + 1])
    return start, min(start + piece, bounds[owner + 1])


def round_plan(n, itemsize, size, stage_bytes=STAGE_BYTES + _TAIL_BYTES):
    """``(bounds, piece, rounds)`` for a buffer of ``n`` elements over ``size`` ranks (pure).

    A buffer whose chunks fit one stage goes in one round; a larger one in
    rounds of a full stage. Every rank computes the same plan.
    """
    bounds = chunk_bounds(n, size)
    largest = bounds[1] - bounds[0]  # chunk 0 is never shorter than another
    region = max(1, _region_bytes(stage_bytes, size) // itemsize)
    piece = max(1, min(largest, region))
    return bounds, piece, -(-largest // piece)


def _region_bytes(stage_bytes, size):
    # One region per owner in each stage, 64-byte aligned, before the small-values tail.
    return (stage_bytes - _TAIL_BYTES) // size // 64 * 64


class WindowTransport(Transport):
    """The reduce-scatter and allgather through a shared-memory window; every rank on one host.

    Each phase (each round of it, and each round of the fused allreduce) is
    one unit of the counters described in the module docstring: calls may
    come in any order, and none needs a closing barrier.

    Arrays made by :meth:`share` live in the window: when a phase is given
    one, the peers read it in place, after a barrier. Each such array is
    written only by its owner, and only where no peer reads it at the time:
    the sharded step writes its gradients (backward) after the step's last
    barrier, by which time the peers have read them, and its parameter chunk
    (the update) after the next reduce-scatter's barrier, by which time the
    peers have copied it.
    """

    name = "shm"

    def __init__(self, arena):
        super().__init__(arena.comm)
        self.arena = arena
        self._unit = 0
        self._regions = {}  # (dtype, stage) -> [rank][owner] region views
        self._shared = {}   # address of this rank's shared array -> every rank's array
        self._partial = None  # private scratch for the rank-order sum (see _sum_in_rank_order)
        self._shared_used = 0
        self._others = [r for r in range(self.size) if r != self.rank]
        self._stage_count = len(arena.stages[0])

    @classmethod
    def create(cls, comm, shared_bytes=0):
        """Collective; None unless every rank of ``comm`` shares one host.

        ``shared_bytes``: room for :meth:`share` (each array 64-byte aligned).
        """
        arena = SharedArena.create(comm, extra_bytes=shared_bytes)
        return cls(arena) if arena is not None else None

    def share(self, n, dtype):
        """A 1-D array of ``n`` elements of ``dtype`` in this rank's part of the window (collective).

        Every rank must make the same calls; the peers then read the array in
        place when it is handed to a phase.
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

    # -- units ------------------------------------------------------------------
    def _begin(self, dtype):
        """Start the next unit: wait until its stage is free everywhere; its region views and number."""
        unit = self._unit
        self._unit += 1
        stage = unit % self._stage_count
        key = (np.dtype(dtype), stage)
        regions = self._regions.get(key)
        if regions is None:
            width = _region_bytes(self.arena.stage_bytes, self.size)
            regions = self._regions[key] = [
                [stages[stage][o * width:(o + 1) * width].view(dtype) for o in range(self.size)]
                for stages in self.arena.stages]
        floor = reusable_after(unit, self._stage_count)
        if floor > 0:
            for peer in self._others:
                self.arena.wait(peer, _DONE, floor)
        return regions, unit

    def _end(self, unit):
        """This rank has read everything unit ``unit`` published: its stage may be reused."""
        self.arena.post(_DONE, unit + 1)

    def reduce_scatter(self, x, combine=np.add):
        peers = self._peers(x)
        if peers is not None:
            self.arena.sync()
            self._reduce_shared(x, peers, combine)
            return
        bounds, piece, rounds = round_plan(x.size, x.itemsize, self.size, self.arena.stage_bytes)
        for k in range(rounds):
            regions, unit = self._begin(x.dtype)
            self._publish_others(x, regions[self.rank], bounds, k, piece)
            self.arena.post(_POSTED, posted_value(unit, False))
            self._reduce_piece(x, regions, bounds, k, piece, combine, unit)
            self._end(unit)

    def allgather(self, x):
        peers = self._peers(x)
        bounds = chunk_bounds(x.size, self.size)
        if peers is not None:
            self.arena.sync()
            for owner in self._others:
                x[bounds[owner]:bounds[owner + 1]] = peers[owner][bounds[owner]:bounds[owner + 1]]
            return
        bounds, piece, rounds = round_plan(x.size, x.itemsize, self.size, self.arena.stage_bytes)
        for k in range(rounds):
            regions, unit = self._begin(x.dtype)
            a, b = piece_bounds(bounds, self.rank, k, piece)
            regions[self.rank][self.rank][:b - a] = x[a:b]
            self.arena.post(_POSTED, posted_value(unit, True))
            self._gather_piece(x, regions, bounds, k, piece, unit)
            self._end(unit)

    def allreduce(self, x, combine=np.add):
        if self._peers(x) is not None:
            return super().allreduce(x, combine)
        bounds, piece, rounds = round_plan(x.size, x.itemsize, self.size, self.arena.stage_bytes)
        post = self.arena.post
        for k in range(rounds):
            regions, unit = self._begin(x.dtype)
            mine = regions[self.rank]
            self._publish_others(x, mine, bounds, k, piece)
            post(_POSTED, posted_value(unit, False))
            a, b = self._reduce_piece(x, regions, bounds, k, piece, combine, unit)
            # My own region of this stage is free: the peers read only the regions of their chunks.
            mine[self.rank][:b - a] = x[a:b]
            post(_POSTED, posted_value(unit, True))
            self._gather_piece(x, regions, bounds, k, piece, unit)
            self._end(unit)
        return x

    def sum_small(self, values):
        _, unit = self._begin(np.float64)
        stage, end = unit % self._stage_count, self.arena.stage_bytes
        tails = [stages[stage][end - _TAIL_BYTES:end].view(np.float64)[:values.size] for stages in self.arena.stages]
        tails[self.rank][:] = values
        self.arena.post(_POSTED, posted_value(unit, False))
        for peer in self._others:
            self.arena.wait(peer, _POSTED, posted_value(unit, False))
        values[:] = tails[0]
        for tail in tails[1:]:
            values += tail
        self._end(unit)
        return values

    def close(self):
        self.unshare()
        self._regions.clear()
        self.arena.free()

    # -- one round's pieces -----------------------------------------------------
    def _publish_others(self, x, mine, bounds, k, piece):
        for owner in self._others:
            a, b = piece_bounds(bounds, owner, k, piece)
            mine[owner][:b - a] = x[a:b]

    def _reduce_piece(self, x, regions, bounds, k, piece, combine, unit):
        a, b = piece_bounds(bounds, self.rank, k, piece)
        wanted = posted_value(unit, False)

        def contribution(peer):
            self.arena.wait(peer, _POSTED, wanted)  # that peer has published this round's pieces
            return regions[peer][self.rank][:b - a]

        self._sum_in_rank_order(x[a:b], contribution, combine)
        return a, b

    def _reduce_shared(self, x, peers, combine):
        a, b = self.owned(x.size)
        self._sum_in_rank_order(x[a:b], lambda peer: peers[peer][a:b], combine)

    def _sum_in_rank_order(self, chunk, contribution, combine):
        """``chunk`` (this rank's own values) becomes rank 0's values combined with rank 1's, ..., in rank order.

        Every element is combined in the same order whoever owns it, so the
        result does not depend on how the buffer is cut into chunks, pieces
        or buckets: the allreduce of a gradient in buckets and the sharded
        step over the whole buffer give the same bits at any rank count.
        ``contribution(peer)`` is that peer's values for ``chunk``.
        """
        rank = self.rank
        if rank == 1:
            combine(contribution(0), chunk, out=chunk)  # a + b is b + a, bitwise
        elif rank > 1:
            partial = self._scratch(chunk)  # ranks 0..rank-1, before this rank's own values join
            combine(contribution(0), contribution(1), out=partial)
            for peer in range(2, rank):
                combine(partial, contribution(peer), out=partial)
            combine(partial, chunk, out=chunk)
        for peer in range(rank + 1, self.size):
            combine(chunk, contribution(peer), out=chunk)

    def _scratch(self, like):
        if self._partial is None or self._partial.nbytes < like.nbytes:
            self._partial = np.empty(like.nbytes, np.uint8)
        return self._partial[:like.nbytes].view(like.dtype)

    def _gather_piece(self, x, regions, bounds, k, piece, unit):
        wanted = posted_value(unit, True)
        for owner in self._others:
            self.arena.wait(owner, _POSTED, wanted)
            a, b = piece_bounds(bounds, owner, k, piece)
            x[a:b] = regions[owner][owner][:b - a]

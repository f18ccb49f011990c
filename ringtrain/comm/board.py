"""The header exchange on one host: every rank posts its header in shared memory, then one barrier.

Across hosts the header exchange (:func:`ringtrain.comm.header.exchange`)
goes by recursive doubling over point-to-point messages. On one host that
costs more than it must: a message of header plus payload above MPICH's
8 KiB eager limit switches to a rendezvous handshake (twice the time of a
bare exchange at 2 ranks: docs/performance.md), and at 3 or more ranks doubling needs
several rounds. A :class:`Board` is a small MPI shared-memory window: each
rank writes its packed header, and a small call's payload after it, into
its own slot, every rank passes one barrier, and then reads everybody's
slot. Every rank makes the same single step whatever its arguments, so a
call that disagrees can neither hang nor truncate: everyone sees every
header, and everyone raises.

The payloads are combined in rank order (rank 0's, then rank 1's, ...), as
the shared-memory window combines large buffers
(:mod:`ringtrain.comm.transports.shm`), so on one host a small call gives bitwise
the same result as a large one cut to the same values, at any rank count.

Consecutive calls alternate between the two halves of each slot, so no
closing barrier is needed: the half a call writes was last read two calls
earlier, before the barrier of the call in between, which every rank has
since passed.
"""

import numpy as np

from .header import HEADER_BYTES, NFIELDS, combine_for, raise_mismatch
from .policy import SMALL_BYTES
from .arena import SharedArena

__all__ = ["Board", "BoardPlan"]

# Each half of a slot: the header, then room for the largest small payload.
_HALF_BYTES = -(-(HEADER_BYTES + SMALL_BYTES) // 64) * 64


class Board:
    """One shared-memory slot per rank for the header exchange of a communicator on one host."""

    def __init__(self, arena):
        self.arena = arena
        self.rank, self.size = arena.rank, arena.size
        self._calls = 0
        halves = [[slot[h * _HALF_BYTES:(h + 1) * _HALF_BYTES] for slot in arena.slots] for h in (0, 1)]
        self._headers = [[half[:HEADER_BYTES] for half in slots] for slots in halves]
        self._my_header = [memoryview(slots[self.rank][:HEADER_BYTES]) for slots in halves]  # (bytes go in quicker)
        self._peer_headers = [[h for r, h in enumerate(headers) if r != self.rank] for headers in self._headers]
        self._header_values = [[half[:HEADER_BYTES].view(np.int64) for half in slots] for slots in halves]
        self._payload_bytes = [[half[HEADER_BYTES:] for half in slots] for slots in halves]
        self._payloads = {}  # (half, dtype, count) -> every rank's payload view

    @classmethod
    def create(cls, comm):
        """The board of ``comm``, or None unless every rank shares one host (collective)."""
        arena = SharedArena.create(comm, slot_bytes=2 * _HALF_BYTES)
        return cls(arena) if arena is not None else None

    def payload(self, dtype, count):
        """This rank's payload view for the next :meth:`exchange`: fill it, then call exchange."""
        return self.views(self.next_half(), dtype, count)[self.rank]

    def plan(self, who, header, packed, dtype, shape, op):
        """A :class:`BoardPlan` replaying a small call of this header (see :func:`ringtrain.comm.plans.small_plan`)."""
        return BoardPlan(self, who, header, packed, dtype, shape, op)

    def exchange(self, packed, has_payload, combine, out):
        """Post ``packed`` (this rank's packed header), pass the barrier, read every rank's header.

        Args:
            packed: this rank's header as bytes (``HEADER`` packed).
            has_payload: whether this rank filled :meth:`payload` (same
                dtype and count as ``out``) for a small call.
            combine: ``f(a, b, out)``, applied in rank order.
            out: where the combined payloads go, when every rank agreed.

        Returns:
            None when every rank posted the same header, else ``(lowest,
            highest)`` field values over all ranks.
        """
        half = self.post(packed)
        if not self.agreed(half, packed):
            return self.verdict(half)
        if has_payload:
            everyone = self.views(half, out.dtype, out.size)
            combine(everyone[0], everyone[1], out=out)
            for theirs in everyone[2:]:
                combine(out, theirs, out=out)
        return None

    def next_half(self):
        """The half of every slot the next call uses."""
        return self._calls % 2

    def agreed(self, half, packed):
        """Whether every rank posted ``packed`` (bytes) in ``half`` (this rank did: :meth:`post` wrote it)."""
        for header in self._peer_headers[half]:  # (a plain loop: a generator in all() costs more than two looks)
            if header.tobytes() != packed:
                return False
        return True

    def post(self, packed):
        """Write this rank's header (bytes) in this call's half, pass the barrier; return the half."""
        half = self._calls % 2
        self._calls += 1
        self._my_header[half][:] = packed
        self.arena.sync()
        return half

    def close(self):
        """Free the shared memory (collective)."""
        self._payloads.clear()
        self.arena.free()

    def views(self, half, dtype, count):
        """Every rank's payload of ``count`` elements of ``dtype`` in ``half``, in rank order (cached)."""
        key = (half, dtype, count)
        views = self._payloads.get(key)
        if views is None:
            if len(self._payloads) > 1024:  # bounded: training loops repeat a few shapes
                self._payloads.clear()
            nbytes = count * np.dtype(dtype).itemsize
            views = self._payloads[key] = [region[:nbytes].view(dtype) for region in self._payload_bytes[half]]
        return views

    def verdict(self, half):
        """``(lowest, highest)`` of every header field posted in ``half``."""
        lowest = np.minimum.reduce(self._header_values[half]).tolist()
        return lowest[:NFIELDS], [-v for v in lowest[NFIELDS:]]


class BoardPlan:
    """A small NumPy call on one host, prepared once and replayed through the board.

    Python's own overhead is most of a small call (MPI's ``Allreduce`` of
    8 KiB takes a few microseconds), so the plan keeps everything a repeated
    call needs: the packed header, each half's payload views in rank order,
    and the combine. A call is then one copy in, the header, the barrier, a
    comparison of every rank's header with ours, and one combine per peer
    written straight into ``x``.
    """

    __slots__ = ("board", "who", "header", "packed", "mine", "everyone", "combine",
                 "predivide", "divide_after", "size")

    def __init__(self, board, who, header, packed, dtype, shape, op):
        self.board, self.who, self.header = board, who, header
        self.packed = packed
        self.everyone = [[view.reshape(shape) for view in board.views(half, dtype, header[3])] for half in (0, 1)]
        self.mine = [views[board.rank] for views in self.everyone]
        self.combine, self.predivide, self.divide_after = combine_for(op, dtype)
        self.size = dtype.type(board.size)  # a scalar of x's dtype: no conversion per call

    def free(self):
        """Nothing to free: the board outlives its plans."""

    def run(self, x):
        """Reduce ``x`` (a NumPy array of the planned dtype and shape) in place; return it."""
        board = self.board
        half = board.next_half()
        mine = self.mine[half]
        mine[...] = x
        if self.predivide:
            np.divide(mine, self.size, mine)
        board.post(self.packed)
        if not board.agreed(half, self.packed):
            raise_mismatch(self.who, self.header, board.verdict(half), None)
        everyone, combine = self.everyone[half], self.combine
        combine(everyone[0], everyone[1], x)
        for theirs in everyone[2:]:
            combine(x, theirs, x)
        if self.divide_after:
            np.divide(x, self.size, x)
        return x

"""The header every collective call starts with, and what a mismatch says.

Every collective in :mod:`ringtrain.comm.collectives` (and the
:class:`ringtrain.comm.reducer.Reducer`'s buckets) begins with a header exchange
that every rank completes whatever its arguments. The header is
``NFIELDS`` ints, one per entry of :data:`FIELDS`: a problem code (nonzero
when this rank found its own arguments unusable, a :class:`Problem`), the
number of arrays, the dtype, length, op and transport codes, the broadcast
root, and a signature (a hash of every shape and dtype of a list reduction,
and its compression).

On the wire a header is packed as ``[fields, -fields]`` (:data:`HEADER`,
:data:`HEADER_BYTES`). Each rank keeps the elementwise minimum of what it has
heard, so after the exchange it holds the lowest and the highest value of
every field over all ranks; a rank whose minimum still equals its own header
heard only agreement. Calls that disagree therefore neither hang nor
corrupt: if any rank passed something different (or something it cannot
use), every rank raises (:func:`raise_mismatch`), naming both values.

A small call carries its data in the same message, after the header, so the
check costs no extra round trip; a larger call sends the header alone first.

The tables, the messages and the checks are pure; :func:`exchange` is the
protocol itself, over the buffers a communicator's
:class:`~ringtrain.comm.state.CommState` keeps: by recursive doubling across
hosts, and through the shared-memory board (:mod:`ringtrain.comm.board`)
when every rank shares one host.
"""

import enum
import functools
import struct

import numpy as np

from ..errors import MismatchError, UsageError
from .policy import ALGORITHMS

__all__ = [
    "OPS",
    "ALGORITHMS",
    "DTYPES",
    "DTYPE_CODE",
    "OP_CODE",
    "BROADCAST",
    "ALGORITHM_CODE",
    "COMBINE",
    "FIELDS",
    "NFIELDS",
    "HEADER",
    "HEADER_BYTES",
    "TAG",
    "SIGNATURE_MASK",
    "Problem",
    "raise_mismatch",
    "code_of",
    "combine_for",
    "check_local",
    "exchange",
]

OPS = ("sum", "mean", "min", "max")

DTYPES = tuple(np.dtype(t) for t in (np.float16, np.float32, np.float64, np.int32, np.int64))
DTYPE_CODE = {dt: i + 1 for i, dt in enumerate(DTYPES)}
OP_CODE = {name: i + 1 for i, name in enumerate(OPS)}
BROADCAST = len(OPS) + 1  # the op code broadcast_ sends
ALGORITHM_CODE = {name: i + 1 for i, name in enumerate(ALGORITHMS)}
COMBINE = {"sum": np.add, "mean": np.add, "min": np.minimum, "max": np.maximum}

# Header fields, in the order a mismatch is reported (the most telling first).
FIELDS = ("problem", "narrays", "dtype", "length", "op", "transport", "root", "signature", "device")
NFIELDS = len(FIELDS)
HEADER = struct.Struct(f"<{2 * NFIELDS}q")
HEADER_BYTES = HEADER.size
TAG = 10  # the message tag of every header exchange
SIGNATURE_MASK = (1 << 62) - 1


class Problem(enum.IntEnum):
    """What a rank can find wrong with its own arguments; sent in the header's first field.

    Every rank then raises, not just the one that found it; the ranks that
    found nothing name the problem from the code alone (:attr:`summary`).
    """

    NONE = 0
    DTYPE = 1
    OP = 2
    ALGORITHM = 3
    READ_ONLY = 4
    MEAN_NEEDS_FLOAT = 5
    ROOT = 6
    COMPRESSION = 7
    BUCKET_SIZE = 8

    @property
    def summary(self):
        """The problem in a few words, for the ranks that did not see it."""
        return _SUMMARIES[self]


_SUMMARIES = {
    Problem.NONE: "no problem",
    Problem.DTYPE: "unsupported dtype",
    Problem.OP: "unknown op",
    Problem.ALGORITHM: "unknown transport",
    Problem.READ_ONLY: "the array is read-only",
    Problem.MEAN_NEEDS_FLOAT: "op 'mean' needs a floating-point dtype",
    Problem.ROOT: "root is outside the communicator",
    Problem.COMPRESSION: "unknown compression",
    Problem.BUCKET_SIZE: "bucket size must be at least 1 byte",
}


def _describe(field, value):
    """``value`` of header field ``field``, as a mismatch message names it."""
    if field == "dtype":
        return str(DTYPES[value - 1]) if 0 < value <= len(DTYPES) else "an unsupported dtype"
    if field == "op":
        names = OPS + ("broadcast",)
        return repr(names[value - 1]) if 0 < value <= len(names) else "an unknown op"
    if field == "transport":
        return repr(ALGORITHMS[value - 1]) if 0 < value <= len(ALGORITHMS) else "an unknown transport"
    if field == "length":
        return f"{value} elements"
    if field == "device":
        return "a GPU (CuPy) array" if value else "a host (NumPy) array"
    return str(value)


def raise_mismatch(who, header, verdict, local_problem):
    """Raise, on every rank, the error that a disagreeing header exchange means.

    Args:
        who: the public function's name, which starts the message.
        header: this rank's header (``NFIELDS`` ints).
        verdict: ``(lowest, highest)`` field values over all ranks.
        local_problem: this rank's own message for its problem code, or None.

    Raises:
        UsageError: when some rank found a problem with its own arguments
            (this rank's message if it was one of them).
        MismatchError: otherwise, naming the first field that differs.
    """
    lowest, highest = verdict
    if highest[0] > 0:  # some rank found a problem with its own arguments
        if local_problem:
            raise UsageError(f"{who}: {local_problem}", everywhere=True)
        try:
            summary = Problem(highest[0]).summary
        except ValueError:  # a peer running another ringtrain version
            summary = f"problem code {highest[0]}"
        raise UsageError(f"{who}: another rank could not take part: {summary}", everywhere=True)
    for i, field in enumerate(FIELDS):
        if lowest[i] != highest[i]:
            if field == "signature":
                what = "lists of arrays with different shapes or dtypes"
            else:
                label = {"narrays": "numbers of arrays", "length": "lengths", "device": "kinds of array"}.get(
                    field, field + "s")
                what = f"different {label}: {_describe(field, lowest[i])} and {_describe(field, highest[i])}"
                what += f" (this rank: {_describe(field, header[i])})"
            raise MismatchError(f"{who}: ranks passed {what}; every rank must make the same calls, "
                                "with matching arrays, in the same order")
    raise MismatchError(f"{who}: ranks disagree on the call")  # pragma: no cover - unreachable


def combine_for(op, dtype):
    """``(combine, predivide, divide_after)`` for a replayed small call of ``op`` on ``dtype`` (pure).

    ``combine(a, b, out)`` takes ``out`` positionally: a keyword costs
    measurably more a call, and NumPy deprecates a positional ``out`` for minimum
    and maximum, so those are wrapped. float16 means divide first (sums
    overflow easily), as :func:`ringtrain.comm.collectives.reduce_flat`
    does; wider floats divide last, which is more accurate.
    """
    combine = COMBINE[op]
    if combine is not np.add:
        combine = functools.partial(_combine_out, combine)
    predivide = op == "mean" and np.dtype(dtype) == np.float16
    return combine, predivide, op == "mean" and not predivide


def _combine_out(combine, a, b, out):
    return combine(a, b, out=out)


def code_of(table, name):
    """``table[name]``, or 0 for a name it lacks, unhashable ones included (pure).

    A bad argument must reach the header as a problem code, not raise on
    this rank alone before the exchange and leave its peers waiting.
    """
    return table.get(name, 0) if isinstance(name, str) else 0


def check_local(flat, op, choice):
    """``(Problem, message)`` for this rank's own arguments; ``(Problem.NONE, None)`` when fine."""
    dtype = flat.dtype
    if dtype not in DTYPE_CODE:
        names = ", ".join(str(d) for d in DTYPES)
        return Problem.DTYPE, f"unsupported dtype {dtype}; use one of {names}"
    if not isinstance(op, str) or op not in OP_CODE:
        return Problem.OP, f"unknown op {op!r}; choose one of {', '.join(OPS)}"
    if not isinstance(choice, str) or choice not in ALGORITHM_CODE:
        return Problem.ALGORITHM, f"unknown transport {choice!r}; choose one of {', '.join(ALGORITHMS)}"
    if op == "mean" and dtype.kind != "f":
        return Problem.MEAN_NEEDS_FLOAT, f"op 'mean' needs a floating-point dtype, got {dtype}; use op='sum' and divide"
    return Problem.NONE, None


def exchange(state, header, payload, combine, out):
    """The header exchange, with an optional payload: on the board on one host, else by recursive doubling.

    Every rank goes through the same rounds whatever its header says, and
    receives into buffers with room for any header plus the largest small
    payload, so disagreeing calls cannot truncate, overrun or hang. Each
    rank keeps the elementwise minimum of ``[fields, -fields]`` over what
    it has heard; a rank whose minimum still equals its own header heard
    only agreement, and after the last round everyone has heard from
    everyone.

    Args:
        header: ``NFIELDS`` ints.
        payload: the view from :meth:`~ringtrain.comm.state.CommState.payload`,
            holding this rank's data, or None to send the header alone.
        combine: ``f(a, b, out)`` applied lower rank first.
        out: 1-D NumPy array the result is written to.

    Collective over ``state.comm`` (a :class:`ringtrain.comm.state.CommState`,
    whose :class:`~ringtrain.comm.exchange.Mailbox` it uses).

    Returns:
        None when every rank sent the same header, else ``(lowest, highest)``
        field values over all ranks.
    """
    comm, rank, box = state.comm, state.rank, state.mailbox
    mine = box.packed(header)
    board = state.board()
    if board is not None:
        return board.exchange(mine, payload is not None, combine, out)
    box.send_bytes[:HEADER_BYTES] = mine
    if payload is None:
        message, theirs = box.header_only, None
    else:
        message, theirs = box.views(payload.dtype, payload.size)[1:]
    heard, received = box.heard, box.recv_bytes[:HEADER_BYTES]
    agreed = True
    last = len(state.doubling) - 1
    for step, (kind, peer) in enumerate(state.doubling):
        if kind == "send":
            comm.Send(message, peer, TAG)
            comm.Recv(heard, peer, TAG)
            agreed = received.tobytes() == mine
            if agreed and payload is not None:
                out[...] = theirs
            return _verdict(agreed, box.recv_header)
        if kind == "unfold":
            comm.Send(message, peer, TAG)
            continue
        if kind == "exchange":
            comm.Sendrecv(message, peer, TAG, heard, peer, TAG)
        else:
            comm.Recv(heard, peer, TAG)
        if received.tobytes() != mine:
            agreed = False
            np.minimum(box.send_header, box.recv_header, out=box.send_header)
        if agreed and payload is not None:
            # On the last round (nothing left to pass on) write the result
            # straight to its destination: one copy fewer.
            target = out if step == last else payload
            if peer < rank:
                combine(theirs, payload, out=target)
            else:
                combine(payload, theirs, out=target)
    if agreed and payload is not None and (last < 0 or state.doubling[last][0] == "unfold"):
        out[...] = payload
    return _verdict(agreed, box.send_header)


def _verdict(agreed, header):
    if agreed:
        return None
    values = header.tolist()
    return values[:NFIELDS], [-v for v in values[NFIELDS:]]

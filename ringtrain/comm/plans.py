"""Small CPU calls, prepared once and replayed.

The latency-bound allreduce is dominated by Python, not by the wire.
:func:`small_plan` prepares, once per call shape, a plan that replays the
header-checked exchange of :func:`ringtrain.comm.header.exchange`: on one
host a :class:`~ringtrain.comm.board.BoardPlan`, across hosts at 2 ranks a
:class:`PairPlan`, with a persistent send and receive. The plans are kept
on the communicator's :class:`~ringtrain.comm.state.CommState` and freed
with it.
"""

import numpy as np

from .header import (ALGORITHM_CODE, DTYPE_CODE, HEADER, HEADER_BYTES, NFIELDS, OP_CODE, TAG, combine_for,
                     raise_mismatch)
from .policy import SMALL_BYTES

__all__ = ["PairPlan", "small_plan"]

_NO_PLAN = object()


class PairPlan:
    """A small CPU call between exactly two ranks on different hosts, prepared once and replayed.

    The latency-bound case is dominated by Python, not by the wire: MPI's own
    ``Allreduce`` of 4 KiB takes a few microseconds, and every microsecond of
    argument parsing, header packing and view making shows. A plan holds a
    preallocated message whose header is already written, the received
    payload's view, the operands in rank order and a persistent send and
    receive, so a repeated call is a dict lookup, one copy in, one exchange
    (``Startall``/``Waitall``), a 144-byte comparison of the header heard
    against our own, and one combine written straight into ``x``. Any
    strides work: the copy in and the combine's ``out=`` both take them.
    (Its cost against MPI's ``Allreduce`` and a bare ``Sendrecv``:
    docs/performance.md.)

    The check is the same as :func:`ringtrain.comm.header.exchange`'s: the receive
    buffer has room for any header plus the largest small payload, so a
    disagreeing peer cannot truncate, overrun or hang the call, and both
    ranks see the disagreement because each compares the other's header.
    """

    __slots__ = ("who", "header", "mine", "payload", "operands", "message", "heard", "received", "requests",
                 "startall", "waitall", "peer", "combine", "predivide", "divide_after", "two", "recv_header",
                 "send_header")

    def __init__(self, state, who, header, dtype, shape, op):
        count, nbytes = header[3], header[3] * dtype.itemsize
        send = np.empty(HEADER_BYTES + nbytes, np.uint8)
        self.send_header = send[:HEADER_BYTES].view(np.int64)
        self.send_header[:] = header + tuple(-v for v in header)
        self.who, self.header = who, header
        self.mine = send[:HEADER_BYTES].tobytes()
        self.payload = send[HEADER_BYTES:].view(dtype).reshape(shape)
        box = state.mailbox
        theirs = box.recv[HEADER_BYTES:HEADER_BYTES + nbytes].view(dtype).reshape(shape)
        self.peer = 1 - state.rank
        # The lower rank's operand first, as everywhere else: both ranks compute bitwise the same.
        self.operands = (self.payload, theirs) if state.rank == 0 else (theirs, self.payload)
        self.message = [send, state.MPI.BYTE]
        self.heard = box.heard
        self.received = box.recv_bytes[:HEADER_BYTES]
        self.recv_header = box.recv_header
        # Persistent requests: MPI parses the buffers once, not on every call,
        # a measurable part of a small call against a plain Sendrecv. The receive
        # is posted first and takes the whole receive buffer, as in exchange().
        comm = state.comm
        self.requests = [comm.Recv_init(self.heard, self.peer, TAG), comm.Send_init(self.message, self.peer, TAG)]
        self.startall, self.waitall = state.MPI.Prequest.Startall, state.MPI.Request.Waitall
        self.combine, self.predivide, self.divide_after = combine_for(op, dtype)
        self.two = dtype.type(2)  # the rank count as a scalar of x's dtype: no conversion per call
        assert count == self.payload.size

    def free(self):
        """Free the persistent requests (MPICH complains of inactive ones left at MPI_Finalize)."""
        for request in self.requests:
            if request:
                request.Free()

    def run(self, x):
        """Reduce ``x`` (a NumPy array of the planned dtype and shape) in place; return it."""
        # Positional out= and slice assignment: each cheaper than the keyword and np.copyto.
        payload = self.payload
        payload[...] = x
        if self.predivide:
            np.divide(payload, self.two, payload)
        requests = self.requests
        self.startall(requests)
        self.waitall(requests)
        # tobytes() then compare: 40 ns; comparing memoryviews goes element by element (400 ns).
        if self.received.tobytes() != self.mine:
            lowest = np.minimum(self.send_header, self.recv_header).tolist()
            raise_mismatch(self.who, self.header, (lowest[:NFIELDS], [-v for v in lowest[NFIELDS:]]), None)
        a, b = self.operands
        self.combine(a, b, x)
        if self.divide_after:
            np.divide(x, self.two, x)
        return x


_ALLREDUCE_ = ("allreduce_", 1, 0)


def plan_key(x, op, algorithm):
    """The key of ``allreduce_``'s plan for ``x`` in ``CommState.plans``: the shortest that tells plans apart
    (a small call hashes it every time); every other caller's key is longer, so the two never meet."""
    return x.dtype, x.shape, op, algorithm


def small_plan(state, who, x, op, algorithm, narrays=1, signature=0):
    """The plan that replays this small call, made on first use; None where the general path must run.

    On one host a :class:`~ringtrain.comm.board.BoardPlan` (any rank
    count); across hosts at 2 ranks a :class:`PairPlan`.
    """
    if not (isinstance(op, str) and isinstance(algorithm, str)):
        return None  # unhashable or odd: the general path refuses it on every rank
    key = plan_key(x, op, algorithm) if (who, narrays, signature) == _ALLREDUCE_ else (
        who, x.dtype, x.shape, op, algorithm, narrays, signature)
    plans = state.plans
    plan = plans.get(key, _NO_PLAN)
    if plan is _NO_PLAN:
        if len(plans) > 256:  # bounded: training loops repeat a few shapes
            state.drop_plans()
        dtype = np.dtype(x.dtype)
        plan = None
        if (type(x) is np.ndarray and algorithm == "auto" and x.nbytes <= SMALL_BYTES
                and op in OP_CODE and dtype in DTYPE_CODE and not (op == "mean" and dtype.kind != "f")):
            header = (0, narrays, DTYPE_CODE[dtype], x.size, OP_CODE[op], ALGORITHM_CODE[algorithm], 0,
                      signature, 0)
            board = state.board()
            if board is not None:
                plan = board.plan(who, header, HEADER.pack(*header, *(-v for v in header)), dtype, x.shape, op)
            elif state.size == 2:
                plan = PairPlan(state, who, header, dtype, x.shape, op)
        plans[key] = plan
    return plan

"""What ringtrain keeps on one communicator: buffers, schedule and small-call plans.

A :class:`CommState` is cached on each communicator with MPI attribute
caching (:func:`state_of`): the recursive-doubling schedule, the send and
receive buffers of the header exchange (:meth:`CommState.exchange`, the
protocol in :mod:`ringtrain.comm.header`), the shared-memory arena of
:mod:`ringtrain.comm.window`, and reused staging buffers (the ring's receive
segments, the fusion buffer, pinned host copies of GPU arrays). They grow to
the largest size seen and are reused, so steady-state calls allocate nothing.

At 2 ranks a small NumPy call is replayed from a prepared
:class:`PairPlan`, so Python adds well under a microsecond. The plans hold
persistent MPI requests, which are freed at exit before MPI finalises.
"""

import atexit
import functools
import weakref

import numpy as np

from .header import ALGORITHM_CODE, COMBINE, DTYPE_CODE, HEADER, HEADER_BYTES, NFIELDS, OP_CODE, TAG, raise_mismatch
from .ring import doubling_schedule

__all__ = ["CommState", "PairPlan", "pair_plan", "state_of", "SMALL_BYTES"]

# At or below this many bytes, "auto" uses recursive doubling with the header
# in the same message; above it, the ring. Measured with
# `ringtrain bench allreduce` at 2 ranks on the 2-core development machine
# (MPICH 5, shared memory): doubling and ring cross between 32 and 64 KiB.
# The exchange buffers hold a header plus this much, so a disagreeing peer's
# message always fits.
SMALL_BYTES = 64 << 10

_NO_PLAN = object()
_UNSET = object()
_live_plans = weakref.WeakSet()


class CommState:
    """What ringtrain keeps on one communicator: its schedule and reused buffers."""

    _keyval = None  # one MPI attribute key for the process, made on first use

    def __init__(self, comm):
        from mpi4py import MPI

        self.MPI = MPI
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.doubling = doubling_schedule(self.rank, self.size)
        self.cuda_aware = None  # asked on the first GPU array
        self._arena = _UNSET  # the shared-memory arena, made by the first large call
        self._buffers = {}
        capacity = HEADER_BYTES + SMALL_BYTES
        self.send = np.empty(capacity, np.uint8)
        self.recv = np.empty(capacity, np.uint8)
        self.send_header = self.send[:HEADER_BYTES].view(np.int64)
        self.recv_header = self.recv[:HEADER_BYTES].view(np.int64)
        self.send_bytes, self.recv_bytes = memoryview(self.send), memoryview(self.recv)
        self._header_only = [self.send[:HEADER_BYTES], MPI.BYTE]
        self._heard = [self.recv, MPI.BYTE]
        # Small calls are latency-bound: Python's own overhead is a large part
        # of a 4 KiB call, so packed headers and buffer views are made once.
        self._packed = {}
        self._views = {}
        # Steady-state plans for small CPU calls at 2 ranks (see PairPlan),
        # keyed on everything the header says; None where no plan applies.
        self.plans = {}

    @classmethod
    def of(cls, comm):
        """The state cached on ``comm``, made on first use (Comm attribute caching)."""
        if cls._keyval is None:
            cls._keyval = comm.Create_keyval()
        state = comm.Get_attr(cls._keyval)
        if state is None:
            state = cls(comm)
            comm.Set_attr(cls._keyval, state)
        return state

    def arena(self):
        """The :class:`ringtrain.comm.window.SharedArena` of this communicator, or None across hosts.

        Collective on first use: the first large call makes it, and every rank
        reaches that call at the same point, with the same size and algorithm.
        """
        if self._arena is _UNSET:
            from .window import SharedArena

            self._arena = SharedArena.create(self.comm)
        return self._arena

    def free_arena(self):
        """Release the shared-memory window, if any (collective)."""
        if self._arena not in (_UNSET, None):
            self._arena.free()
        self._arena = _UNSET

    def drop_plans(self):
        """Forget the small-call plans and free their requests (before freeing the communicator)."""
        for plan in self.plans.values():
            if plan is not None:
                plan.free()
        self.plans.clear()

    def buffer(self, name, nbytes, xp=np, pinned=False):
        """A reused 1-D uint8 buffer of at least ``nbytes``; grows, never shrinks."""
        key = (name, xp.__name__, pinned)
        buf = self._buffers.get(key)
        if buf is None or buf.size < nbytes:
            size = max(nbytes, 1)
            if pinned:
                memory = xp.cuda.alloc_pinned_memory(size)
                buf = np.frombuffer(memory, np.uint8, size)
            else:
                buf = xp.empty(size, np.uint8)
            self._buffers[key] = buf
        return buf

    def views(self, dtype, count):
        """(payload, message spec, received payload) for ``count`` elements of ``dtype``, cached."""
        key = (dtype, count)
        views = self._views.get(key)
        if views is None:
            if len(self._views) > 1024:
                self._views.clear()
            end = HEADER_BYTES + count * np.dtype(dtype).itemsize
            views = self._views[key] = (self.send[HEADER_BYTES:end].view(dtype),
                                        [self.send[:end], self.MPI.BYTE],
                                        self.recv[HEADER_BYTES:end].view(dtype))
        return views

    def exchange(self, header, payload, combine, out):
        """The header exchange, by recursive doubling, with an optional payload.

        Every rank goes through the same rounds whatever its header says, and
        receives into buffers with room for any header plus the largest small
        payload, so disagreeing calls cannot truncate, overrun or hang. Each
        rank keeps the elementwise minimum of ``[fields, -fields]`` over what
        it has heard; a rank whose minimum still equals its own header heard
        only agreement, and after the last round everyone has heard from
        everyone.

        Args:
            header: ``NFIELDS`` ints.
            payload: the payload view from :meth:`views`, in ``self.send`` after the header,
                holding this rank's data, or None to send the header alone.
            combine: ``f(a, b, out)`` applied lower rank first.
            out: 1-D NumPy array the result is written to.

        Returns:
            ``(lowest, highest)`` field values over all ranks.
        """
        comm, rank = self.comm, self.rank
        mine = self._packed.get(header)
        if mine is None:
            if len(self._packed) > 1024:  # bounded: headers repeat in training loops
                self._packed.clear()
            mine = self._packed[header] = HEADER.pack(*header, *(-v for v in header))
        self.send_bytes[:HEADER_BYTES] = mine
        if payload is None:
            message, theirs = self._header_only, None
        else:
            message, theirs = self.views(payload.dtype, payload.size)[1:]
        heard, received = self._heard, self.recv_bytes[:HEADER_BYTES]
        agreed = True
        last = len(self.doubling) - 1
        for step, (kind, peer) in enumerate(self.doubling):
            if kind == "send":
                comm.Send(message, peer, TAG)
                comm.Recv(heard, peer, TAG)
                agreed = received.tobytes() == mine
                if agreed and payload is not None:
                    out[...] = theirs
                return self._verdict(agreed, self.recv_header)
            if kind == "unfold":
                comm.Send(message, peer, TAG)
                continue
            if kind == "exchange":
                comm.Sendrecv(message, peer, TAG, heard, peer, TAG)
            else:
                comm.Recv(heard, peer, TAG)
            if received.tobytes() != mine:
                agreed = False
                np.minimum(self.send_header, self.recv_header, out=self.send_header)
            if agreed and payload is not None:
                # On the last round (nothing left to pass on) write the result
                # straight to its destination: one copy fewer.
                target = out if step == last else payload
                if peer < rank:
                    combine(theirs, payload, out=target)
                else:
                    combine(payload, theirs, out=target)
        if agreed and payload is not None and (last < 0 or self.doubling[last][0] == "unfold"):
            out[...] = payload
        return self._verdict(agreed, self.send_header)

    def _verdict(self, agreed, header):
        if agreed:
            return None
        values = header.tolist()
        return values[:NFIELDS], [-v for v in values[NFIELDS:]]


class PairPlan:
    """A small CPU call between exactly two ranks, prepared once and replayed.

    The latency-bound case is dominated by Python, not by the wire: MPI's own
    ``Allreduce`` of 4 KiB takes about 5 us here, and every microsecond of
    argument parsing, header packing and view making shows. A plan holds a
    preallocated message whose header is already written, the received
    payload's view, the operands in rank order and a persistent send and
    receive, so a repeated call is a dict lookup, one copy in, one exchange
    (``Startall``/``Waitall``), a 128-byte comparison of the header heard
    against our own, and one combine written straight into ``x``. Any
    strides work: the copy in and the combine's ``out=`` both take them.
    Measured at 2 ranks, 4 KiB float32 sum: MPI's ``Allreduce`` 4.1 us, a
    bare mpi4py ``Sendrecv`` of the same message 2.6 us, this path 3.9-4.5 us.

    The check is the same as :meth:`CommState.exchange`'s: the receive
    buffer has room for any header plus the largest small payload, so a
    disagreeing peer cannot truncate, overrun or hang the call, and both
    ranks see the disagreement because each compares the other's header.
    """

    __slots__ = ("who", "header", "mine", "payload", "operands", "message", "heard", "received", "requests",
                 "startall", "waitall", "peer", "combine", "predivide", "divide_after", "two", "recv_header",
                 "send_header", "__weakref__")

    def __init__(self, state, who, header, dtype, shape, op):
        count, nbytes = header[3], header[3] * dtype.itemsize
        send = np.empty(HEADER_BYTES + nbytes, np.uint8)
        self.send_header = send[:HEADER_BYTES].view(np.int64)
        self.send_header[:] = header + tuple(-v for v in header)
        self.who, self.header = who, header
        self.mine = send[:HEADER_BYTES].tobytes()
        self.payload = send[HEADER_BYTES:].view(dtype).reshape(shape)
        theirs = state.recv[HEADER_BYTES:HEADER_BYTES + nbytes].view(dtype).reshape(shape)
        self.peer = 1 - state.rank
        # The lower rank's operand first, as everywhere else: both ranks compute bitwise the same.
        self.operands = (self.payload, theirs) if state.rank == 0 else (theirs, self.payload)
        self.message = [send, state.MPI.BYTE]
        self.heard = state._heard
        self.received = state.recv_bytes[:HEADER_BYTES]
        self.recv_header = state.recv_header
        # Persistent requests: MPI parses the buffers once, not on every call
        # (0.4 us of a 4.6 us call here, against a plain Sendrecv). The receive
        # is posted first and takes the whole receive buffer, as in exchange().
        comm = state.comm
        self.requests = [comm.Recv_init(self.heard, self.peer, TAG), comm.Send_init(self.message, self.peer, TAG)]
        self.startall, self.waitall = state.MPI.Prequest.Startall, state.MPI.Request.Waitall
        _live_plans.add(self)
        combine = COMBINE[op]
        if combine is not np.add:  # NumPy deprecates a positional out= for minimum and maximum
            combine = functools.partial(_combine_out, combine)
        self.combine = combine
        # float16 sums overflow easily: divide first, as _reduce_flat does.
        self.predivide = op == "mean" and dtype == np.float16
        self.divide_after = op == "mean" and not self.predivide
        self.two = dtype.type(2)  # the rank count as a scalar of x's dtype: no conversion per call
        assert count == self.payload.size

    def free(self):
        """Free the persistent requests (MPICH complains of inactive ones left at MPI_Finalize)."""
        for request in self.requests:
            if request:
                request.Free()
        _live_plans.discard(self)

    def run(self, x):
        """Reduce ``x`` (a NumPy array of the planned dtype and shape) in place; return it."""
        # Positional out= and slice assignment: each ~0.3 us cheaper than the keyword and np.copyto.
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


def _combine_out(combine, a, b, out):
    return combine(a, b, out=out)


def pair_plan(state, who, x, op, algorithm, narrays=1, signature=0):
    """The :class:`PairPlan` for this call, made on first use; None where the general path must run."""
    key = (who, x.dtype, x.shape, op, algorithm, narrays, signature)
    plans = state.plans
    plan = plans.get(key, _NO_PLAN)
    if plan is _NO_PLAN:
        if len(plans) > 256:  # bounded: training loops repeat a few shapes
            state.drop_plans()
        dtype = np.dtype(x.dtype)
        plan = None
        if (state.size == 2 and type(x) is np.ndarray and algorithm == "auto" and x.nbytes <= SMALL_BYTES
                and op in OP_CODE and dtype in DTYPE_CODE and not (op == "mean" and dtype.kind != "f")):
            header = (0, narrays, DTYPE_CODE[dtype], x.size, OP_CODE[op], ALGORITHM_CODE[algorithm], 0,
                      signature)
            plan = PairPlan(state, who, header, dtype, x.shape, op)
        plans[key] = plan
    return plan


@atexit.register
def _free_plans():
    # Python's atexit handlers run before mpi4py's MPI_Finalize.
    if not _live_plans:
        return
    from mpi4py import MPI

    if not MPI.Is_finalized():
        for plan in list(_live_plans):
            plan.free()


_recent = (None, None)  # (comm, state) of the latest call; a tuple, so swapping it is atomic


def state_of(comm):
    """The :class:`CommState` of ``comm`` (default ``MPI.COMM_WORLD``)."""
    # Comm.Get_attr costs about half a microsecond, a tenth of a 4 KiB call:
    # repeated calls on one communicator skip it.
    global _recent
    recent = _recent
    if comm is recent[0] and comm is not None:
        return recent[1]
    if comm is None:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        if comm is recent[0]:
            return recent[1]
    state = CommState.of(comm)
    _recent = (comm, state)
    return state


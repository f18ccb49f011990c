"""Averaging arrays across ranks: allreduce, in place, fused, and broadcast.

Every function here is collective: every rank of ``comm`` must call the same
functions, with arrays of the same length and dtype and the same ``op``, in
the same order. Calls that disagree neither hang nor corrupt: each call
starts with a header exchange that every rank completes whatever the
arguments, and if any rank passed something different (or something it
cannot use), every rank raises, naming both values.

How a call runs (``algorithm="auto"``):

* Small messages (at most :data:`SMALL_BYTES`) are latency-bound. They go by
  recursive doubling (:func:`ringtrain.ring.doubling_schedule`) with the
  header carried in the same message as the data: one round trip at 2 ranks,
  the same as MPI's own ``Allreduce``, and the check costs nothing extra.
  At 2 ranks a NumPy call is replayed from a prepared plan
  (:class:`_PairPlan`), so Python adds well under a microsecond.
  (MPI's ``Allreduce`` cannot carry it: with mismatched counts its behaviour
  is undefined, so checking first would need a second collective, which
  doubles the time of a 4 KiB call.)
* Larger messages send the header alone (a few microseconds). Up to 4 MiB,
  when every rank shares one host, they then run the reduce-scatter and
  allgather through a shared-memory window (:mod:`ringtrain.shm`: one copy
  less per byte than any message-passing path, 2-2.5x MPI's ``Allreduce``
  for a 2.6 MiB gradient at 2 ranks); across hosts they call MPI's own
  ``Allreduce`` below :data:`RING_BYTES`. From 4 MiB up they run the
  pipelined ring (:func:`ringtrain.ring.ring_allreduce`).
* ``algorithm="mpi"`` sends the header alone, then calls MPI's ``Allreduce``;
  ``algorithm="ring"`` forces the ring at every size;
  ``algorithm="shm"`` forces shared memory (every rank on one host);
  ``algorithm="hierarchical"`` reduces within each host, rings across hosts
  and broadcasts within each host (:mod:`ringtrain.hierarchical`).

Reductions run in a fixed order, so every rank gets bitwise the same result
and a repeated call gives bitwise the same result.

Buffers (staging for the header exchange, the ring's receive segments, the
fusion buffer, pinned host copies of GPU arrays) belong to the communicator:
they are cached on it with MPI attribute caching, grow to the largest size
seen and are reused, so steady-state calls allocate nothing.

CuPy arrays: the stream is synchronised before MPI touches a buffer. If
mpi4py reports a CUDA-aware MPI (``MPI.Query_cuda_support``), device buffers
go to MPI directly; otherwise they are staged through reused pinned host
buffers and reduced on the host.
"""

import atexit
import functools
import operator
import weakref
import struct

import numpy as np

from . import backend
from .errors import MismatchError, UsageError
from .ring import doubling_schedule, ring_allreduce

__all__ = [
    "allreduce",
    "allreduce_",
    "allreduce_many_",
    "broadcast_",
    "plan_buckets",
    "pack",
    "unpack",
    "COMPRESSIONS",
    "cuda_aware",
    "ALGORITHMS",
    "OPS",
    "SMALL_BYTES",
    "RING_BYTES",
    "SEGMENT_BYTES",
    "DEFAULT_BUCKET_BYTES",
]

# At or below this many bytes, "auto" uses recursive doubling with the header
# in the same message; above it, the ring. Measured with
# `ringtrain bench allreduce` at 2 ranks on the 2-core development machine
# (MPICH 5, shared memory): doubling and ring cross between 32 and 64 KiB.
SMALL_BYTES = 64 << 10
# Below this many bytes (and above SMALL_BYTES), "auto" hands the data to
# MPI's own Allreduce after the header check; from here up, the ring. At 2
# ranks here, the ring lost to MPI by 15-60% from 128 KiB to 2 MiB, tied at
# 4-8 MiB, and wins from 16 MiB (by 3x from 32 MiB, where MPI's temporary
# buffer leaves glibc's heap for fresh mmap'd, page-faulting memory).
RING_BYTES = 4 << 20
# Ring pipeline segment. 64 MiB at 2 ranks: 6.0 GB/s unsegmented, 6.8 GB/s at
# 256 KiB, 7.6 GB/s at 1 MiB segments (about half the 2 MiB L2 cache).
SEGMENT_BYTES = 1 << 20
# Largest fused bucket in allreduce_many_.
DEFAULT_BUCKET_BYTES = 8 << 20

OPS = ("sum", "mean", "min", "max")
ALGORITHMS = ("auto", "ring", "mpi", "hierarchical", "shm")

_DTYPES = tuple(np.dtype(t) for t in (np.float16, np.float32, np.float64, np.int32, np.int64))
_DTYPE_CODE = {dt: i + 1 for i, dt in enumerate(_DTYPES)}
_OP_CODE = {name: i + 1 for i, name in enumerate(OPS)}
_BROADCAST = len(OPS) + 1
_ALGORITHM_CODE = {name: i + 1 for i, name in enumerate(ALGORITHMS)}
_COMBINE = {"sum": np.add, "mean": np.add, "min": np.minimum, "max": np.maximum}

# Header fields, in the order a mismatch is reported (the most telling first).
_FIELDS = ("problem", "narrays", "dtype", "length", "op", "algorithm", "root", "signature")
_K = len(_FIELDS)
_HEADER = struct.Struct(f"<{2 * _K}q")
_HEADER_BYTES = _HEADER.size
_TAG = 10
_SIGNATURE_MASK = (1 << 62) - 1

# Problems a rank can find in its own arguments; sent in the header so that
# every rank raises, not just the one that found it.
_PROBLEMS = {
    1: "unsupported dtype",
    2: "unknown op",
    3: "unknown algorithm",
    4: "the array is read-only",
    5: "op 'mean' needs a floating-point dtype",
    6: "root is outside the communicator",
    7: "unknown compression",
}


def cuda_aware():
    """True when mpi4py reports that MPI can read and write GPU memory directly."""
    from mpi4py import MPI

    query = getattr(MPI, "Query_cuda_support", None)
    try:
        return bool(query()) if query is not None else False
    except Exception:  # noqa: BLE001 - an MPI without the extension says "no" by raising
        return False


def plan_buckets(arrays, bucket_bytes):
    """Group consecutive arrays into fusion buckets (pure).

    A bucket holds consecutive arrays of one dtype and one array module, at
    most ``bucket_bytes`` in all; an array larger than that is a bucket of its
    own. Order is kept, so every rank with the same list gets the same buckets.

    Returns a list of lists of indices into ``arrays``.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket size must be at least 1 byte, got {bucket_bytes}")
    buckets, current, used, kind = [], [], 0, None
    for i, a in enumerate(arrays):
        this = (np.dtype(a.dtype), backend.is_gpu_array(a))
        if current and (this != kind or used + a.nbytes > bucket_bytes):
            buckets.append(current)
            current, used = [], 0
        current.append(i)
        used += a.nbytes
        kind = this
    if current:
        buckets.append(current)
    return buckets


class _CommState:
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
        capacity = _HEADER_BYTES + SMALL_BYTES
        self.send = np.empty(capacity, np.uint8)
        self.recv = np.empty(capacity, np.uint8)
        self.send_header = self.send[:_HEADER_BYTES].view(np.int64)
        self.recv_header = self.recv[:_HEADER_BYTES].view(np.int64)
        self.send_bytes, self.recv_bytes = memoryview(self.send), memoryview(self.recv)
        self._header_only = [self.send[:_HEADER_BYTES], MPI.BYTE]
        self._heard = [self.recv, MPI.BYTE]
        # Small calls are latency-bound: Python's own overhead is a large part
        # of a 4 KiB call, so packed headers and buffer views are made once.
        self._packed = {}
        self._views = {}
        # Steady-state plans for small CPU calls at 2 ranks (see _PairPlan),
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
        """The :class:`ringtrain.shm.SharedArena` of this communicator, or None across hosts.

        Collective on first use: the first large call makes it, and every rank
        reaches that call at the same point, with the same size and algorithm.
        """
        if self._arena is _UNSET:
            from .shm import SharedArena

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
            end = _HEADER_BYTES + count * np.dtype(dtype).itemsize
            views = self._views[key] = (self.send[_HEADER_BYTES:end].view(dtype),
                                        [self.send[:end], self.MPI.BYTE],
                                        self.recv[_HEADER_BYTES:end].view(dtype))
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
            header: ``_K`` ints.
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
            mine = self._packed[header] = _HEADER.pack(*header, *(-v for v in header))
        self.send_bytes[:_HEADER_BYTES] = mine
        if payload is None:
            message, theirs = self._header_only, None
        else:
            message, theirs = self.views(payload.dtype, payload.size)[1:]
        heard, received = self._heard, self.recv_bytes[:_HEADER_BYTES]
        agreed = True
        last = len(self.doubling) - 1
        for step, (kind, peer) in enumerate(self.doubling):
            if kind == "send":
                comm.Send(message, peer, _TAG)
                comm.Recv(heard, peer, _TAG)
                agreed = received.tobytes() == mine
                if agreed and payload is not None:
                    out[...] = theirs
                return self._verdict(agreed, self.recv_header)
            if kind == "unfold":
                comm.Send(message, peer, _TAG)
                continue
            if kind == "exchange":
                comm.Sendrecv(message, peer, _TAG, heard, peer, _TAG)
            else:
                comm.Recv(heard, peer, _TAG)
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
        return values[:_K], [-v for v in values[_K:]]


class _PairPlan:
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

    The check is the same as :meth:`_CommState.exchange`'s: the receive
    buffer has room for any header plus the largest small payload, so a
    disagreeing peer cannot truncate, overrun or hang the call, and both
    ranks see the disagreement because each compares the other's header.
    """

    __slots__ = ("who", "header", "mine", "payload", "operands", "message", "heard", "received", "requests",
                 "startall", "waitall", "peer", "combine", "predivide", "divide_after", "two", "recv_header",
                 "send_header", "__weakref__")

    def __init__(self, state, who, header, dtype, shape, op):
        count, nbytes = header[3], header[3] * dtype.itemsize
        send = np.empty(_HEADER_BYTES + nbytes, np.uint8)
        self.send_header = send[:_HEADER_BYTES].view(np.int64)
        self.send_header[:] = header + tuple(-v for v in header)
        self.who, self.header = who, header
        self.mine = send[:_HEADER_BYTES].tobytes()
        self.payload = send[_HEADER_BYTES:].view(dtype).reshape(shape)
        theirs = state.recv[_HEADER_BYTES:_HEADER_BYTES + nbytes].view(dtype).reshape(shape)
        self.peer = 1 - state.rank
        # The lower rank's operand first, as everywhere else: both ranks compute bitwise the same.
        self.operands = (self.payload, theirs) if state.rank == 0 else (theirs, self.payload)
        self.message = [send, state.MPI.BYTE]
        self.heard = state._heard
        self.received = state.recv_bytes[:_HEADER_BYTES]
        self.recv_header = state.recv_header
        # Persistent requests: MPI parses the buffers once, not on every call
        # (0.4 us of a 4.6 us call here, against a plain Sendrecv). The receive
        # is posted first and takes the whole receive buffer, as in exchange().
        comm = state.comm
        self.requests = [comm.Recv_init(self.heard, self.peer, _TAG), comm.Send_init(self.message, self.peer, _TAG)]
        self.startall, self.waitall = state.MPI.Prequest.Startall, state.MPI.Request.Waitall
        _live_plans.add(self)
        combine = _COMBINE[op]
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
            _raise_mismatch(self.who, self.header, (lowest[:_K], [-v for v in lowest[_K:]]), None)
        a, b = self.operands
        self.combine(a, b, x)
        if self.divide_after:
            np.divide(x, self.two, x)
        return x


def _pair_plan(state, who, x, op, algorithm, narrays=1, signature=0):
    """The :class:`_PairPlan` for this call, made on first use; None where the general path must run."""
    key = (who, x.dtype, x.shape, op, algorithm, narrays, signature)
    plans = state.plans
    plan = plans.get(key, _NO_PLAN)
    if plan is _NO_PLAN:
        if len(plans) > 256:  # bounded: training loops repeat a few shapes
            state.drop_plans()
        dtype = np.dtype(x.dtype)
        plan = None
        if (state.size == 2 and type(x) is np.ndarray and algorithm == "auto" and x.nbytes <= SMALL_BYTES
                and op in _OP_CODE and dtype in _DTYPE_CODE and not (op == "mean" and dtype.kind != "f")):
            header = (0, narrays, _DTYPE_CODE[dtype], x.size, _OP_CODE[op], _ALGORITHM_CODE[algorithm], 0,
                      signature)
            plan = _PairPlan(state, who, header, dtype, x.shape, op)
        plans[key] = plan
    return plan


_NO_PLAN = object()
_UNSET = object()
_live_plans = weakref.WeakSet()


@atexit.register
def _free_plans():
    # Python's atexit handlers run before mpi4py's MPI_Finalize.
    if not _live_plans:
        return
    from mpi4py import MPI

    if not MPI.Is_finalized():
        for plan in list(_live_plans):
            plan.free()


def _combine_out(combine, a, b, out):
    return combine(a, b, out=out)


def _describe(field, value):
    if field == "dtype":
        return str(_DTYPES[value - 1]) if 0 < value <= len(_DTYPES) else "an unsupported dtype"
    if field == "op":
        names = OPS + ("broadcast",)
        return repr(names[value - 1]) if 0 < value <= len(names) else "an unknown op"
    if field == "algorithm":
        return repr(ALGORITHMS[value - 1]) if 0 < value <= len(ALGORITHMS) else "an unknown algorithm"
    if field == "length":
        return f"{value} elements"
    return str(value)


def _raise_mismatch(who, header, verdict, local_problem):
    lowest, highest = verdict
    if highest[0] > 0:  # some rank found a problem with its own arguments
        if local_problem:
            raise UsageError(f"{who}: {local_problem}", everywhere=True)
        raise UsageError(f"{who}: another rank could not take part: {_PROBLEMS.get(highest[0], 'error')}",
                         everywhere=True)
    for i, field in enumerate(_FIELDS):
        if lowest[i] != highest[i]:
            if field == "signature":
                what = "lists of arrays with different shapes or dtypes"
            else:
                label = {"narrays": "numbers of arrays", "length": "lengths"}.get(field, field + "s")
                what = f"different {label}: {_describe(field, lowest[i])} and {_describe(field, highest[i])}"
                what += f" (this rank: {_describe(field, header[i])})"
            raise MismatchError(f"{who}: ranks passed {what}; every rank must make the same calls, "
                                "with matching arrays, in the same order")
    raise MismatchError(f"{who}: ranks disagree on the call")  # pragma: no cover - unreachable


def _check_local(flat, op, algorithm):
    """(problem code, message) for this rank's own arguments; (0, None) when fine."""
    dtype = flat.dtype
    if dtype not in _DTYPE_CODE:
        names = ", ".join(str(d) for d in _DTYPES)
        return 1, f"unsupported dtype {dtype}; use one of {names}"
    if op not in _OP_CODE:
        return 2, f"unknown op {op!r}; choose one of {', '.join(OPS)}"
    if algorithm not in _ALGORITHM_CODE:
        return 3, f"unknown algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)}"
    if op == "mean" and dtype.kind != "f":
        return 5, f"op 'mean' needs a floating-point dtype, got {dtype}; use op='sum' and divide"
    return 0, None


def _reduce_flat(state, who, flat, op, algorithm, narrays=1, signature=0, problem=(0, None)):
    """Reduce the 1-D contiguous ``flat`` in place across ``state.comm`` (collective)."""
    code, message = problem if problem[0] else _check_local(flat, op, algorithm)
    if state.size == 1:
        if code:
            raise UsageError(f"{who}: {message}", everywhere=True)
        return flat
    dtype = flat.dtype
    header = (code, narrays, _DTYPE_CODE.get(dtype, 0), flat.size, _OP_CODE.get(op, 0),
              _ALGORITHM_CODE.get(algorithm, 0), 0, signature)
    gpu = backend.is_gpu_array(flat)
    combine = _COMBINE.get(op)
    small = code == 0 and algorithm == "auto" and flat.nbytes <= SMALL_BYTES
    # float16 sums overflow easily: divide first (as PyTorch DDP does) for fp16 only;
    # wider floats divide last, which is more accurate.
    predivide = code == 0 and op == "mean" and dtype == np.float16
    if small and not gpu and state.size == 2:
        plan = _pair_plan(state, who, flat, op, algorithm, narrays, signature)
        if plan is not None:
            return plan.run(flat)
    if small:
        payload = state.views(dtype, flat.size)[0]
        if gpu:
            backend.synchronize(flat)
            flat.get(out=payload)
            xp = backend.get_array_module(flat)
            out = state.buffer("gpu-result", flat.nbytes, xp, pinned=True)[:flat.nbytes].view(dtype)
        else:
            payload[...] = flat
            out = flat
        if predivide:
            np.divide(payload, state.size, out=payload)
        verdict = state.exchange(header, payload, combine, out)
        if verdict is not None:
            _raise_mismatch(who, header, verdict, message)
        if op == "mean" and not predivide:
            np.divide(out, state.size, out=out)
        if gpu:
            flat.set(out)
            backend.synchronize(flat)
        return flat
    verdict = state.exchange(header, None, None, None)
    if verdict is not None:
        _raise_mismatch(who, header, verdict, message)
    if code:  # every rank found the same problem
        raise UsageError(f"{who}: {message}", everywhere=True)
    if gpu:
        _reduce_gpu(state, flat, op, algorithm, predivide)
    else:
        _reduce_large(state, flat, op, algorithm, predivide)
    return flat


def _reduce_large(state, flat, op, algorithm, predivide):
    """The bandwidth path after the header check: shared memory, the ring, or MPI's Allreduce."""
    xp = backend.get_array_module(flat)
    if predivide:
        xp.divide(flat, state.size, out=flat)
    backend.synchronize(flat)
    # "auto" takes shared memory only where it fits one block: past that it
    # needs a barrier per block, and on a busy host one late rank makes every
    # barrier wait (the pipelined ring tolerates that far better).
    from .shm import SINGLE_BLOCK_BYTES

    wants_shm = algorithm == "shm" or (algorithm == "auto" and flat.nbytes <= SINGLE_BLOCK_BYTES)
    arena = state.arena() if wants_shm and xp is np else None
    if algorithm == "shm" and arena is None:
        raise UsageError("algorithm 'shm' needs every rank on one host; use 'auto', 'ring' or 'hierarchical'",
                         everywhere=True)
    if arena is not None:
        from .shm import shm_allreduce

        shm_allreduce(arena, flat, _COMBINE[op])
    elif algorithm == "mpi" or (algorithm == "auto" and flat.nbytes < RING_BYTES):
        MPI = state.MPI
        mpi_op = {"sum": MPI.SUM, "mean": MPI.SUM, "min": MPI.MIN, "max": MPI.MAX}[op]
        state.comm.Allreduce(MPI.IN_PLACE, [flat, MPI.Datatype.fromcode(np.dtype(flat.dtype).char)], mpi_op)
    else:
        segment = max(1, SEGMENT_BYTES // flat.itemsize)
        stage = state.buffer("ring", 2 * segment * flat.itemsize, xp)
        stages = (stage[: segment * flat.itemsize].view(flat.dtype),
                  stage[segment * flat.itemsize: 2 * segment * flat.itemsize].view(flat.dtype))
        reduce = ring_allreduce
        if algorithm == "hierarchical":
            from .hierarchical import hierarchical_reduce as reduce
        reduce(state.comm, flat, getattr(xp, _COMBINE[op].__name__), stages, segment)
    if op == "mean" and not predivide:
        xp.divide(flat, state.size, out=flat)
        backend.synchronize(flat)


def _reduce_gpu(state, flat, op, algorithm, predivide):
    """A CuPy array: hand it to a CUDA-aware MPI, or stage it through pinned host memory."""
    if state.cuda_aware is None:
        state.cuda_aware = cuda_aware()
    if state.cuda_aware:
        _reduce_large(state, flat, op, algorithm, predivide)
        return
    xp = backend.get_array_module(flat)
    host = state.buffer("gpu-host", flat.nbytes, xp, pinned=True)[:flat.nbytes].view(flat.dtype)
    backend.synchronize(flat)
    flat.get(out=host)
    _reduce_large(state, host, op, algorithm, predivide)
    flat.set(host)
    # set() may be asynchronous from pinned memory; the host buffer is reused next call.
    backend.synchronize(flat)


_recent = (None, None)  # (comm, state) of the latest call; a tuple, so swapping it is atomic


def _state(comm):
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
    state = _CommState.of(comm)
    _recent = (comm, state)
    return state


def _writeable(x):
    # CuPy arrays have no writeable flag; device memory always is.
    return getattr(x.flags, "writeable", True)


def _flat_view(x):
    """``x`` as a 1-D contiguous view, or None when that would need a copy."""
    if x.flags.c_contiguous:
        return x.reshape(-1)
    return None


def allreduce_(x, op="mean", comm=None, algorithm="auto"):
    """Reduce ``x`` across the ranks of ``comm``, in place.

    Collective: every rank of ``comm`` must call it, with an array of the same
    length and dtype and the same ``op`` and ``algorithm``, in the same order
    as every other collective. If they differ, every rank raises
    :class:`~ringtrain.errors.MismatchError` naming both values.

    Args:
        x: a NumPy or CuPy array of float16, float32, float64, int32 or int64,
            any shape and length (0 included). A non-contiguous ``x`` is
            reduced through a contiguous copy that is written back (one extra
            copy); a read-only ``x`` is an error.
        op: ``"sum"``, ``"mean"`` (floating dtypes only), ``"min"`` or ``"max"``.
        comm: communicator (default ``MPI.COMM_WORLD``).
        algorithm: ``"auto"`` (by size), ``"ring"``, ``"mpi"`` (MPI's own
            ``Allreduce`` after the check) or ``"hierarchical"`` (within
            hosts, then across them: :mod:`ringtrain.hierarchical`).

    Returns:
        ``x``, holding the result, bitwise the same on every rank.

    Raises:
        MismatchError: on every rank, when ranks passed different lengths,
            dtypes, ops or algorithms.
        UsageError: on every rank, when any rank's arguments are unusable.
    """
    state = _state(comm)
    if state.size == 2 and type(x) is np.ndarray and x.flags.writeable:
        plan = _pair_plan(state, "allreduce_", x, op, algorithm)
        if plan is not None:
            return plan.run(x)
    flat = _flat_view(x)
    problem = (0, None)
    if not _writeable(x):
        problem = (4, "the array is read-only; pass a writeable array or use allreduce()")
    if flat is None:
        flat = backend.get_array_module(x).ascontiguousarray(x).reshape(-1)
        _reduce_flat(state, "allreduce_", flat, op, algorithm, problem=problem)
        x[...] = flat.reshape(x.shape)
        return x
    _reduce_flat(state, "allreduce_", flat, op, algorithm, problem=problem)
    return x


def allreduce(x, op="mean", comm=None, algorithm="auto"):
    """Reduce ``x`` across the ranks of ``comm`` into a new array.

    Collective, with the same contract as :func:`allreduce_`. ``x`` is left
    untouched; the result has its array module (NumPy or CuPy), dtype and
    shape and is C-contiguous.
    """
    xp = backend.get_array_module(x)
    result = xp.array(x, copy=True, order="C")
    _reduce_flat(_state(comm), "allreduce", result.reshape(-1), op, algorithm)
    return result


def allreduce_many_(arrays, op="mean", comm=None, bucket_bytes=None, algorithm="auto", compression=None):
    """Reduce a list of arrays in place, fused into buckets (a model's gradients).

    Collective: every rank of ``comm`` must call it with a list of the same
    length, shapes and dtypes, in the same order, and the same ``op``,
    ``bucket_bytes``, ``algorithm`` and ``compression``; otherwise every rank
    raises :class:`~ringtrain.errors.MismatchError`.

    Consecutive arrays of one dtype are copied into a fusion buffer of at most
    ``bucket_bytes`` and reduced with one call; an array larger than a bucket
    is reduced in place on its own, without a copy. The fusion buffer is
    cached on ``comm`` and reused, so steady-state calls allocate nothing.

    Args:
        arrays: a list or tuple of arrays (as for :func:`allreduce_`), or a
            dict whose values are reduced in insertion order.
        op: ``"sum"``, ``"mean"``, ``"min"`` or ``"max"``.
        comm: communicator (default ``MPI.COMM_WORLD``).
        bucket_bytes: largest bucket (default :data:`DEFAULT_BUCKET_BYTES`).
        algorithm: ``"auto"``, ``"ring"``, ``"mpi"`` or ``"hierarchical"``.
        compression: ``None``, or ``"fp16"`` to send float32 and float64
            arrays as float16 (Horovod's ``Compression.fp16``): half the bytes
            on the wire for about three decimal digits of precision. For
            ``"mean"`` each rank divides by the rank count before the cast, so
            the float16 sum cannot overflow where the mean would not. Other
            dtypes go uncompressed; on one rank nothing is cast.

    Returns:
        ``arrays`` itself, each array holding its result.
    """
    state = _state(comm)
    items = list(arrays.values()) if isinstance(arrays, dict) else list(arrays)
    bucket_bytes, signature, problem = _list_checks(items, bucket_bytes, compression)
    who = "allreduce_many_"
    if not items:
        # Still one exchange, so a rank with an empty list meets the others.
        _reduce_flat(state, who, np.empty(0, np.float32), op, algorithm, 0, signature, problem)
        return arrays
    for bucket in plan_buckets(items, bucket_bytes):
        members = [items[i] for i in bucket]
        first = members[0]
        xp = backend.get_array_module(first)
        dtype = np.dtype(first.dtype)
        wire = None
        total = sum(a.size for a in members)
        if _compressed(dtype, compression, state.size):
            wire = state.buffer("wire", total * 2, xp)[: total * 2].view(np.float16)
        if len(members) == 1 and first.flags.c_contiguous:
            _reduce_bucket(state, who, first.reshape(-1), wire, op, algorithm, len(items), signature, problem)
            continue
        fused = state.buffer("fusion", total * dtype.itemsize, xp)[: total * dtype.itemsize].view(dtype)
        pack(members, fused)
        _reduce_bucket(state, who, fused, wire, op, algorithm, len(items), signature, problem)
        unpack(fused, members)
    return arrays


COMPRESSIONS = (None, "fp16")


def _list_checks(items, bucket_bytes, compression):
    """``(bucket_bytes, signature, problem)`` for a list reduction (allreduce_many_ and the Reducer).

    The signature (a hash of every shape and dtype, and the compression) goes
    in the header, so ranks with different lists raise instead of reducing
    mismatched buckets.
    """
    bucket_bytes = DEFAULT_BUCKET_BYTES if bucket_bytes is None else int(bucket_bytes)
    problem = (0, None)
    if bucket_bytes < 1:
        problem = (3, f"bucket_bytes must be at least 1, got {bucket_bytes}")
        bucket_bytes = DEFAULT_BUCKET_BYTES
    if compression not in COMPRESSIONS:
        problem = (7, f"unknown compression {compression!r}; choose None or 'fp16'")
    for a in items:
        if np.dtype(a.dtype) not in _DTYPE_CODE:
            problem = (1, f"unsupported dtype {a.dtype}; use one of {', '.join(str(d) for d in _DTYPES)}")
        elif not _writeable(a):
            problem = (4, "an array in the list is read-only; pass writeable arrays")
    shapes = tuple((a.shape, _DTYPE_CODE.get(np.dtype(a.dtype), 0)) for a in items)
    # Only ints and tuples: str hashes differ between processes (PYTHONHASHSEED).
    code = COMPRESSIONS.index(compression) if compression in COMPRESSIONS else len(COMPRESSIONS)
    signature = hash((shapes, code)) & _SIGNATURE_MASK
    return bucket_bytes, signature, problem


def _compressed(dtype, compression, size):
    """True when a bucket of ``dtype`` travels as float16."""
    return compression == "fp16" and size > 1 and dtype.kind == "f" and dtype.itemsize > 2


def pack(arrays, fused):
    """Copy consecutive ``arrays`` into the 1-D ``fused`` buffer (pure)."""
    offset = 0
    for a in arrays:
        fused[offset: offset + a.size].reshape(a.shape)[...] = a
        offset += a.size


def unpack(fused, arrays):
    """Copy the 1-D ``fused`` buffer back into consecutive ``arrays`` (pure)."""
    offset = 0
    for a in arrays:
        a[...] = fused[offset: offset + a.size].reshape(a.shape)
        offset += a.size


def _reduce_bucket(state, who, flat, wire, op, algorithm, narrays, signature, problem):
    """Reduce one bucket's 1-D ``flat`` in place, through the float16 ``wire`` if given (collective).

    allreduce_many_ and :class:`ringtrain.overlap.Reducer` both reduce every
    bucket here, so they give bitwise the same results.
    """
    if wire is None:
        _reduce_flat(state, who, flat, op, algorithm, narrays, signature, problem)
        return
    xp = backend.get_array_module(flat)
    if op == "mean":
        # Divide first, then cast: a float16 sum of N gradients overflows
        # (above 65504) long before their mean would.
        xp.divide(flat, state.size, out=wire, casting="same_kind")
        op = "sum"
    else:
        wire[...] = flat
    _reduce_flat(state, who, wire, op, algorithm, narrays, signature, problem)
    flat[...] = wire


def broadcast_(x, root=0, comm=None):
    """Overwrite ``x`` on every rank with ``root``'s ``x``, in place.

    Collective: every rank of ``comm`` must call it with an array of the same
    length and dtype and the same ``root``, in the same order as every other
    collective; otherwise every rank raises
    :class:`~ringtrain.errors.MismatchError`. Used for initial parameters and
    resumed optimiser state. Non-contiguous arrays go through a contiguous
    copy that is written back.

    Returns:
        ``x``.
    """
    state = _state(comm)
    dtype = np.dtype(x.dtype)
    try:
        root = operator.index(root)
    except TypeError:
        root = -1
    code, message = 0, None
    if dtype not in _DTYPE_CODE:
        code, message = 1, f"unsupported dtype {dtype}"
    elif not _writeable(x):
        code, message = 4, "the array is read-only"
    elif not 0 <= root < state.size:
        code, message = 6, f"root {root} is outside a communicator of {state.size} rank(s)"
    if state.size == 1:
        if code:
            raise UsageError(f"broadcast_: {message}", everywhere=True)
        return x
    header = (code, 1, _DTYPE_CODE.get(dtype, 0), x.size, _BROADCAST, 0,
              root, 0)
    verdict = state.exchange(header, None, None, None)
    if verdict is not None:
        _raise_mismatch("broadcast_", header, verdict, message)
    if code:
        raise UsageError(f"broadcast_: {message}", everywhere=True)
    MPI = state.MPI
    flat = _flat_view(x)
    target = flat if flat is not None else backend.get_array_module(x).ascontiguousarray(x).reshape(-1)
    gpu = backend.is_gpu_array(target)
    if gpu:
        if state.cuda_aware is None:
            state.cuda_aware = cuda_aware()
        backend.synchronize(target)
    if gpu and not state.cuda_aware:
        host = state.buffer("gpu-host", target.nbytes, backend.get_array_module(target), pinned=True)
        host = host[:target.nbytes].view(dtype)
        target.get(out=host)
        state.comm.Bcast([host, MPI.BYTE], root)
        target.set(host)
        backend.synchronize(target)
    else:
        state.comm.Bcast([target, MPI.BYTE], root)
    if flat is None:
        x[...] = target.reshape(x.shape)
    return x

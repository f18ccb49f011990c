"""Averaging arrays across ranks: allreduce, in place, fused, and broadcast.

Every function here is collective: every rank of ``comm`` must call the same
functions, with arrays of the same length and dtype and the same ``op``, in
the same order. Calls that disagree neither hang nor corrupt: each call
starts with a header exchange that every rank completes whatever the
arguments (:mod:`ringtrain.comm.header`), and if any rank passed something
different (or something it cannot use), every rank raises, naming both
values.

How a call runs (``algorithm="auto"``):

* Small messages (at most :data:`SMALL_BYTES`) are latency-bound. They go by
  recursive doubling (:func:`ringtrain.comm.ring.doubling_schedule`) with the
  header carried in the same message as the data: one round trip at 2 ranks,
  the same as MPI's own ``Allreduce``, and the check costs nothing extra.
  At 2 ranks a NumPy call is replayed from a prepared plan
  (:class:`ringtrain.comm.state.PairPlan`), so Python adds well under a
  microsecond.
  (MPI's ``Allreduce`` cannot carry it: with mismatched counts its behaviour
  is undefined, so checking first would need a second collective, which
  doubles the time of a 4 KiB call.)
* Larger messages send the header alone (a few microseconds). Up to 4 MiB,
  when every rank shares one host, they then run the reduce-scatter and
  allgather through a shared-memory window (:mod:`ringtrain.comm.window`: one copy
  less per byte than any message-passing path, 2-2.5x MPI's ``Allreduce``
  for a 2.6 MiB gradient at 2 ranks); across hosts they call MPI's own
  ``Allreduce`` below :data:`RING_BYTES`. From 4 MiB up they run the
  pipelined ring (:func:`ringtrain.comm.ring.ring_allreduce`).
* ``algorithm="mpi"`` sends the header alone, then calls MPI's ``Allreduce``;
  ``algorithm="ring"`` forces the ring at every size;
  ``algorithm="shm"`` forces shared memory (every rank on one host);
  ``algorithm="hierarchical"`` reduces within each host, rings across hosts
  and broadcasts within each host (:mod:`ringtrain.comm.hierarchical`).

Reductions run in a fixed order, so every rank gets bitwise the same result
and a repeated call gives bitwise the same result.

Buffers (staging for the header exchange, the ring's receive segments, the
fusion buffer, pinned host copies of GPU arrays) belong to the communicator:
they are cached on it with MPI attribute caching (:mod:`ringtrain.comm.state`),
grow to the largest size seen and are reused, so steady-state calls allocate
nothing.

CuPy arrays: the stream is synchronised before MPI touches a buffer. If
mpi4py reports a CUDA-aware MPI (``MPI.Query_cuda_support``), device buffers
go to MPI directly; otherwise they are staged through reused pinned host
buffers and reduced on the host.
"""

import operator

import numpy as np

from .. import backend
from .state import SMALL_BYTES, pair_plan, state_of
from ..errors import UsageError
from .header import (ALGORITHM_CODE, ALGORITHMS, BROADCAST, COMBINE, DTYPE_CODE, DTYPES, OP_CODE, OPS,
                     SIGNATURE_MASK, check_local, raise_mismatch)
from .ring import ring_allreduce
from .window import SINGLE_BLOCK_BYTES, shm_allreduce

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

# SMALL_BYTES (recursive doubling, the data in the header's message) lives in
# ringtrain.comm.state, beside the exchange buffers it sizes.
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




def _reduce_flat(state, who, flat, op, algorithm, narrays=1, signature=0, problem=(0, None)):
    """Reduce the 1-D contiguous ``flat`` in place across ``state.comm`` (collective)."""
    code, message = problem if problem[0] else check_local(flat, op, algorithm)
    if state.size == 1:
        if code:
            raise UsageError(f"{who}: {message}", everywhere=True)
        return flat
    dtype = flat.dtype
    header = (code, narrays, DTYPE_CODE.get(dtype, 0), flat.size, OP_CODE.get(op, 0),
              ALGORITHM_CODE.get(algorithm, 0), 0, signature)
    gpu = backend.is_gpu_array(flat)
    combine = COMBINE.get(op)
    small = code == 0 and algorithm == "auto" and flat.nbytes <= SMALL_BYTES
    # float16 sums overflow easily: divide first (as PyTorch DDP does) for fp16 only;
    # wider floats divide last, which is more accurate.
    predivide = code == 0 and op == "mean" and dtype == np.float16
    if small and not gpu and state.size == 2:
        plan = pair_plan(state, who, flat, op, algorithm, narrays, signature)
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
            raise_mismatch(who, header, verdict, message)
        if op == "mean" and not predivide:
            np.divide(out, state.size, out=out)
        if gpu:
            flat.set(out)
            backend.synchronize(flat)
        return flat
    verdict = state.exchange(header, None, None, None)
    if verdict is not None:
        raise_mismatch(who, header, verdict, message)
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
    wants_shm = algorithm == "shm" or (algorithm == "auto" and flat.nbytes <= SINGLE_BLOCK_BYTES)
    arena = state.arena() if wants_shm and xp is np else None
    if algorithm == "shm" and arena is None:
        raise UsageError("algorithm 'shm' needs every rank on one host; use 'auto', 'ring' or 'hierarchical'",
                         everywhere=True)
    if arena is not None:
        shm_allreduce(arena, flat, COMBINE[op])
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
        reduce(state.comm, flat, getattr(xp, COMBINE[op].__name__), stages, segment)
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
            hosts, then across them: :mod:`ringtrain.comm.hierarchical`).

    Returns:
        ``x``, holding the result, bitwise the same on every rank.

    Raises:
        MismatchError: on every rank, when ranks passed different lengths,
            dtypes, ops or algorithms.
        UsageError: on every rank, when any rank's arguments are unusable.
    """
    state = state_of(comm)
    if state.size == 2 and type(x) is np.ndarray and x.flags.writeable:
        plan = pair_plan(state, "allreduce_", x, op, algorithm)
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
    _reduce_flat(state_of(comm), "allreduce", result.reshape(-1), op, algorithm)
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
    state = state_of(comm)
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
        if np.dtype(a.dtype) not in DTYPE_CODE:
            problem = (1, f"unsupported dtype {a.dtype}; use one of {', '.join(str(d) for d in DTYPES)}")
        elif not _writeable(a):
            problem = (4, "an array in the list is read-only; pass writeable arrays")
    shapes = tuple((a.shape, DTYPE_CODE.get(np.dtype(a.dtype), 0)) for a in items)
    # Only ints and tuples: str hashes differ between processes (PYTHONHASHSEED).
    code = COMPRESSIONS.index(compression) if compression in COMPRESSIONS else len(COMPRESSIONS)
    signature = hash((shapes, code)) & SIGNATURE_MASK
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

    allreduce_many_ and :class:`ringtrain.comm.reducer.Reducer` both reduce every
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
    state = state_of(comm)
    dtype = np.dtype(x.dtype)
    try:
        root = operator.index(root)
    except TypeError:
        root = -1
    code, message = 0, None
    if dtype not in DTYPE_CODE:
        code, message = 1, f"unsupported dtype {dtype}"
    elif not _writeable(x):
        code, message = 4, "the array is read-only"
    elif not 0 <= root < state.size:
        code, message = 6, f"root {root} is outside a communicator of {state.size} rank(s)"
    if state.size == 1:
        if code:
            raise UsageError(f"broadcast_: {message}", everywhere=True)
        return x
    header = (code, 1, DTYPE_CODE.get(dtype, 0), x.size, BROADCAST, 0,
              root, 0)
    verdict = state.exchange(header, None, None, None)
    if verdict is not None:
        raise_mismatch("broadcast_", header, verdict, message)
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

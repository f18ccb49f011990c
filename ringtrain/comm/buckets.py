"""Reducing a list of arrays (a model's gradients): fusion buckets, packed and reduced in order.

:func:`plan_buckets` groups consecutive arrays into buckets of at most
``bucket_bytes`` (pure); :func:`allreduce_many_` reduces each bucket with one
header-checked call (:func:`ringtrain.comm.collectives.reduce_flat`), through
a fusion buffer when its arrays are not already one contiguous run. The
overlapping :class:`~ringtrain.comm.reducer.Reducer` plans and reduces its
buckets with the same functions (:func:`check_list`, :func:`reduce_bucket`),
so the two give bitwise the same results.
"""

import numpy as np

from .. import backend
from .collectives import NO_PROBLEM, is_writeable, reduce_flat
from .guard import collective
from .header import DTYPE_CODE, DTYPES, SIGNATURE_MASK, Problem
from .policy import transport_choice

__all__ = ["allreduce_many_", "plan_buckets", "pack", "unpack", "check_list", "reduce_bucket", "travels_as_fp16",
           "COMPRESSIONS", "DEFAULT_BUCKET_BYTES"]

# Largest fused bucket in allreduce_many_.
DEFAULT_BUCKET_BYTES = 8 << 20
COMPRESSIONS = (None, "fp16")


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


@collective("allreduce_many_")
def allreduce_many_(state, arrays, op="mean", comm=None, bucket_bytes=None, transport="auto", compression=None,
                    algorithm=None):
    """Reduce a list of arrays in place, fused into buckets (a model's gradients).

    Collective: every rank of ``comm`` must call it with a list of the same
    length, shapes and dtypes, in the same order, and the same ``op``,
    ``bucket_bytes``, ``transport`` and ``compression``; otherwise every rank
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
        transport: ``"auto"``, ``"shm"``, ``"ring"``, ``"mpi"`` or ``"hierarchical"``
            (see :func:`ringtrain.comm.collectives.allreduce_`).
        algorithm: the deprecated name of ``transport``.
        compression: ``None``, or ``"fp16"`` to send float32 and float64
            arrays as float16 (Horovod's ``Compression.fp16``): half the bytes
            on the wire for about three decimal digits of precision. For
            ``"mean"`` each rank divides by the rank count before the cast, so
            the float16 sum cannot overflow where the mean would not. Other
            dtypes go uncompressed; on one rank nothing is cast.

    Returns:
        ``arrays`` itself, each array holding its result.
    """
    algorithm = transport_choice(transport, algorithm, "allreduce_many_")
    items = list(arrays.values()) if isinstance(arrays, dict) else list(arrays)
    bucket_bytes, signature, problem = check_list(items, bucket_bytes, compression)
    who = "allreduce_many_"
    if not items:
        # Still one exchange, so a rank with an empty list meets the others.
        reduce_flat(state, who, np.empty(0, np.float32), op, algorithm, 0, signature, problem)
        return arrays
    for bucket in plan_buckets(items, bucket_bytes):
        members = [items[i] for i in bucket]
        first = members[0]
        xp = backend.get_array_module(first)
        dtype = np.dtype(first.dtype)
        wire = None
        total = sum(a.size for a in members)
        if travels_as_fp16(dtype, compression, state.size):
            wire = state.buffer("wire", total * 2, xp)[: total * 2].view(np.float16)
        if len(members) == 1 and first.flags.c_contiguous:
            reduce_bucket(state, who, first.reshape(-1), wire, op, algorithm, len(items), signature, problem)
            continue
        fused = state.buffer("fusion", total * dtype.itemsize, xp)[: total * dtype.itemsize].view(dtype)
        pack(members, fused)
        reduce_bucket(state, who, fused, wire, op, algorithm, len(items), signature, problem)
        unpack(fused, members)
    # On a GPU the last copies out of the fusion (or float16 wire) buffer are
    # still queued on the stream: a caller reading on another stream (torch's
    # side streams, through ringtrain.torch.interop) would see the old values.
    backend.synchronize(next((a for a in items if backend.is_gpu_array(a)), None))
    return arrays


def check_list(items, bucket_bytes, compression):
    """``(bucket_bytes, signature, problem)`` for a list reduction (allreduce_many_ and the Reducer).

    The signature (a hash of every shape and dtype, and the compression) goes
    in the header, so ranks with different lists raise instead of reducing
    mismatched buckets.
    """
    bucket_bytes = DEFAULT_BUCKET_BYTES if bucket_bytes is None else int(bucket_bytes)
    problem = NO_PROBLEM
    if bucket_bytes < 1:
        problem = (Problem.BUCKET_SIZE, f"bucket_bytes must be at least 1, got {bucket_bytes}")
        bucket_bytes = DEFAULT_BUCKET_BYTES
    if compression not in COMPRESSIONS:
        problem = (Problem.COMPRESSION, f"unknown compression {compression!r}; choose None or 'fp16'")
    for a in items:
        if np.dtype(a.dtype) not in DTYPE_CODE:
            problem = (Problem.DTYPE, f"unsupported dtype {a.dtype}; use one of {', '.join(str(d) for d in DTYPES)}")
        elif not is_writeable(a):
            problem = (Problem.READ_ONLY, "an array in the list is read-only; pass writeable arrays")
    shapes = tuple((a.shape, DTYPE_CODE.get(np.dtype(a.dtype), 0)) for a in items)
    # Only ints and tuples: str hashes differ between processes (PYTHONHASHSEED).
    code = COMPRESSIONS.index(compression) if compression in COMPRESSIONS else len(COMPRESSIONS)
    signature = hash((shapes, code)) & SIGNATURE_MASK
    return bucket_bytes, signature, problem


def travels_as_fp16(dtype, compression, size):
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


def reduce_bucket(state, who, flat, wire, op, algorithm, narrays, signature, problem):
    """Reduce one bucket's 1-D ``flat`` in place, through the float16 ``wire`` if given (collective).

    allreduce_many_ and :class:`ringtrain.comm.reducer.Reducer` both reduce every
    bucket here, so they give bitwise the same results.
    """
    if wire is None:
        reduce_flat(state, who, flat, op, algorithm, narrays, signature, problem)
        return
    xp = backend.get_array_module(flat)
    if op == "mean":
        # Divide first, then cast: a float16 sum of N gradients overflows
        # (above 65504) long before their mean would.
        xp.divide(flat, state.size, out=wire, casting="same_kind")
        op = "sum"
    else:
        wire[...] = flat
    reduce_flat(state, who, wire, op, algorithm, narrays, signature, problem)
    flat[...] = wire

"""Averaging arrays across ranks: allreduce, in place, and broadcast.

Every function here is collective: every rank of ``comm`` must call the same
functions, with arrays of the same length and dtype and the same ``op``, in
the same order. Calls that disagree neither hang nor corrupt: each call
starts with a header exchange that every rank completes whatever the
arguments (:mod:`ringtrain.comm.header`), and if any rank passed something
different (or something it cannot use), every rank raises, naming both
values.

How a call runs:

* Small messages (at most :data:`~ringtrain.comm.policy.SMALL_BYTES`, with
  ``transport="auto"``) are latency-bound, and carry their data with the
  header, so the check costs nothing extra. On one host every rank posts
  header and data on the shared-memory board (:mod:`ringtrain.comm.board`)
  and passes one barrier, then adds everyone's data in rank order. Across
  hosts they go by recursive doubling
  (:func:`ringtrain.comm.schedule.doubling_schedule`), the data in the
  header's message. A repeated NumPy call is replayed from a prepared plan
  (:func:`ringtrain.comm.plans.small_plan`), so Python adds little. (MPI's
  ``Allreduce`` cannot carry the header: with mismatched counts its
  behaviour is undefined, so checking first would need a second
  collective, which doubles the time of a 4 KiB call.)
* Larger messages exchange the header alone (the same way), then go to
  the transport the size policy picks (:func:`ringtrain.comm.policy.choose_transport`):
  the shared-memory window on one host, MPI's own collectives, the pipelined
  ring, or the hierarchical allreduce (:mod:`ringtrain.comm.transports`).

Reductions run in a fixed order, so every rank gets bitwise the same result
and a repeated call gives bitwise the same result.

Buffers (staging for the header exchange, pinned host copies of GPU arrays)
belong to the communicator: they are cached on it with MPI attribute caching
(:mod:`ringtrain.comm.state`), grow to the largest size seen and are reused,
so steady-state calls allocate nothing.

CuPy arrays: the stream is synchronised before MPI touches a buffer. With a
CUDA-aware MPI (:func:`ringtrain.comm.cuda_aware.cuda_aware`), device buffers go to MPI directly;
otherwise they are staged through reused pinned host buffers and reduced on
the host.
"""

import operator
from threading import get_ident

import numpy as np

from .. import backend
from ..errors import UsageError
from .guard import collective, guard_of
from .header import (ALGORITHM_CODE, BROADCAST, COMBINE, DTYPE_CODE, OP_CODE, Problem, check_local, code_of,
                     exchange, raise_mismatch)
from .plans import small_plan
from .policy import SMALL_BYTES, transport_choice
from .staging import download, pinned_like, upload

__all__ = ["allreduce", "allreduce_", "broadcast_", "reduce_flat", "is_writeable"]

NO_PROBLEM = (Problem.NONE, None)


def reduce_flat(state, who, flat, op, algorithm, narrays=1, signature=0, problem=NO_PROBLEM, source=None):
    """Reduce the 1-D contiguous ``flat`` in place across ``state.comm`` (collective).

    The one path every reduction takes (the allreduce, each bucket of
    :func:`~ringtrain.comm.buckets.allreduce_many_` and of the
    :class:`~ringtrain.comm.reducer.Reducer`): the header check, then the
    small-message exchange or the transport. ``problem`` is a
    ``(Problem, message)`` the caller already found in its own arguments.
    ``source``: the values to reduce, when they are not ``flat``'s (an array
    like it, left untouched): the bandwidth path on the host reads them
    where they are, the others copy them into ``flat`` first.
    """
    code, message = problem if problem[0] else check_local(flat, op, algorithm)
    gpu = backend.is_gpu_array(flat)
    small = code == 0 and algorithm == "auto" and flat.nbytes <= SMALL_BYTES
    if source is not None and (state.size == 1 or small or gpu or code):
        flat[...] = source
        source = None
    if state.size == 1:
        if code:
            raise UsageError(f"{who}: {message}", everywhere=True)
        return flat
    dtype = flat.dtype
    header = (code, narrays, DTYPE_CODE.get(dtype, 0), flat.size, code_of(OP_CODE, op),
              code_of(ALGORITHM_CODE, algorithm), 0, signature, int(gpu))
    combine = COMBINE.get(op) if code == 0 else None
    # float16 sums overflow easily: divide first (as PyTorch DDP does) for fp16 only;
    # wider floats divide last, which is more accurate.
    predivide = code == 0 and op == "mean" and dtype == np.float16
    if small and not gpu:
        plan = small_plan(state, who, flat, op, algorithm, narrays, signature)
        if plan is not None:
            return plan.run(flat)
    if small:
        payload = state.payload(dtype, flat.size)
        if gpu:
            download(flat, payload)
            out = pinned_like(state, flat, "gpu-result")
        else:
            payload[...] = flat
            out = flat
        if predivide:
            np.divide(payload, state.size, out=payload)
        verdict = exchange(state, header, payload, combine, out)
        if verdict is not None:
            raise_mismatch(who, header, verdict, message)
        if op == "mean" and not predivide:
            np.divide(out, state.size, out=out)
        if gpu:
            upload(out, flat)
        return flat
    verdict = exchange(state, header, None, None, None)
    if verdict is not None:
        raise_mismatch(who, header, verdict, message)
    if code:  # every rank found the same problem
        raise UsageError(f"{who}: {message}", everywhere=True)
    if gpu:
        _reduce_gpu(state, flat, op, algorithm, predivide)
    else:
        _reduce_large(state, flat, op, algorithm, predivide, source=source)
    return flat


def _reduce_large(state, flat, op, algorithm, predivide, transport=None, source=None):
    """The bandwidth path after the header check: the transport the size policy picks (reading ``source``)."""
    xp = backend.get_array_module(flat)
    if predivide:
        xp.divide(flat if source is None else source, state.size, out=flat)
        source = None
    backend.synchronize(flat)
    transport = transport or state.transport_for(algorithm, flat.nbytes, backend.device_of(flat))
    if transport is None:
        raise UsageError("transport 'shm' needs every rank on one host; use 'auto', 'ring' or 'hierarchical'",
                         everywhere=True)
    transport.allreduce(flat, COMBINE[op], source)
    if op == "mean" and not predivide:
        xp.divide(flat, state.size, out=flat)
    # CUDA IPC's allgather copies are still queued when the transport returns:
    # a caller reading on another stream (torch's side streams) or thread
    # would see the old values. Cheap next to the transport's two barriers.
    backend.synchronize(flat)


def _reduce_gpu(state, flat, op, algorithm, predivide):
    """A CuPy array: in place through CUDA IPC or a CUDA-aware MPI, else staged through pinned host memory."""
    transport = state.transport_for(algorithm, flat.nbytes, backend.device_of(flat))
    if transport is not None and (transport.on_device or state.agreed_cuda_aware()):
        _reduce_large(state, flat, op, algorithm, predivide, transport)
        return
    host = download(flat, pinned_like(state, flat))
    _reduce_large(state, host, op, algorithm, predivide)
    upload(host, flat)


def is_writeable(x):
    """False for a read-only NumPy array; CuPy arrays are always writeable."""
    # CuPy arrays have no writeable flag; device memory always is.
    return getattr(x.flags, "writeable", True)


def _flat_view(x):
    """``x`` as a 1-D contiguous view, or None when that would need a copy."""
    if x.flags.c_contiguous:
        return x.reshape(-1)
    return None


def allreduce_(x, op="mean", comm=None, transport="auto", algorithm=None):
    """Reduce ``x`` across the ranks of ``comm``, in place.

    Collective: every rank of ``comm`` must call it, with an array of the same
    length and dtype and the same ``op`` and ``transport``, in the same order
    as every other collective. If they differ, every rank raises
    :class:`~ringtrain.errors.MismatchError` naming both values.

    Args:
        x: a NumPy or CuPy array of float16, float32, float64, int32 or int64,
            any shape and length (0 included). A non-contiguous ``x`` is
            reduced through a contiguous copy that is written back (one extra
            copy); a read-only ``x`` is an error.
        op: ``"sum"``, ``"mean"`` (floating dtypes only), ``"min"`` or ``"max"``.
        comm: communicator (default ``MPI.COMM_WORLD``).
        transport: ``"auto"`` (the size policy,
            :func:`ringtrain.comm.policy.choose_transport`), ``"shm"`` (the
            peer window on one host: shared memory, or CUDA IPC for CuPy
            arrays), ``"ring"``, ``"mpi"`` (MPI's own ``Allreduce`` after the
            check) or ``"hierarchical"`` (within hosts, then across them:
            :mod:`ringtrain.comm.transports.hierarchical`).
        algorithm: the deprecated name of ``transport`` (a DeprecationWarning).

    Returns:
        ``x``, holding the result, bitwise the same on every rank.

    Raises:
        MismatchError: on every rank, when ranks passed different lengths,
            dtypes, ops or transports.
        UsageError: on every rank, when any rank's arguments are unusable.
    """
    # The small-call path: the guard (guard.collective's promises) written
    # inline, since a 4 KiB call costs a few microseconds in all. One lookup
    # gives the guard and the communicator's state.
    if algorithm is not None:
        transport = transport_choice(transport, algorithm, "allreduce_")  # warns, naming the caller's line
    guard = guard_of(comm)
    busy = guard.busy
    if guard.timeout is None and busy.acquire(False):
        guard.holder = (get_ident(), "allreduce_")
        guard.calls += 1
        try:
            return _allreduce_(guard.state, x, op, transport)
        finally:
            guard.holder = None
            busy.release()
    return guard.call("allreduce_", _allreduce_, guard.state, x, op, transport)


def _allreduce_(state, x, op, algorithm):
    """:func:`allreduce_` inside its guard; ``algorithm`` is the transport chosen (the size policy's name)."""
    if state.size > 1 and type(x) is np.ndarray and x.flags.writeable:
        try:  # small_plan's lookup written out: the common call, one function call fewer
            plan = state.plans.get((x.dtype, x.shape, op, algorithm))  # (plans.plan_key)
        except TypeError:  # an unhashable op or transport: small_plan turns it away
            plan = None
        if plan is None:  # not made yet, or none for this call (small_plan says so again quickly)
            plan = small_plan(state, "allreduce_", x, op, algorithm)
        if plan is not None:
            return plan.run(x)
    flat = _flat_view(x)
    problem = NO_PROBLEM
    if not is_writeable(x):
        problem = (Problem.READ_ONLY, "the array is read-only; pass a writeable array or use allreduce()")
    if flat is None:
        flat = backend.get_array_module(x).ascontiguousarray(x).reshape(-1)
        reduce_flat(state, "allreduce_", flat, op, algorithm, problem=problem)
        x[...] = flat.reshape(x.shape)
        return x
    reduce_flat(state, "allreduce_", flat, op, algorithm, problem=problem)
    return x


@collective("allreduce")
def allreduce(state, x, op="mean", comm=None, transport="auto", algorithm=None):
    """Reduce ``x`` across the ranks of ``comm`` into a new array.

    Collective, with the same contract as :func:`allreduce_`. ``x`` is left
    untouched; the result has its array module (NumPy or CuPy), dtype and
    shape and is C-contiguous.
    """
    algorithm = transport_choice(transport, algorithm, "allreduce")
    xp = backend.get_array_module(x)
    source = xp.asarray(x, order="C")
    result = xp.empty_like(source)
    reduce_flat(state, "allreduce", result.reshape(-1), op, algorithm, source=source.reshape(-1))
    return result


def reduce_into(out, x, op="mean", comm=None, transport="auto"):
    """Reduce ``x`` across the ranks of ``comm`` into ``out``, leaving ``x`` untouched; both 1-D and alike.

    Collective, with :func:`allreduce_`'s contract for ``out``. For a caller
    whose output already exists and whose arrays every rank agreed on (the
    engine's allreduce into a new tensor): ``x`` is not checked against
    ``out`` here. A large ``x`` apart from ``out`` is read where it is, not
    copied in first; a small one (its data rides with the header, copied in
    either way) or one that overlaps ``out`` is copied into ``out`` and
    reduced in place. The choice is this rank's alone, so every transport
    must run the same exchange either way.
    """
    xp = backend.get_array_module(out)
    if out.nbytes <= SMALL_BYTES or xp.may_share_memory(out, x):
        xp.copyto(out, x)
        return allreduce_(out, op, comm, transport=transport)
    guard = guard_of(comm)
    return guard.call("allreduce_", reduce_flat, guard.state, "allreduce_", out, op, transport, source=x)


@collective("broadcast_")
def broadcast_(state, x, root=0, comm=None):
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
    dtype = np.dtype(x.dtype)
    try:
        root = operator.index(root)
    except TypeError:
        root = -1
    code, message = NO_PROBLEM
    if dtype not in DTYPE_CODE:
        code, message = Problem.DTYPE, f"unsupported dtype {dtype}"
    elif not is_writeable(x):
        code, message = Problem.READ_ONLY, "the array is read-only"
    elif not 0 <= root < state.size:
        code, message = Problem.ROOT, f"root {root} is outside a communicator of {state.size} rank(s)"
    if state.size == 1:
        if code:
            raise UsageError(f"broadcast_: {message}", everywhere=True)
        return x
    # An out-of-range root goes as -1: it must fit the header's int64 field.
    header = (code, 1, DTYPE_CODE.get(dtype, 0), x.size, BROADCAST, 0, root if 0 <= root < state.size else -1, 0,
              int(backend.is_gpu_array(x)))
    verdict = exchange(state, header, None, None, None)
    if verdict is not None:
        raise_mismatch("broadcast_", header, verdict, message)
    if code:
        raise UsageError(f"broadcast_: {message}", everywhere=True)
    MPI = state.MPI
    flat = _flat_view(x)
    target = flat if flat is not None else backend.get_array_module(x).ascontiguousarray(x).reshape(-1)
    gpu = backend.is_gpu_array(target)
    if gpu:
        backend.synchronize(target)
    if gpu and not state.agreed_cuda_aware():
        host = pinned_like(state, target)
        if state.rank == root:  # the others' values are overwritten: no copy off the device for them
            download(target, host)
        state.comm.Bcast([host, MPI.BYTE], root)
        upload(host, target)
    else:
        state.comm.Bcast([target, MPI.BYTE], root)
    if flat is None:
        x[...] = target.reshape(x.shape)
    return x

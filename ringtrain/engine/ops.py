"""Submitting ops over arrays: the collectives every face calls, ``join``, ``barrier``, handles and the timeline.

Each function checks its arguments on this rank, describes the op for the
other members (its record, :mod:`ringtrain.engine.negotiation`: what they
must agree on; ``info``: what may differ), submits it to the engine (:mod:`ringtrain.engine.core`, whose
docstring is the contract: which calls are collective, in what order,
what fails how) and returns a handle; :func:`synchronize` returns its
output. An argument this rank refuses raises ``ValueError`` here, and the
process set's other members get the error too instead of waiting for an
op that never comes.

Arrays are NumPy (host) or CuPy (GPU) arrays; ``out`` names an array to
write the result into (the input itself for an in-place op). A face that
keeps its own tensors passes views of their memory and a ``finish``
function, which :func:`synchronize` applies to the result on the caller's
thread (to hand back the face's tensor, for example). ``dtype="bfloat16"``
says a 16-bit integer array holds bfloat16 bits (NumPy has no bfloat16).
"""

import contextlib
import pickle
from threading import current_thread

import numpy as np

from ..comm import allreduce_, broadcast_
from ..errors import MismatchError, UsageError
from . import arrays, handles, runtime
from .errors import CollectiveMismatchError
from .handles import Entry
from .handles import poll, synchronize
from .negotiation import (JOIN, Allgather, Allreduce, Alltoall, Barrier, Broadcast, Grouped, Join, Reducescatter,
                          op_key, thread_label)
from .process_sets import communicator_of, global_process_set, set_rank
from .reduce_ops import Average, op_name
# Horovod's timeline calls live beside init (which starts one for HOROVOD_TIMELINE) and shutdown (which writes it).
from .runtime import start_timeline, stop_timeline

__all__ = ["allreduce", "allreduce_async", "grouped_allreduce_async", "allgather_async", "grouped_allgather_async",
           "broadcast_async", "alltoall_async", "reducescatter_async", "grouped_reducescatter_async", "barrier",
           "join", "poll", "synchronize", "refused", "alltoall_splits", "start_timeline", "stop_timeline",
           "broadcast_object", "allgather_object"]

# An allreduce or broadcast up to RINGTRAIN_HVD_LOCAL_BYTES of CPU data travels with its announcements and is
# computed on every rank.
_LOCAL = (Allreduce, Broadcast)


def _set_id(process_set, who):
    """The process set's id, checked: registered, and this rank in it."""
    ps = global_process_set if process_set is None else process_set
    set_id = ps.process_set_id
    if set_id is None:
        raise ValueError(f"{who}: the process set is not registered; call add_process_set() first")
    if set_id != 0 and runtime.rank() not in ps.ranks:
        raise ValueError(f"{who}: this rank ({runtime.rank()}) is not in {ps}")
    return set_id


def refused(kind, problem, name=None, process_set=global_process_set):
    """Tell the set's members this rank refuses an op on its own arguments; return the ``ValueError`` to raise.

    A face calls it for an argument it refuses before anything reaches the
    engine (a tensor type no op takes), so the set's other members fail the
    op too instead of waiting for it.
    """
    engine = runtime.current().engine
    set_id = _set_id(process_set, kind)
    engine.refuse(kind, problem, set_id, None if name is None else str(name))
    if name is not None and problem.startswith(kind + ":"):  # (the members' error names it: so does this one)
        problem = f"{kind} {str(name)!r}{problem[len(kind):]}"
    return ValueError(problem)


def submit(kind, name, process_set, describe, finish=None, exact=False):
    """Submit one op; return its handle.

    ``describe()`` returns ``(record, info, args)``, or raises ValueError for
    an argument this rank refuses: the set's members are then told, so they
    fail the op too. ``name`` is the user's (None: ``noname.<n>``); the op is
    matched by ``"<kind>.<name>"`` unless ``exact``.
    """
    engine = runtime.current().engine
    set_id = _set_id(process_set, kind)
    if name is None:
        name = engine.names.next(set_id, kind, thread_label(current_thread()))
    else:
        name = str(name)
    try:
        record, info, args = describe()
    except ValueError as exc:
        engine.refuse(kind, str(exc), set_id, name)
        raise ValueError(str(exc)) from None
    key = name if exact else op_key(kind, name)
    local = False
    if args:
        first = args[0]
        if not isinstance(first, (list, tuple)) and arrays.is_cuda(first):
            arrays.synchronize(first)  # another thread (the channel's) may read the array next
        elif type(record) in _LOCAL and getattr(record, "op", None) != "adasum":
            local = 0 < first.nbytes <= engine.settings.local_bytes
    pending = engine.submit(set_id, Entry(key, (name, set_id), kind, record, info, args, handles.Pending(finish),
                                          local))
    return handles.register(pending)


def _checked(array, who, dtype):
    problem = arrays.check_array(array, who, dtype)
    if problem is not None:
        raise ValueError(problem)
    return arrays.element_name(array, dtype)


def _out(array, out, who):
    """The array a result is written into: ``out`` (checked against ``array``), or a new one."""
    if out is None:
        xp = arrays.xp_of(array)
        return xp.empty(array.shape, array.dtype)
    if out is array:
        return out
    if getattr(out, "shape", None) != array.shape or getattr(out, "dtype", None) != array.dtype \
            or arrays.is_cuda(out) != arrays.is_cuda(array):
        raise ValueError(f"{who}: out must be an array of the input's shape, dtype and device "
                         f"({array.shape}, {array.dtype}), got {getattr(out, 'shape', None)}, "
                         f"{getattr(out, 'dtype', type(out).__name__)}")
    return out


_RECORDS = {}  # what a reduction is announced with, one record per distinct op (cheap to build, compare and send)
_REDUCTIONS = {"allreduce": Allreduce, "reducescatter": Reducescatter}


def _device(array):
    return "cuda" if arrays.is_cuda(array) else "cpu"


def _reduction(kind, array, dtype, op, prescale_factor, postscale_factor):
    name = _checked(array, kind, dtype)
    key = (kind, name, array.shape, op, prescale_factor, postscale_factor, arrays.is_cuda(array))
    record = _RECORDS.get(key)
    if record is None:
        record = _REDUCTIONS[kind](name, tuple(array.shape), op_name(op), float(prescale_factor),
                                   float(postscale_factor), _device(array))
        if len(_RECORDS) > 4096:  # a program of ever-new shapes must not grow this without bound
            _RECORDS.clear()
            _HOST_RECORDS.clear()
        _RECORDS[key] = record
    return record


def _each(values, n, what):
    """``values`` as a list of ``n`` (one value, or None, repeated)."""
    if values is None or isinstance(values, str):
        return [values] * n
    values = list(values)
    if len(values) != n:
        raise ValueError(f"{what}: expected {n} values, one per array, got {len(values)}")
    return values


def _group(kind, describe_one, items):
    """``describe()`` of a grouped op: one entry, its parts each described as a single op would be."""
    def describe():
        if not items:
            raise ValueError(f"grouped_{kind}: the list of arrays is empty")
        records, infos, args = zip(*(describe_one(*item) for item in items))
        return Grouped(kind, records), infos if any(i is not None for i in infos) else None, list(args)
    return describe


def _allreduce_one(op, prescale_factor, postscale_factor):
    def describe(array, out, dtype):
        record = _reduction("allreduce", array, dtype, op, prescale_factor, postscale_factor)
        return record, None, (array, _out(array, out, "allreduce"))
    return describe


def allreduce_async(array, name=None, op=Average, prescale_factor=1.0, postscale_factor=1.0,
                    process_set=global_process_set, out=None, dtype=None, finish=None):
    """Start reducing ``array`` across the set's ranks into ``out`` (default: a new array); return a handle.

    ``out=array`` reduces in place. ``synchronize`` returns ``out`` (or ``finish(out)``).
    """
    record = _host_record(array, out, dtype, process_set, op, prescale_factor, postscale_factor)
    if record is not None:
        engine = runtime.current().engine
        return handles.register(engine.submit(0, _host_entry(engine, record, name, array, out, finish)))
    one = _allreduce_one(op, prescale_factor, postscale_factor)
    return submit("allreduce", name, process_set, lambda: one(array, out, dtype), finish)


def allreduce(array, name=None, op=Average, prescale_factor=1.0, postscale_factor=1.0,
              process_set=global_process_set, out=None, dtype=None, finish=None):
    """Reduce ``array`` as :func:`allreduce_async` does and wait: ``synchronize``'s result, on this thread.

    The blocking form every face's blocking allreduce calls: a small op on
    an idle set runs alone on the caller's thread without a handle or a
    queue (:meth:`Channel.run_now <ringtrain.engine.channel.Channel.run_now>`),
    announced, matched, bounded and failed as every other op.
    """
    record = _host_record(array, out, dtype, process_set, op, prescale_factor, postscale_factor)
    if record is None:
        return synchronize(allreduce_async(array, name, op, prescale_factor, postscale_factor, process_set, out,
                                           dtype, finish))
    engine = runtime.current().engine
    return handles.outcome(engine.run_now(0, _host_entry(engine, record, name, array, out, finish)))


def _host_record(array, out, dtype, process_set, op, prescale_factor, postscale_factor):
    """The record of the common op, repeated step after step, if this process has built it before; else None.

    The common op: a host allreduce of the global set into ``array`` itself,
    an array like it, or a new one, whose record an array like this one got after
    passing every check. Only the building is skipped: the op is announced,
    matched, bounded and failed as every other.
    """
    if type(array) is not np.ndarray or dtype is not None or process_set is not global_process_set or not (
            out is array or out is None
            or type(out) is np.ndarray and out.shape == array.shape and out.dtype == array.dtype):
        return None
    key = (array.dtype, array.shape, op, prescale_factor, postscale_factor)
    record = _HOST_RECORDS.get(key)
    if record is None and array.dtype.isnative:  # (">i8" is named "int64" too, but is refused: checked each time)
        record = _RECORDS.get(("allreduce", array.dtype.name, *key[1:], False))
        if record is not None:
            _HOST_RECORDS[key] = record
    return record


_HOST_RECORDS = {}  # _RECORDS' host allreduces by the array's dtype itself (its name is slow to read)


def _host_entry(engine, record, name, array, out, finish):
    """The :class:`Entry` of a checked host allreduce of the global set whose record is built: :func:`submit`'s tail."""
    args = (array, np.empty(array.shape, array.dtype) if out is None else out)
    if name is None:
        name = engine.names.next(0, "allreduce", thread_label(current_thread()))
    else:
        name = str(name)
    local = 0 < args[0].nbytes <= engine.settings.local_bytes and record.op != "adasum"
    return Entry("allreduce." + name, (name, 0), "allreduce", record, None, args, handles.Pending(finish), local)


def grouped_allreduce_async(arrays_, name=None, op=Average, prescale_factor=1.0, postscale_factor=1.0,
                            process_set=global_process_set, out=None, dtype=None, finish=None):
    """Start reducing each array (fused where they fit); ``synchronize`` returns the list of results.

    ``out`` is None (new arrays) or a list with an output (or None) per array; ``dtype`` one name or a list.
    """
    items = list(arrays_)
    one = _allreduce_one(op, prescale_factor, postscale_factor)

    def describe():
        outs, dtypes = _each(out, len(items), "grouped_allreduce out"), _each(dtype, len(items), "dtype")
        return _group("allreduce", one, list(zip(items, outs, dtypes)))()
    return submit("allreduce", name, process_set, describe, finish)


def _allgather_one(array, dtype):
    record = Allgather(_checked(array, "allgather", dtype), tuple(array.shape[1:]), _device(array))
    return record, array.shape[0] if array.ndim else 1, (array,)


def allgather_async(array, name=None, process_set=global_process_set, dtype=None, finish=None):
    """Start concatenating every rank's ``array`` on the first dimension (which may differ); return a handle."""
    return submit("allgather", name, process_set, lambda: _allgather_one(array, dtype), finish)


def grouped_allgather_async(arrays_, name=None, process_set=global_process_set, dtype=None, finish=None):
    """Start an allgather of each array; ``synchronize`` returns the list of results."""
    items = list(arrays_)

    def describe():
        return _group("allgather", _allgather_one, list(zip(items, _each(dtype, len(items), "dtype"))))()
    return submit("allgather", name, process_set, describe, finish)


def _root_in_set(root_rank, process_set, who):
    """``root_rank`` (a rank of the runtime, as Horovod's API takes it) as a rank of the set's communicator."""
    try:
        root = int(root_rank)
    except (TypeError, ValueError):
        raise ValueError(f"{who}: root_rank must be an int, got {root_rank!r}") from None
    ranks = list((global_process_set if process_set is None else process_set).ranks)
    if root not in ranks:
        raise ValueError(f"{who}: root_rank {root} is not in the process set (ranks {ranks})")
    return ranks.index(root)


def broadcast_async(array, root_rank, name=None, process_set=global_process_set, out=None, dtype=None,
                    finish=None):
    """Start copying ``root_rank``'s ``array`` to every rank of the set into ``out`` (``out=array``: in place)."""
    def describe():
        element = _checked(array, "broadcast", dtype)
        root = _root_in_set(root_rank, process_set, "broadcast")
        record = Broadcast(element, tuple(array.shape), root, _device(array))
        return record, None, (array, _out(array, out, "broadcast"))
    return submit("broadcast", name, process_set, describe, finish)


def alltoall_splits(rows, splits, nranks):
    """The rows sent to each rank, as a list of ints; ValueError naming the problem (pure).

    Args:
        rows: the first dimension of the array sent (0 for a 0-dim array).
        splits: None (equal parts), a sequence of ints, or an int32 array.
        nranks: the number of ranks in the process set.
    """
    if splits is None:
        if rows % nranks:
            raise ValueError(f"alltoall: the first dimension ({rows}) is not a multiple of the number of ranks "
                             f"({nranks}); pass splits")
        return [rows // nranks] * nranks
    if hasattr(splits, "dtype"):
        if str(splits.dtype) != "int32":
            raise ValueError(f"alltoall: splits must be an int32 array, got {splits.dtype}")
        splits = splits.tolist()
    splits = [int(s) for s in splits]
    if len(splits) != nranks or any(s < 0 for s in splits):
        raise ValueError(f"alltoall: splits must hold {nranks} counts of at least 0, got {splits}")
    if sum(splits) > rows:
        raise ValueError(f"alltoall: the splits add up to {sum(splits)}, more than the first dimension ({rows})")
    return splits


def alltoall_async(array, splits=None, name=None, process_set=global_process_set, dtype=None, finish=None):
    """Start sending ``splits[r]`` rows to each rank ``r``; ``synchronize`` gives (output, received splits)."""
    def describe():
        element = _checked(array, "alltoall", dtype)
        ps = global_process_set if process_set is None else process_set
        sent = alltoall_splits(array.shape[0] if array.ndim else 0, splits, len(ps.ranks))
        return Alltoall(element, tuple(array.shape[1:]), _device(array)), sent, (array,)
    return submit("alltoall", name, process_set, describe, finish)


def _reducescatter_one(op, prescale_factor, postscale_factor):
    def describe(array, dtype):
        record = _reduction("reducescatter", array, dtype, op, prescale_factor, postscale_factor)
        if array.ndim == 0:
            raise ValueError("reducescatter: a 0-dim tensor has no rows to scatter; reshape it to (1,) or more")
        return record, None, (array,)
    return describe


def reducescatter_async(array, name=None, op=Average, process_set=global_process_set, prescale_factor=1.0,
                        postscale_factor=1.0, dtype=None, finish=None):
    """Start reducing ``array`` and giving each rank its block of rows (the first ranks one more); return a handle."""
    one = _reducescatter_one(op, prescale_factor, postscale_factor)
    return submit("reducescatter", name, process_set, lambda: one(array, dtype), finish)


def grouped_reducescatter_async(arrays_, name=None, op=Average, process_set=global_process_set,
                                prescale_factor=1.0, postscale_factor=1.0, dtype=None, finish=None):
    """Start a reducescatter of each array; ``synchronize`` returns the list of results."""
    items = list(arrays_)
    one = _reducescatter_one(op, prescale_factor, postscale_factor)

    def describe():
        return _group("reducescatter", one, list(zip(items, _each(dtype, len(items), "dtype"))))()
    return submit("reducescatter", name, process_set, describe, finish)


def join():
    """Declare this rank done: until every rank has joined, it adds zeros to the others' allreduces.

    Collective over every rank: blocks until every rank has called it, and
    returns the rank that joined last, the same on every rank. While a rank
    is joined, ops other than allreduce fail on the ranks that submit them.
    """
    return synchronize(submit("join", JOIN, None, lambda: (_JOIN, None, ()), exact=True))


def barrier(process_set=global_process_set):
    """Wait until every rank of the process set has reached the barrier (collective over the set)."""
    synchronize(submit("barrier", None, process_set, lambda: (_BARRIER, None, ())))


_JOIN, _BARRIER = Join(), Barrier()


# Objects: pickled, their bytes moved by the library's header-checked collectives on the set's communicator
# (ranks that disagree on the root or the call raise on every rank), watched as the engine watches helpers.

def broadcast_object(obj, root_rank=0, process_set=global_process_set):
    """``root_rank``'s ``obj`` on every member of the set, pickled (collective over the set).

    ``root_rank`` is a rank of the whole job, as in Horovod (ValueError on every member for one outside the
    set); ranks that name different roots raise :class:`CollectiveMismatchError` on every member.
    """
    with runtime.helper("broadcast_object"), _as_mismatch("broadcast_object"):
        comm = communicator_of(process_set)
        root = set_rank(process_set, root_rank)
        mine = comm.Get_rank() == root
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if mine else b""
        length = np.array([len(data)], np.int64)
        broadcast_(length, root=root, comm=comm)
        words = np.zeros(-(-int(length[0]) // 8), np.int64)
        if mine:
            words.view(np.uint8)[: len(data)] = np.frombuffer(data, np.uint8)
        broadcast_(words, root=root, comm=comm)
    return obj if mine else pickle.loads(words.view(np.uint8)[: int(length[0])].tobytes())


def allgather_object(obj, process_set=global_process_set):
    """Every member's ``obj``, in the set's rank order, pickled (collective over the set)."""
    with runtime.helper("allgather_object"), _as_mismatch("allgather_object"):
        comm = communicator_of(process_set)
        rank, size = comm.Get_rank(), comm.Get_size()
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        lengths = np.zeros(size, np.int64)
        lengths[rank] = len(data)
        allreduce_(lengths, op="sum", comm=comm)
        # Each rank's bytes in its own 8-byte-aligned slot, zeros elsewhere: a sum of the slots is an exact
        # gather, through the same header-checked allreduce as everything else.
        slots = -(-lengths // 8)
        starts = np.concatenate([[0], np.cumsum(slots)])
        words = np.zeros(int(starts[-1]), np.int64)
        words[starts[rank]: starts[rank + 1]].view(np.uint8)[: len(data)] = np.frombuffer(data, np.uint8)
        allreduce_(words, op="sum", comm=comm)
    return [pickle.loads(words[starts[r]: starts[r + 1]].view(np.uint8)[: int(lengths[r])].tobytes())
            for r in range(size)]


@contextlib.contextmanager
def _as_mismatch(label):
    """The library's errors as the engine's: ranks that disagreed (MismatchError) raise the engine's
    :class:`CollectiveMismatchError`, a value every rank refused a ValueError, as the faces' callers expect."""
    try:
        yield
    except MismatchError as exc:
        raise CollectiveMismatchError(f"{label}: {exc}") from None
    except UsageError as exc:
        raise ValueError(f"{label}: {exc}") from None

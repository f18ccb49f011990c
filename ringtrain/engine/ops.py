"""Submitting ops over arrays: the collectives every face calls, ``join``, ``barrier``, handles and the timeline.

Each function checks its arguments on this rank, describes the op for the
other members (``meta``: what they must agree on; ``info``: what may
differ), submits it to the engine (:mod:`ringtrain.engine.core`, whose
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

from . import arrays, handles, runtime
from .channel import Entry
from .handles import poll, synchronize
from .negotiation import JOIN, op_key
from .process_sets import global_process_set
from .reduce_ops import Average, op_name

__all__ = ["allreduce_async", "grouped_allreduce_async", "allgather_async", "grouped_allgather_async",
           "broadcast_async", "alltoall_async", "reducescatter_async", "grouped_reducescatter_async", "barrier",
           "join", "poll", "synchronize", "refused", "alltoall_splits", "start_timeline", "stop_timeline"]

# An allreduce or broadcast of these kinds up to RINGTRAIN_HVD_LOCAL_BYTES travels with its announcements
# and is computed on every rank.
LOCAL_KINDS = ("allreduce", "broadcast")  # the kinds whose small CPU ops go with their announcements


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
    return ValueError(problem)


def submit(kind, name, process_set, describe, finish=None, exact=False):
    """Submit one op; return its handle.

    ``describe()`` returns ``(meta, info, args)``, or raises ValueError for
    an argument this rank refuses: the set's members are then told, so they
    fail the op too. ``name`` is the user's (None: ``noname.<n>``); the op is
    matched by ``"<kind>.<name>"`` unless ``exact``.
    """
    engine = runtime.current().engine
    set_id = _set_id(process_set, kind)
    name = engine.names.next(set_id, kind) if name is None else str(name)
    try:
        meta, info, args = describe()
    except ValueError as exc:
        engine.refuse(kind, str(exc), set_id, name)
        raise ValueError(str(exc)) from None
    key = name if exact else op_key(kind, name)
    local = False
    if args:
        first = args[0]
        if not isinstance(first, (list, tuple)) and arrays.is_cuda(first):
            arrays.synchronize(first)  # another thread (the channel's) may read the array next
        elif kind in LOCAL_KINDS and len(meta) > 3 and meta[3][1] != "adasum":  # (a grouped meta has 2 fields)
            local = 0 < first.nbytes <= engine.settings.local_bytes
    pending = engine.submit(set_id, Entry(key, (name, set_id), kind, meta, info, args, handles.Pending(finish),
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


_METAS = {}  # what a reduction is announced with, one tuple per distinct op (cheap to build, compare and send)


def _reduce_meta(kind, array, dtype, op, prescale_factor, postscale_factor):
    name = _checked(array, kind, dtype)
    cuda = arrays.is_cuda(array)
    key = (kind, name, array.shape, op, prescale_factor, postscale_factor, cuda)
    meta = _METAS.get(key)
    if meta is None:
        meta = (("kind", kind), ("dtype", name), ("shape", tuple(array.shape)), ("op", op_name(op)),
                ("prescale", float(prescale_factor)), ("postscale", float(postscale_factor)),
                ("device", "cuda" if cuda else "cpu"))
        if len(_METAS) > 4096:  # a program of ever-new shapes must not grow this without bound
            _METAS.clear()
        _METAS[key] = meta
    return meta


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
        parts = [describe_one(*item) for item in items]
        infos = tuple(p[1] for p in parts)
        return ((("kind", kind), ("parts", tuple(p[0] for p in parts))), infos if any(i is not None for i in infos)
                else None, [p[2] for p in parts])
    return describe


def _allreduce_one(op, prescale_factor, postscale_factor):
    def describe(array, out, dtype):
        meta = _reduce_meta("allreduce", array, dtype, op, prescale_factor, postscale_factor)
        return meta, None, (array, _out(array, out, "allreduce"))
    return describe


def allreduce_async(array, name=None, op=Average, prescale_factor=1.0, postscale_factor=1.0,
                    process_set=global_process_set, out=None, dtype=None, finish=None):
    """Start reducing ``array`` across the set's ranks into ``out`` (default: a new array); return a handle.

    ``out=array`` reduces in place. ``synchronize`` returns ``out`` (or ``finish(out)``).
    """
    one = _allreduce_one(op, prescale_factor, postscale_factor)
    return submit("allreduce", name, process_set, lambda: one(array, out, dtype), finish)


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
    name = _checked(array, "allgather", dtype)
    meta = (("kind", "allgather"), ("dtype", name), ("trailing shape", tuple(array.shape[1:])),
            ("device", "cuda" if arrays.is_cuda(array) else "cpu"))
    return meta, array.shape[0] if array.ndim else 1, (array,)


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
        meta = (("kind", "broadcast"), ("dtype", element), ("shape", tuple(array.shape)), ("root", root),
                ("device", "cuda" if arrays.is_cuda(array) else "cpu"))
        return meta, None, (array, _out(array, out, "broadcast"))
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
        meta = (("kind", "alltoall"), ("dtype", element), ("trailing shape", tuple(array.shape[1:])),
                ("device", "cuda" if arrays.is_cuda(array) else "cpu"))
        return meta, sent, (array,)
    return submit("alltoall", name, process_set, describe, finish)


def _reducescatter_one(op, prescale_factor, postscale_factor):
    def describe(array, dtype):
        meta = _reduce_meta("reducescatter", array, dtype, op, prescale_factor, postscale_factor)
        if array.ndim == 0:
            raise ValueError("reducescatter: a 0-dim tensor has no rows to scatter; reshape it to (1,) or more")
        return meta, None, (array,)
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
    return synchronize(submit("join", JOIN, None, lambda: ((("kind", "join"),), None, ()), exact=True))


def barrier(process_set=global_process_set):
    """Wait until every rank of the process set has reached the barrier (collective over the set)."""
    synchronize(submit("barrier", None, process_set, lambda: ((("kind", "barrier"),), None, ())))


def start_timeline(file_path, mark_cycles=False):
    """Start recording every op this rank runs; ``stop_timeline`` writes them to ``file_path`` (collective)."""
    from ..training.timeline import Timeline

    engine = runtime.current().engine
    engine.timeline = Timeline(runtime.rank())
    engine.timeline_path = str(file_path)


def stop_timeline():
    """Stop recording; rank 0 writes every rank's ops to the path given to ``start_timeline`` (collective)."""
    from ..training.timeline import Timeline

    engine = runtime.current().engine
    timeline, path = engine.timeline, engine.timeline_path
    engine.timeline = None
    events = timeline.events if timeline is not None else []

    def gather(comm):
        everyone = comm.gather(events, root=0)
        if comm.Get_rank() == 0 and path:
            Timeline.write(path, everyone)
        return True

    engine.call("stop_timeline", gather)

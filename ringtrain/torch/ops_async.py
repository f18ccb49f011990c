"""Submitting ops: the ``*_async`` collectives of Horovod's API, ``join``, ``barrier`` and the timeline.

Each function checks its arguments on this rank, describes the op for the
other members (``meta``: what they must agree on; ``info``: what may
differ) and submits it to the engine (:mod:`ringtrain.torch.engine`, whose
docstring is the contract: which calls are collective, in what order,
what fails how); ``synchronize(handle)`` returns its output. An argument
this rank refuses raises ``ValueError`` here, and the process set's other
members get the error too instead of waiting for an op that never comes.
"""

import warnings

import torch

from . import handles, runtime
from .channel import Entry
from .kernels import LOCAL_BYTES, check_tensor, dtype_name
from .negotiation import JOIN, op_key
from .process_sets import global_process_set
from .reduce_ops import Average, Sum, op_name
# Horovod's timeline calls, kept beside init (which starts one for HOROVOD_TIMELINE) and shutdown (which ends it).
from .runtime import start_timeline, stop_timeline

__all__ = ["allreduce_async", "allreduce_async_", "grouped_allreduce_async", "grouped_allreduce_async_",
           "allgather_async", "grouped_allgather_async", "broadcast_async", "broadcast_async_", "alltoall_async",
           "reducescatter_async", "grouped_reducescatter_async", "barrier", "join", "resolve_op", "submit",
           "alltoall_splits", "start_timeline", "stop_timeline"]


def resolve_op(op, average):
    """The op constant from Horovod's ``op`` and deprecated ``average`` arguments (pure but for a warning)."""
    if op is not None and average is not None:
        raise ValueError("the op parameter supersedes average; pass one of them, not both")
    if average is not None:
        warnings.warn("average is deprecated; use op=hvd.Average or op=hvd.Sum", DeprecationWarning, stacklevel=3)
        return Average if average else Sum
    return Average if op is None else op


def _set_id(process_set, who):
    """The process set's id, checked: registered, and this rank in it."""
    ps = global_process_set if process_set is None else process_set
    set_id = ps.process_set_id
    if set_id is None:
        raise ValueError(f"{who}: the process set is not registered; call hvd.add_process_set() first")
    if set_id != 0 and runtime.rank() not in ps.ranks:
        raise ValueError(f"{who}: this rank ({runtime.rank()}) is not in {ps}")
    return set_id


def submit(kind, name, process_set, describe, *arguments, exact=False):
    """Submit one op; return its :class:`~ringtrain.torch.handles.Pending`.

    ``describe(*arguments)`` returns ``(meta, info, args)``, or raises
    ValueError for an argument this rank refuses: the set's members are then
    told, so they fail the op too. ``name`` is the user's (None:
    ``noname.<n>``); the op is matched by ``"<kind>.<name>"`` unless ``exact``.
    """
    engine = runtime.current().engine
    set_id = _set_id(process_set, kind)
    name = engine.names.next(set_id, kind) if name is None else str(name)
    try:
        meta, info, args = describe(*arguments)
    except ValueError as exc:
        engine.refuse(kind, str(exc), set_id, name)
        raise ValueError(str(exc)) from None
    key = name if exact else op_key(kind, name)
    local = False
    if args:
        first = args[0]
        if _any_cuda(first, args):
            torch.cuda.current_stream().synchronize()  # another thread may read the tensors next
        elif kind in LOCAL_KINDS and len(meta) > 3 and meta[3][1] != "adasum":  # (a grouped meta has 2 fields)
            local = 0 < first.numel() * first.element_size() <= LOCAL_BYTES
    return engine.submit(set_id, Entry(key, (name, set_id), kind, meta, info, args, handles.Pending(), local))


LOCAL_KINDS = ("allreduce", "broadcast")  # the kinds whose small CPU ops go with their announcements


def _any_cuda(first, args):
    if isinstance(first, torch.Tensor):
        return first.is_cuda  # a single op's input and output are on one device (checked by its kind)
    return any(isinstance(t, torch.Tensor) and t.is_cuda for t in _tensors(args))


def _tensors(args):
    for a in args:
        if isinstance(a, (list, tuple)):
            yield from _tensors(a)
        else:
            yield a


def _checked(tensor, who):
    problem = check_tensor(tensor, who)
    if problem is not None:
        raise ValueError(problem)
    return tensor


_METAS = {}  # what a reduction is announced with, one tuple per distinct op (cheap to build, compare and send)


def _reduce_meta(kind, tensor, op, prescale_factor, postscale_factor):
    problem = check_tensor(tensor, kind)
    if problem is not None:
        raise ValueError(problem)
    key = (kind, tensor.dtype, tensor.shape, op, prescale_factor, postscale_factor, tensor.is_cuda)
    meta = _METAS.get(key)
    if meta is None:
        meta = (("kind", kind), ("dtype", dtype_name(tensor.dtype)), ("shape", tuple(tensor.shape)),
                ("op", op_name(op)), ("prescale", float(prescale_factor)), ("postscale", float(postscale_factor)),
                ("device", "cuda" if tensor.is_cuda else "cpu"))
        if len(_METAS) > 4096:  # a program of ever-new shapes must not grow this without bound
            _METAS.clear()
        _METAS[key] = meta
    return meta


def _group(kind, describe_one, tensors):
    """``describe()`` of a grouped op: one entry, its parts each described as a single op would be."""
    def describe():
        if not tensors:
            raise ValueError(f"grouped_{kind}: the list of tensors is empty")
        parts = [describe_one(t) for t in tensors]
        infos = tuple(p[1] for p in parts)
        return ((("kind", kind), ("parts", tuple(p[0] for p in parts))), infos if any(i is not None for i in infos)
                else None, [p[2] for p in parts])
    return describe


def _describe_allreduce(tensor, op, prescale_factor, postscale_factor, in_place):
    meta = _reduce_meta("allreduce", tensor, op, prescale_factor, postscale_factor)
    out = tensor if in_place else torch.empty_like(tensor, memory_format=torch.contiguous_format)
    return meta, None, (tensor, out)


def _allreduce_one(op, prescale_factor, postscale_factor, in_place):
    def describe(tensor):
        return _describe_allreduce(tensor, op, prescale_factor, postscale_factor, in_place)
    return describe


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                    process_set=global_process_set):
    """Start reducing ``tensor`` across the set's ranks into a new tensor; return a handle."""
    return handles.register(submit("allreduce", name, process_set, _describe_allreduce, tensor,
                                   resolve_op(op, average), prescale_factor, postscale_factor, False))


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                     process_set=global_process_set):
    """Start reducing ``tensor`` in place; return a handle."""
    return handles.register(submit("allreduce", name, process_set, _describe_allreduce, tensor,
                                   resolve_op(op, average), prescale_factor, postscale_factor, True))


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                            process_set=global_process_set):
    """Start reducing each tensor into a new one, fused where they fit; return one handle (a list)."""
    one = _allreduce_one(resolve_op(op, average), prescale_factor, postscale_factor, in_place=False)
    return handles.register(submit("allreduce", name, process_set, _group("allreduce", one, list(tensors))))


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                             process_set=global_process_set):
    """Start reducing each tensor in place; return one handle (a list)."""
    one = _allreduce_one(resolve_op(op, average), prescale_factor, postscale_factor, in_place=True)
    return handles.register(submit("allreduce", name, process_set, _group("allreduce", one, list(tensors))))


def _allgather_one(tensor):
    _checked(tensor, "allgather")
    meta = (("kind", "allgather"), ("dtype", dtype_name(tensor.dtype)), ("trailing shape", tuple(tensor.shape[1:])),
            ("device", tensor.device.type))
    return meta, tensor.shape[0] if tensor.dim() else 1, (tensor,)


def allgather_async(tensor, name=None, process_set=global_process_set):
    """Start concatenating every rank's ``tensor`` on the first dimension (which may differ); return a handle."""
    return handles.register(submit("allgather", name, process_set, lambda: _allgather_one(tensor)))


def grouped_allgather_async(tensors, name=None, process_set=global_process_set):
    """Start an allgather of each tensor; return one handle (a list)."""
    return handles.register(submit("allgather", name, process_set, _group("allgather", _allgather_one,
                                                                           list(tensors))))


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


def _broadcast(tensor, root_rank, name, process_set, in_place):
    def describe():
        _checked(tensor, "broadcast")
        root = _root_in_set(root_rank, process_set, "broadcast")
        meta = (("kind", "broadcast"), ("dtype", dtype_name(tensor.dtype)), ("shape", tuple(tensor.shape)),
                ("root", root), ("device", tensor.device.type))
        out = tensor if in_place else torch.empty_like(tensor, memory_format=torch.contiguous_format)
        return meta, None, (tensor, out)
    return handles.register(submit("broadcast", name, process_set, describe))


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set):
    """Start copying ``root_rank``'s ``tensor`` to every rank of the set, into a new tensor; return a handle."""
    return _broadcast(tensor, root_rank, name, process_set, in_place=False)


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set):
    """Start overwriting ``tensor`` with ``root_rank``'s, in place; return a handle."""
    return _broadcast(tensor, root_rank, name, process_set, in_place=True)


def alltoall_splits(rows, splits, nranks):
    """The rows sent to each rank, as a list of ints; ValueError naming the problem (pure).

    Args:
        rows: the first dimension of the tensor sent (0 for a 0-dim tensor).
        splits: None (equal parts), a list of ints, or an int32 tensor.
        nranks: the number of ranks in the process set.
    """
    if splits is None:
        if rows % nranks:
            raise ValueError(f"alltoall: the first dimension ({rows}) is not a multiple of the number of ranks "
                             f"({nranks}); pass splits")
        return [rows // nranks] * nranks
    if isinstance(splits, torch.Tensor):
        if splits.dtype != torch.int32:
            raise ValueError(f"alltoall: splits must be an int32 tensor, got {dtype_name(splits.dtype)}")
        splits = splits.tolist()
    splits = [int(s) for s in splits]
    if len(splits) != nranks or any(s < 0 for s in splits):
        raise ValueError(f"alltoall: splits must hold {nranks} counts of at least 0, got {splits}")
    if sum(splits) > rows:
        raise ValueError(f"alltoall: the splits add up to {sum(splits)}, more than the first dimension ({rows})")
    return splits


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set):
    """Start sending ``splits[r]`` rows to each rank ``r``; ``synchronize`` gives (output, received splits)."""
    def describe():
        _checked(tensor, "alltoall")
        ps = global_process_set if process_set is None else process_set
        sent = alltoall_splits(tensor.shape[0] if tensor.dim() else 0, splits, len(ps.ranks))
        meta = (("kind", "alltoall"), ("dtype", dtype_name(tensor.dtype)),
                ("trailing shape", tuple(tensor.shape[1:])), ("device", tensor.device.type))
        return meta, sent, (tensor,)
    return handles.register(submit("alltoall", name, process_set, describe))


def _reducescatter_one(op, prescale_factor, postscale_factor):
    def describe(tensor):
        meta = _reduce_meta("reducescatter", tensor, op, prescale_factor, postscale_factor)
        if tensor.dim() == 0:
            raise ValueError("reducescatter: a 0-dim tensor has no rows to scatter; reshape it to (1,) or more")
        return meta, None, (tensor,)
    return describe


def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set, prescale_factor=1.0,
                        postscale_factor=1.0):
    """Start reducing ``tensor`` and giving each rank its block of rows (the first ranks one more); return a handle."""
    one = _reducescatter_one(op, prescale_factor, postscale_factor)
    return handles.register(submit("reducescatter", name, process_set, lambda: one(tensor)))


def grouped_reducescatter_async(tensors, name=None, op=Average, process_set=global_process_set,
                                prescale_factor=1.0, postscale_factor=1.0):
    """Start a reducescatter of each tensor; return one handle (a list)."""
    one = _reducescatter_one(op, prescale_factor, postscale_factor)
    return handles.register(submit("reducescatter", name, process_set, _group("reducescatter", one,
                                                                              list(tensors))))


def join(device=-1):
    """Declare this rank done: until every rank has joined, it adds zeros to the others' allreduces.

    Collective over every rank: blocks until every rank has called it, and
    returns the rank that joined last, the same on every rank. While a rank
    is joined, ops other than allreduce fail on the ranks that submit them.
    ``device`` is accepted for Horovod's signature; the zeros go on the
    device the other ranks' tensors are on.
    """
    pending = submit("join", JOIN, None, lambda: ((("kind", "join"),), None, ()), exact=True)
    return handles.synchronize(handles.register(pending))


def barrier(process_set=global_process_set):
    """Wait until every rank of the process set has reached the barrier (collective over the set)."""
    pending = submit("barrier", None, process_set, lambda: ((("kind", "barrier"),), None, ()))
    handles.synchronize(handles.register(pending))

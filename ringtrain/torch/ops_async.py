"""Submitting ops: the ``*_async`` collectives of Horovod's API, returning handles.

Each function checks its arguments on this rank (a ValueError before
anything is sent), describes the op for the other ranks (``meta``: what
they must agree on; ``info``: what may differ) and queues it on the
:class:`~ringtrain.torch.engine.Engine`. ``synchronize(handle)`` returns
its output. Collective: every rank of the process set must submit an op of
the same name (unnamed ops are named by a per-kind counter, so ranks making
the same unnamed calls in the same order match).
"""

import atexit
import warnings

import torch

from . import handles, runtime
from .dtypes import check_tensor, dtype_name
from .engine import Engine, Entry
from .process_sets import global_process_set
from .reduce_ops import Average, Sum, op_name

__all__ = ["allreduce_async", "allreduce_async_", "grouped_allreduce_async", "grouped_allreduce_async_",
           "allgather_async", "grouped_allgather_async", "broadcast_async", "broadcast_async_", "alltoall_async",
           "reducescatter_async", "grouped_reducescatter_async", "barrier", "join", "resolve_op", "engine",
           "submit"]


@runtime.start_hook
def _start(rt):
    rt.extras["engine"] = Engine(rt)


@runtime.stop_hook
def _stop(rt):
    rt.extras.pop("engine").stop()


# Every rank exits through here, so the engine's last round (and its
# communicator's release) happens before mpi4py finalizes MPI.
atexit.register(runtime.shutdown)


def engine():
    """The running runtime's :class:`Engine` (ValueError before ``init``)."""
    return runtime.current().extras["engine"]


def resolve_op(op, average):
    """The op constant from Horovod's ``op`` and deprecated ``average`` arguments (pure but for a warning)."""
    if op is not None and average is not None:
        raise ValueError("the op parameter supersedes average; pass one of them, not both")
    if average is not None:
        warnings.warn("average is deprecated; use op=hvd.Average or op=hvd.Sum", DeprecationWarning, stacklevel=3)
        return Average if average else Sum
    return Average if op is None else op


def _set_id(process_set, who):
    ps = global_process_set if process_set is None else process_set
    if ps.process_set_id is None:
        raise ValueError(f"{who}: the process set is not registered; call hvd.add_process_set() first")
    if ps.process_set_id != 0 and runtime.rank() not in ps.ranks:
        raise ValueError(f"{who}: this rank ({runtime.rank()}) is not in {ps}")
    return ps.process_set_id


def submit(kind, name, process_set, meta, info, args, pending=None):
    """Queue one op on the engine; return its :class:`~ringtrain.torch.handles.Pending`."""
    eng = engine()
    pending = pending or handles.Pending()
    name = eng.auto_name(kind) if name is None else str(name)
    if tensor_is_cuda(args):
        torch.cuda.current_stream().synchronize()  # the engine's thread reads the tensor next
    eng.submit(Entry(name, _set_id(process_set, kind), kind, meta, info, args, pending))
    return pending


def tensor_is_cuda(args):
    return bool(args) and isinstance(args[0], torch.Tensor) and args[0].is_cuda


def _device(tensor):
    return tensor.device.type


def _reduce_meta(kind, tensor, op, prescale_factor, postscale_factor):
    return (("kind", kind), ("dtype", dtype_name(tensor.dtype)), ("shape", tuple(tensor.shape)),
            ("op", op_name(op)), ("prescale", float(prescale_factor)), ("postscale", float(postscale_factor)),
            ("device", _device(tensor)))


def _allreduce_pending(tensor, output, name, op, prescale_factor, postscale_factor, process_set, kind="allreduce"):
    check_tensor(tensor, kind)
    meta = _reduce_meta(kind, tensor, op, prescale_factor, postscale_factor)
    return submit(kind, name, process_set, meta, None, (tensor, output))


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                    process_set=global_process_set):
    """Start reducing ``tensor`` across ranks into a new tensor; return a handle."""
    op = resolve_op(op, average)
    output = torch.empty_like(tensor, memory_format=torch.contiguous_format)
    return handles.register(_allreduce_pending(tensor, output, name, op, prescale_factor, postscale_factor,
                                               process_set))


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                     process_set=global_process_set):
    """Start reducing ``tensor`` in place; return a handle."""
    op = resolve_op(op, average)
    return handles.register(_allreduce_pending(tensor, tensor, name, op, prescale_factor, postscale_factor,
                                               process_set))


def _grouped(kind, tensors, name, one):
    """Submit ``one(tensor, member_name)`` for every tensor, under one handle."""
    if not tensors:
        raise ValueError(f"grouped_{kind}: the list of tensors is empty")
    base = engine().auto_name(f"grouped_{kind}") if name is None else str(name)
    members = [one(t, f"{base}.{i}") for i, t in enumerate(tensors)]
    return handles.register(handles.GroupPending(members))


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                            process_set=global_process_set):
    """Start reducing each tensor into a new one, fused where they fit; return one handle."""
    op = resolve_op(op, average)
    return _grouped("allreduce", tensors, name, lambda t, n: _allreduce_pending(
        t, torch.empty_like(t, memory_format=torch.contiguous_format), n, op, prescale_factor, postscale_factor,
        process_set))


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                             process_set=global_process_set):
    """Start reducing each tensor in place; return one handle."""
    op = resolve_op(op, average)
    return _grouped("allreduce", tensors, name, lambda t, n: _allreduce_pending(
        t, t, n, op, prescale_factor, postscale_factor, process_set))


def _allgather_pending(tensor, name, process_set):
    check_tensor(tensor, "allgather")
    rest = tuple(tensor.shape[1:])
    meta = (("kind", "allgather"), ("dtype", dtype_name(tensor.dtype)), ("trailing shape", rest),
            ("device", _device(tensor)))
    return submit("allgather", name, process_set, meta, tensor.shape[0] if tensor.dim() else 1, (tensor,))


def allgather_async(tensor, name=None, process_set=global_process_set):
    """Start concatenating every rank's ``tensor`` on the first dimension (which may differ); return a handle."""
    return handles.register(_allgather_pending(tensor, name, process_set))


def grouped_allgather_async(tensors, name=None, process_set=global_process_set):
    """Start an allgather of each tensor; return one handle."""
    return _grouped("allgather", tensors, name, lambda t, n: _allgather_pending(t, n, process_set))


def _broadcast_pending(tensor, output, root_rank, name, process_set):
    check_tensor(tensor, "broadcast")
    try:
        root = int(root_rank)
    except (TypeError, ValueError):
        raise ValueError(f"broadcast: root_rank must be an int, got {root_rank!r}") from None
    root = _root_in_set(root, process_set, "broadcast")
    meta = (("kind", "broadcast"), ("dtype", dtype_name(tensor.dtype)), ("shape", tuple(tensor.shape)),
            ("root", root), ("device", _device(tensor)))
    return submit("broadcast", name, process_set, meta, None, (tensor, output))


def _root_in_set(root, process_set, who):
    """``root`` (a rank of the runtime, as Horovod's API takes it) as a rank of the process set's communicator."""
    ps = global_process_set if process_set is None else process_set
    ranks = list(ps.ranks)
    if root not in ranks:
        raise ValueError(f"{who}: root_rank {root} is not in the process set (ranks {ranks})")
    return ranks.index(root)


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set):
    """Start copying ``root_rank``'s ``tensor`` to every rank, into a new tensor; return a handle."""
    output = torch.empty_like(tensor, memory_format=torch.contiguous_format)
    return handles.register(_broadcast_pending(tensor, output, root_rank, name, process_set))


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set):
    """Start overwriting ``tensor`` with ``root_rank``'s, in place; return a handle."""
    return handles.register(_broadcast_pending(tensor, tensor, root_rank, name, process_set))


def alltoall_splits(tensor, splits, nranks):
    """The rows sent to each rank, as a list, checked (ValueError) on this rank (pure)."""
    rows = tensor.shape[0] if tensor.dim() else 0
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
    check_tensor(tensor, "alltoall")
    ps = global_process_set if process_set is None else process_set
    sent = alltoall_splits(tensor, splits, ps.size())
    meta = (("kind", "alltoall"), ("dtype", dtype_name(tensor.dtype)), ("trailing shape", tuple(tensor.shape[1:])),
            ("device", _device(tensor)))
    return handles.register(submit("alltoall", name, process_set, meta, sent, (tensor,)))


def _reducescatter_pending(tensor, name, op, process_set, prescale_factor, postscale_factor):
    check_tensor(tensor, "reducescatter")
    if tensor.dim() == 0:
        raise ValueError("reducescatter: a 0-dim tensor has no rows to scatter; reshape it to (1,) or more")
    meta = _reduce_meta("reducescatter", tensor, op, prescale_factor, postscale_factor)
    return submit("reducescatter", name, process_set, meta, None, (tensor,))


def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set, prescale_factor=1.0,
                        postscale_factor=1.0):
    """Start reducing ``tensor`` and giving each rank its block of rows (the first ranks one more); return a handle."""
    return handles.register(_reducescatter_pending(tensor, name, op, process_set, prescale_factor,
                                                   postscale_factor))


def grouped_reducescatter_async(tensors, name=None, op=Average, process_set=global_process_set,
                                prescale_factor=1.0, postscale_factor=1.0):
    """Start a reducescatter of each tensor; return one handle."""
    return _grouped("reducescatter", tensors, name, lambda t, n: _reducescatter_pending(
        t, n, op, process_set, prescale_factor, postscale_factor))


def join(device=-1):
    """Declare this rank done: until every rank has joined, it adds zeros to the others' allreduces.

    Blocks until every rank has called it; returns the rank that joined
    last, the same on every rank. While a rank is joined, ops other than
    allreduce fail on the ranks that submit them. ``device`` is accepted for
    Horovod's signature; the zeros go on the device the other ranks' tensors are on.
    """
    from .negotiation import JOIN

    pending = submit("join", JOIN, None, (("kind", "join"),), None, ())
    return handles.synchronize(handles.register(pending))


def barrier(process_set=global_process_set):
    """Wait until every rank of the process set has reached the barrier."""
    pending = submit("barrier", None, process_set, (("kind", "barrier"),), None, ())
    handles.synchronize(handles.register(pending))

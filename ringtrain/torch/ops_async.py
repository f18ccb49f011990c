"""Horovod's ``*_async`` collectives on tensors: views handed to the engine, tensors handed back.

Each function checks its tensors on this rank (a tensor no op takes is
refused here, and the process set's other members are told, so they fail
the op too), syncs each CUDA tensor's own stream, and submits a zero-copy
view of the tensor's memory to the engine (:mod:`ringtrain.engine.ops`;
:mod:`ringtrain.engine.core`'s docstring is the contract: which calls are
collective, in what order, what fails how). ``synchronize(handle)`` returns
a tensor: the very tensor given, for the in-place forms, whose memory the
engine wrote; a new tensor (allocated here, written by the engine in
place) for the others. :func:`allreduce_now` is the blocking allreduce
the blocking faces call: the same op, waited for without a handle.
"""

import warnings

import torch

from ..engine import ops
from ..engine.ops import alltoall_splits, barrier, join as _engine_join, start_timeline, stop_timeline
from ..engine.process_sets import global_process_set
from ..engine.reduce_ops import Average, Sum
from .tensors import array_of, check_tensor, engine_view, known_view, tensor_of

__all__ = ["allreduce_async", "allreduce_async_", "allreduce_now", "grouped_allreduce_async",
           "grouped_allreduce_async_",
           "allgather_async", "grouped_allgather_async", "broadcast_async", "broadcast_async_", "alltoall_async",
           "reducescatter_async", "grouped_reducescatter_async", "barrier", "join", "resolve_op", "alltoall_splits",
           "start_timeline", "stop_timeline"]


def resolve_op(op, average):
    """The op constant from Horovod's ``op`` and deprecated ``average`` arguments (pure but for a warning)."""
    if op is not None and average is not None:
        raise ValueError("the op parameter supersedes average; pass one of them, not both")
    if average is not None:
        warnings.warn("average is deprecated; use op=hvd.Average or op=hvd.Sum", DeprecationWarning, stacklevel=3)
        return Average if average else Sum
    return Average if op is None else op


def _views(kind, tensors, name, process_set):
    """``(arrays, dtypes)`` of ``tensors`` for the engine; a tensor no op takes is refused on every member."""
    views = [_view(kind, t, name, process_set) for t in tensors]
    return [v[0] for v in views], [v[1] for v in views]


def _view(kind, tensor, name, process_set):
    """``(array, dtype)`` of one tensor for the engine (:func:`~ringtrain.torch.tensors.engine_view`), checked."""
    known = known_view(tensor)
    if known is not None:
        return known, None
    problem = check_tensor(tensor, kind)
    if problem is not None:
        raise ops.refused(kind, problem, name, process_set) from None
    return engine_view(tensor)


def _new_like(tensor):
    return torch.empty_like(tensor, memory_format=torch.contiguous_format)


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                    process_set=global_process_set):
    """Start reducing ``tensor`` across the set's ranks into a new tensor; return a handle."""
    op = resolve_op(op, average)
    array, dtype = _view("allreduce", tensor, name, process_set)
    result = _new_like(tensor)
    out, _ = array_of(result)
    return ops.allreduce_async(array, name, op, prescale_factor, postscale_factor, process_set, out=out, dtype=dtype,
                               finish=lambda _: result)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                     process_set=global_process_set):
    """Start reducing ``tensor`` in place; return a handle."""
    op = resolve_op(op, average)
    array, dtype = _view("allreduce", tensor, name, process_set)
    return ops.allreduce_async(array, name, op, prescale_factor, postscale_factor, process_set, out=array,
                               dtype=dtype, finish=lambda _: tensor)


def allreduce_now(tensor, in_place, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                  process_set=global_process_set):
    """Reduce ``tensor`` (in place, or into a new tensor) and return the result, waiting on this thread.

    ``synchronize(allreduce_async_(...))`` without the handle: a small op
    on an idle set runs alone (:func:`ringtrain.engine.ops.allreduce`).
    """
    op = resolve_op(op, average)
    array, dtype = _view("allreduce", tensor, name, process_set)
    result = tensor if in_place else _new_like(tensor)
    out = array if in_place else array_of(result)[0]
    ops.allreduce(array, name, op, prescale_factor, postscale_factor, process_set, out=out, dtype=dtype)
    return result


def _grouped_allreduce(tensors, average, name, op, prescale_factor, postscale_factor, process_set, in_place):
    op = resolve_op(op, average)
    tensors = list(tensors)
    arrays, dtypes = _views("allreduce", tensors, name, process_set)
    results = tensors if in_place else [_new_like(t) for t in tensors]
    outs = arrays if in_place else [array_of(r)[0] for r in results]
    return ops.grouped_allreduce_async(arrays, name, op, prescale_factor, postscale_factor, process_set, out=outs,
                                       dtype=dtypes, finish=lambda _: list(results))


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                            process_set=global_process_set):
    """Start reducing each tensor into a new one, fused where they fit; return one handle (a list)."""
    return _grouped_allreduce(tensors, average, name, op, prescale_factor, postscale_factor, process_set, False)


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                             process_set=global_process_set):
    """Start reducing each tensor in place; return one handle (a list)."""
    return _grouped_allreduce(tensors, average, name, op, prescale_factor, postscale_factor, process_set, True)


def allgather_async(tensor, name=None, process_set=global_process_set):
    """Start concatenating every rank's ``tensor`` on the first dimension (which may differ); return a handle."""
    array, dtype = _view("allgather", tensor, name, process_set)
    return ops.allgather_async(array, name, process_set, dtype=dtype, finish=lambda a: tensor_of(a, dtype))


def grouped_allgather_async(tensors, name=None, process_set=global_process_set):
    """Start an allgather of each tensor; return one handle (a list)."""
    arrays, dtypes = _views("allgather", list(tensors), name, process_set)
    return ops.grouped_allgather_async(arrays, name, process_set, dtype=dtypes,
                                       finish=lambda got: [tensor_of(a, d) for a, d in zip(got, dtypes)])


def _broadcast(tensor, root_rank, name, process_set, in_place):
    array, dtype = _view("broadcast", tensor, name, process_set)
    result = tensor if in_place else _new_like(tensor)
    out = array if in_place else array_of(result)[0]
    return ops.broadcast_async(array, root_rank, name, process_set, out=out, dtype=dtype, finish=lambda _: result)


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set):
    """Start copying ``root_rank``'s ``tensor`` to every rank of the set, into a new tensor; return a handle."""
    return _broadcast(tensor, root_rank, name, process_set, in_place=False)


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set):
    """Start overwriting ``tensor`` with ``root_rank``'s, in place; return a handle."""
    return _broadcast(tensor, root_rank, name, process_set, in_place=True)


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set):
    """Start sending ``splits[r]`` rows to each rank ``r``; ``synchronize`` gives (output, received splits)."""
    array, dtype = _view("alltoall", tensor, name, process_set)
    if isinstance(splits, torch.Tensor):
        if splits.dtype != torch.int32:
            raise ops.refused("alltoall", f"alltoall: splits must be an int32 tensor, got "
                              f"{str(splits.dtype).replace('torch.', '')}", name, process_set) from None
        splits = splits.cpu().numpy()

    def finish(result):
        out, received = result
        return tensor_of(out, dtype), torch.from_numpy(received)
    return ops.alltoall_async(array, splits, name, process_set, dtype=dtype, finish=finish)


def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set, prescale_factor=1.0,
                        postscale_factor=1.0):
    """Start reducing ``tensor`` and giving each rank its block of rows (the first ranks one more); return a handle."""
    array, dtype = _view("reducescatter", tensor, name, process_set)
    return ops.reducescatter_async(array, name, op, process_set, prescale_factor, postscale_factor, dtype=dtype,
                                   finish=lambda a: tensor_of(a, dtype))


def grouped_reducescatter_async(tensors, name=None, op=Average, process_set=global_process_set,
                                prescale_factor=1.0, postscale_factor=1.0):
    """Start a reducescatter of each tensor; return one handle (a list)."""
    arrays, dtypes = _views("reducescatter", list(tensors), name, process_set)
    return ops.grouped_reducescatter_async(arrays, name, op, process_set, prescale_factor, postscale_factor,
                                           dtype=dtypes, finish=lambda got: [tensor_of(a, d)
                                                                             for a, d in zip(got, dtypes)])


def join(device=-1):
    """Declare this rank done: until every rank has joined, it adds zeros to the others' allreduces.

    Collective over every rank: blocks until every rank has called it, and
    returns the rank that joined last, the same on every rank. While a rank
    is joined, ops other than allreduce fail on the ranks that submit them.
    ``device`` is accepted for Horovod's signature; the zeros go on the
    device the other ranks' tensors are on.
    """
    return _engine_join()

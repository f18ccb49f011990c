"""Horovod's collectives built over the async ops: the blocking ones, with gradients, and the sparse allreduce.

Out of place, each is differentiable as Horovod defines it:

* allreduce: the gradient is the same allreduce of the incoming gradient;
* allgather: the gradient is this rank's rows of the averaged gradient;
* broadcast: the gradient is the averaged gradient on the root, zero elsewhere;
* alltoall: the gradient goes back along the received splits;
* reducescatter: the gradient is the allgather of the incoming gradient,
  scaled as the forward op was (times the set's size for ``Sum``).

In place (``allreduce_``, ``grouped_allreduce_``, ``broadcast_``), they
write the tensor's memory outside autograd, as Horovod's do, so they take a
leaf that requires grad: the model-averaging idiom
``with torch.no_grad(): hvd.allreduce_(p)``. Each returns the very tensor it
was given.

A sparse tensor goes through :func:`sparse_allreduce_async` (Horovod's
allgather of indices and values) or ``tensor.to_dense()``; the other ops
refuse it with a one-line ``ValueError`` on the rank that passed it, before
anything is sent.

Each is collective: every rank of the process set must make the same calls.
"""

import torch

from ..engine import handles, runtime
from .ops_async import (allgather_async, alltoall_async, broadcast_async, broadcast_async_, grouped_allgather_async,
                        grouped_allreduce_async, grouped_reducescatter_async, reducescatter_async, resolve_op)
from .ops_async import allreduce_async, allreduce_now, grouped_allreduce_async_
from ..engine.process_sets import global_process_set
from ..engine.reduce_ops import Average, Sum

__all__ = ["allreduce", "allreduce_", "grouped_allreduce", "grouped_allreduce_", "allgather", "grouped_allgather",
           "broadcast", "broadcast_", "alltoall", "reducescatter", "grouped_reducescatter", "sparse_allreduce_async"]

_sync = handles.synchronize


def _dense(tensor, who):
    """``tensor``, refused (ValueError, one line naming the fix) when it is sparse: no dense op takes one."""
    if isinstance(tensor, torch.Tensor) and tensor.is_sparse:
        raise ValueError(f"{who}: the tensor is sparse; reduce it with hvd.sparse_allreduce_async(tensor, name, op) "
                         f"or pass tensor.to_dense()")
    return tensor


def _in_place(tensor):
    """The tensor's memory without its autograd history: in-place ops write it as Horovod's do, outside autograd.

    A leaf that requires grad (a parameter) may not be written in place
    under autograd, and the engine's thread, where the write happens, does
    not share the caller's ``torch.no_grad()``. A tensor that does not
    require grad is written as it is (detaching it would cost a new tensor
    object on every call).
    """
    return tensor.detach() if isinstance(tensor, torch.Tensor) and tensor.requires_grad else tensor


def _compress(compression, tensor):
    return (tensor, None) if compression is None else compression.compress(tensor)


def _decompress(compression, tensor, ctx):
    return tensor if compression is None else compression.decompress(tensor, ctx)


class HorovodAllreduce(torch.autograd.Function):
    """Allreduce whose gradient is the same allreduce of the incoming gradient."""

    @staticmethod
    def forward(ctx, tensor, name, op, prescale_factor, postscale_factor, process_set):
        ctx.args = (op, prescale_factor, postscale_factor, process_set)
        return allreduce_now(tensor, in_place=False, name=name, op=op, prescale_factor=prescale_factor,
                             postscale_factor=postscale_factor, process_set=process_set)

    @staticmethod
    def backward(ctx, grad_output):
        op, pre, post, ps = ctx.args
        reduced = allreduce_now(grad_output, in_place=False, op=op, prescale_factor=pre, postscale_factor=post,
                                process_set=ps)
        return reduced, None, None, None, None, None


def allreduce(tensor, average=None, name=None, compression=None, op=None, prescale_factor=1.0,
              postscale_factor=1.0, process_set=global_process_set):
    """Reduce ``tensor`` across ranks (default: average) into a new tensor; differentiable."""
    op = resolve_op(op, average)
    compressed, ctx = _compress(compression, _dense(tensor, "allreduce"))
    reduced = HorovodAllreduce.apply(compressed, name, op, prescale_factor, postscale_factor, process_set)
    return _decompress(compression, reduced, ctx)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
               process_set=global_process_set):
    """Reduce ``tensor`` across ranks in place, outside autograd (a parameter under ``no_grad``); return it."""
    allreduce_now(_in_place(_dense(tensor, "allreduce_")), in_place=True, average=average, name=name, op=op,
                  prescale_factor=prescale_factor, postscale_factor=postscale_factor, process_set=process_set)
    return tensor


class HorovodGroupedAllreduce(torch.autograd.Function):
    """Grouped allreduce; each gradient is the same grouped allreduce of the incoming gradients."""

    @staticmethod
    def forward(ctx, name, op, prescale_factor, postscale_factor, process_set, *tensors):
        ctx.args = (op, prescale_factor, postscale_factor, process_set)
        return tuple(_sync(grouped_allreduce_async(list(tensors), None, name, op, prescale_factor,
                                                   postscale_factor, process_set)))

    @staticmethod
    def backward(ctx, *grads):
        op, pre, post, ps = ctx.args
        reduced = _sync(grouped_allreduce_async(list(grads), None, None, op, pre, post, ps))
        return (None, None, None, None, None, *reduced)


def grouped_allreduce(tensors, average=None, name=None, compression=None, op=None, prescale_factor=1.0,
                      postscale_factor=1.0, process_set=global_process_set):
    """Reduce each tensor across ranks into new tensors, fused; differentiable."""
    op = resolve_op(op, average)
    pairs = [_compress(compression, _dense(t, "grouped_allreduce")) for t in tensors]
    reduced = HorovodGroupedAllreduce.apply(name, op, prescale_factor, postscale_factor, process_set,
                                            *[t for t, _ in pairs])
    return [_decompress(compression, t, ctx) for t, (_, ctx) in zip(reduced, pairs)]


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                       process_set=global_process_set):
    """Reduce each tensor in place, fused, outside autograd; return them."""
    tensors = list(tensors)
    _sync(grouped_allreduce_async_([_in_place(_dense(t, "grouped_allreduce_")) for t in tensors], average, name, op,
                                   prescale_factor, postscale_factor, process_set))
    return tensors


def _my_rows(grad, dims, process_set):
    """This rank's rows of an allgathered gradient, given every rank's first dimensions."""
    r = process_set.rank()
    offset = int(sum(dims[:r]))
    return grad.narrow(0, offset, dims[r])


class HorovodAllgather(torch.autograd.Function):
    """Allgather; the gradient is this rank's rows of the averaged incoming gradient."""

    @staticmethod
    def forward(ctx, tensor, name, process_set):
        ctx.dim = tensor.shape[0] if tensor.dim() else 1
        ctx.process_set = process_set
        return _sync(allgather_async(tensor, name, process_set))

    @staticmethod
    def backward(ctx, grad_output):
        ps = ctx.process_set
        reduced = _sync(allreduce_async(grad_output, None, None, Average, 1.0, 1.0, ps))
        dims = _sync(allgather_async(torch.tensor([ctx.dim], dtype=torch.int32), None, ps)).tolist()
        return _my_rows(reduced, dims, ps), None, None


def allgather(tensor, name=None, process_set=global_process_set):
    """Concatenate every rank's ``tensor`` on the first dimension (which may differ); differentiable."""
    return HorovodAllgather.apply(_dense(tensor, "allgather"), name, process_set)


class HorovodGroupedAllgather(torch.autograd.Function):
    """Grouped allgather; gradients as for :class:`HorovodAllgather`."""

    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        ctx.dims = [t.shape[0] if t.dim() else 1 for t in tensors]
        ctx.process_set = process_set
        return tuple(_sync(grouped_allgather_async(list(tensors), name, process_set)))

    @staticmethod
    def backward(ctx, *grads):
        ps = ctx.process_set
        reduced = _sync(grouped_allreduce_async(list(grads), None, None, Average, 1.0, 1.0, ps))
        dims = _sync(grouped_allgather_async([torch.tensor([d], dtype=torch.int32) for d in ctx.dims], None, ps))
        return (None, None, *[_my_rows(g, d.tolist(), ps) for g, d in zip(reduced, dims)])


def grouped_allgather(tensors, name=None, process_set=global_process_set):
    """Allgather each tensor; differentiable."""
    return list(HorovodGroupedAllgather.apply(name, process_set, *[_dense(t, "grouped_allgather") for t in tensors]))


class HorovodBroadcast(torch.autograd.Function):
    """Broadcast; the gradient is the averaged incoming gradient on the root and zero elsewhere."""

    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return _sync(broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx, grad_output):
        ps = ctx.process_set
        reduced = _sync(allreduce_async(grad_output, None, None, Average, 1.0, 1.0, ps))
        if runtime.rank() != ctx.root_rank:
            reduced = reduced * 0
        return reduced, None, None, None


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    """``root_rank``'s ``tensor`` on every rank, in a new tensor; differentiable."""
    return HorovodBroadcast.apply(_dense(tensor, "broadcast"), root_rank, name, process_set)


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    """Overwrite ``tensor`` with ``root_rank``'s, in place, outside autograd; return it."""
    _sync(broadcast_async_(_in_place(_dense(tensor, "broadcast_")), root_rank, name, process_set))
    return tensor


class HorovodAlltoall(torch.autograd.Function):
    """Alltoall; the gradient travels back along the received splits."""

    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        output, received = _sync(alltoall_async(tensor, splits, name, process_set))
        ctx.process_set, ctx.received = process_set, received
        if splits is None:
            return output
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx, grad_output, *unused):
        grad, _ = _sync(alltoall_async(grad_output, ctx.received, None, ctx.process_set))
        return grad, None, None, None


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Send ``splits[r]`` rows to rank ``r``; the received rows (and received splits when ``splits`` is given)."""
    return HorovodAlltoall.apply(_dense(tensor, "alltoall"), splits, name, process_set)


class HorovodReducescatter(torch.autograd.Function):
    """Reducescatter; the gradient is the allgather of the incoming gradient, scaled as the forward op was."""

    @staticmethod
    def forward(ctx, tensor, name, op, process_set, prescale_factor, postscale_factor):
        ctx.args = (op, process_set, prescale_factor, postscale_factor)
        return _sync(reducescatter_async(tensor, name, op, process_set, prescale_factor, postscale_factor))

    @staticmethod
    def backward(ctx, grad_output):
        return _scatter_grad(grad_output, *ctx.args), None, None, None, None, None


def _scatter_grad(grad, op, process_set, prescale_factor, postscale_factor):
    factor = (process_set.size() if op == Sum else 1) * prescale_factor * postscale_factor
    if factor != 1:
        grad = grad * factor
    return _sync(allgather_async(grad, None, process_set))


def reducescatter(tensor, name=None, compression=None, op=Average, process_set=global_process_set,
                  prescale_factor=1.0, postscale_factor=1.0):
    """Reduce ``tensor`` across ranks and keep this rank's block of rows; differentiable."""
    compressed, ctx = _compress(compression, _dense(tensor, "reducescatter"))
    out = HorovodReducescatter.apply(compressed, name, op, process_set, prescale_factor, postscale_factor)
    return _decompress(compression, out, ctx)


class HorovodGroupedReducescatter(torch.autograd.Function):
    """Grouped reducescatter; gradients as for :class:`HorovodReducescatter`."""

    @staticmethod
    def forward(ctx, name, op, process_set, prescale_factor, postscale_factor, *tensors):
        ctx.args = (op, process_set, prescale_factor, postscale_factor)
        return tuple(_sync(grouped_reducescatter_async(list(tensors), name, op, process_set, prescale_factor,
                                                       postscale_factor)))

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, None, None, None, *[_scatter_grad(g, *ctx.args) for g in grads])


def grouped_reducescatter(tensors, name=None, compression=None, op=Average, process_set=global_process_set,
                          prescale_factor=1.0, postscale_factor=1.0):
    """Reducescatter each tensor; differentiable."""
    pairs = [_compress(compression, _dense(t, "grouped_reducescatter")) for t in tensors]
    outs = HorovodGroupedReducescatter.apply(name, op, process_set, prescale_factor, postscale_factor,
                                             *[t for t, _ in pairs])
    return [_decompress(compression, t, ctx) for t, (_, ctx) in zip(outs, pairs)]


def sparse_allreduce_async(tensor, name, op, process_set=global_process_set):
    """Start an allreduce of a sparse COO tensor, as Horovod does it; return a function that waits for the result.

    Every rank's indices and values are gathered; the result is an
    uncoalesced sparse tensor whose duplicate indices add up when it is
    coalesced or used, so it equals the dense allreduce. Collective over
    the process set. ``op`` is ``Average`` or ``Sum``.
    """
    if op not in (Average, Sum):
        raise ValueError(f"sparse_allreduce_async: op must be hvd.Average or hvd.Sum, got {op!r}")
    sparse = tensor.coalesce() if not tensor.is_coalesced() else tensor
    # allgather concatenates on the first dimension: indices go as one row per nonzero.
    indices = allgather_async(sparse.indices().t().contiguous(), f"{name}.indices", process_set)
    values = allgather_async(sparse.values().contiguous(), f"{name}.values", process_set)
    ps = global_process_set if process_set is None else process_set

    def result():
        gathered_values = handles.synchronize(values)
        gathered_indices = handles.synchronize(indices)
        if op == Average:
            gathered_values = gathered_values / ps.size()
        return torch.sparse_coo_tensor(gathered_indices.t(), gathered_values, sparse.shape, check_invariants=True)

    return result

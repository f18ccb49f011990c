"""Horovod's public reductions on TensorFlow: ``allreduce``, ``grouped_allreduce``, ``reducescatter`` and its group.

These add to the ops of :mod:`ringtrain.tensorflow.mpi_ops` what Horovod's
``horovod.tensorflow`` adds: the deprecated ``average`` argument, gradient
compression, and ``tf.IndexedSlices`` (a sparse gradient, such as an
embedding's), which are reduced as Horovod reduces them: an allgather of the
values and one of the indices, the values divided by the set's size for an
average. The result is an ``IndexedSlices`` whose duplicate indices add up
when it is applied or made dense, so it equals the dense allreduce.

Collective over the process set, as every op.
"""

import tensorflow as tf

from .compression import Compression
from .mpi_ops import (Adasum, Average, Sum, allreduce_op, eager_allreduce, eager_direct, global_process_set,
                      grouped_allgather, grouped_allreduce_op, grouped_reducescatter_op,
                      handle_average_backwards_compatibility, reducescatter_op)

__all__ = ["allreduce", "grouped_allreduce", "reducescatter", "grouped_reducescatter"]


def _sparse_op(op, prescale_factor, postscale_factor):
    """Horovod's refusals for IndexedSlices (NotImplementedError), checked before anything is sent."""
    if op == Adasum:
        raise NotImplementedError("The Adasum reduction does not currently support sparse tensors. As a "
                                  "workaround please pass sparse_as_dense=True to DistributedOptimizer")
    if op not in (Sum, Average):
        raise NotImplementedError("Only Sum and Average ops are supported with tf.IndexedSlices")
    if prescale_factor != 1.0 or postscale_factor != 1.0:
        raise NotImplementedError("Pre/postscale_factor are not supported with tf.IndexedSlices")


def _sparse_allreduce(slices, op, process_set):
    """Allgathers of the values and the indices of each IndexedSlices (Horovod's sparse allreduce)."""
    values = grouped_allgather([s.values for s in slices], process_set=process_set)
    indices = grouped_allgather([s.indices for s in slices], process_set=process_set)
    n = (global_process_set if process_set is None else process_set).size()
    out = []
    for s, v, i in zip(slices, values, indices):
        if op == Average:
            v = v / tf.cast(n, v.dtype)  # (integers become floats, as in Horovod: TensorFlow's true division)
        out.append(tf.IndexedSlices(v, i, dense_shape=s.dense_shape))
    return out


def allreduce(tensor, average=None, device_dense="", device_sparse="", compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, name=None, process_set=global_process_set,
              ignore_name_scope=False):
    """Reduce a ``tf.Tensor``, ``tf.Variable`` or ``tf.IndexedSlices`` across the set's members (default: average).

    Args:
        tensor: the same shape and dtype on every member (an IndexedSlices
            may hold different rows on each).
        average: deprecated; use ``op``.
        device_dense, device_sparse: accepted for Horovod's signature.
        compression: ``Compression.none`` or ``Compression.fp16``.
        op: ``Average`` (default), ``Sum``, ``Min``, ``Max``, ``Product``;
            an IndexedSlices takes ``Average`` or ``Sum`` only.
        prescale_factor, postscale_factor: multiply before and after the reduction.
        name: a name for messages.
        process_set: reduce over this process set (default: every rank).

    Returns:
        A new tensor (or IndexedSlices); differentiable.

    Raises:
        NotImplementedError: an IndexedSlices with another op or with factors.
    """
    op = handle_average_backwards_compatibility(op, average)
    if compression is Compression.none and eager_direct(tensor):  # the eager loop's op, without detours
        return eager_allreduce(tensor, name, op, prescale_factor, postscale_factor, process_set)
    if isinstance(tensor, tf.IndexedSlices):
        _sparse_op(op, prescale_factor, postscale_factor)
        return _sparse_allreduce([tensor], op, process_set)[0]
    compressed, ctx = compression.compress(tf.convert_to_tensor(tensor))
    reduced = allreduce_op(compressed, name=name, op=op, prescale_factor=prescale_factor,
                         postscale_factor=postscale_factor, process_set=process_set)
    return compression.decompress(reduced, ctx)


def grouped_allreduce(tensors, average=None, device_dense="", device_sparse="", compression=Compression.none,
                      op=None, prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set,
                      ignore_name_scope=False, name=None):
    """Reduce each tensor (or IndexedSlices) across the set's members in one op; a list in the same order."""
    if not tensors:
        return tensors
    op = handle_average_backwards_compatibility(op, average)
    dense = [i for i, t in enumerate(tensors) if not isinstance(t, tf.IndexedSlices)]
    sparse = [i for i, t in enumerate(tensors) if isinstance(t, tf.IndexedSlices)]
    out = [None] * len(tensors)
    if sparse:
        _sparse_op(op, prescale_factor, postscale_factor)
        for i, s in zip(sparse, _sparse_allreduce([tensors[i] for i in sparse], op, process_set)):
            out[i] = s
    if dense:
        pairs = [compression.compress(tf.convert_to_tensor(tensors[i])) for i in dense]
        reduced = grouped_allreduce_op([t for t, _ in pairs], name=name, op=op, prescale_factor=prescale_factor,
                                     postscale_factor=postscale_factor, process_set=process_set)
        for i, r, (_, ctx) in zip(dense, reduced, pairs):
            out[i] = compression.decompress(r, ctx)
    return out


def reducescatter(tensor, device_dense="", compression=Compression.none, op=Average, name=None,
                  process_set=global_process_set, ignore_name_scope=False, prescale_factor=1.0,
                  postscale_factor=1.0):
    """Reduce ``tensor`` (``Average`` or ``Sum``) and keep this member's block of rows; differentiable.

    The first ``rows % size`` members get one row more than the others.
    """
    compressed, ctx = compression.compress(tf.convert_to_tensor(tensor))
    out = reducescatter_op(compressed, name=name, op=op, process_set=process_set, prescale_factor=prescale_factor,
                         postscale_factor=postscale_factor)
    return compression.decompress(out, ctx)


def grouped_reducescatter(tensors, device_dense="", compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    """Reducescatter each tensor in one op; a list in the same order."""
    if not tensors:
        return tensors
    pairs = [compression.compress(tf.convert_to_tensor(t)) for t in tensors]
    outs = grouped_reducescatter_op([t for t, _ in pairs], op=op, process_set=process_set,
                                  prescale_factor=prescale_factor, postscale_factor=postscale_factor)
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, pairs)]

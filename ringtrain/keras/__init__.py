"""Horovod's Keras API on Keras 3 and Keras 2: ``import ringtrain.keras as hvd``.

Serves ``horovod.tensorflow.keras`` and ``horovod.keras``: the basics and
ops of :mod:`ringtrain.tensorflow`, a :func:`DistributedOptimizer` for Keras
optimizers (Keras 3's, or ``tf-keras``'s under ``TF_USE_LEGACY_KERAS=1``),
:mod:`.callbacks`, :func:`broadcast_global_variables` and :func:`load_model`.

The wrapped optimizer averages the gradients across the process set in
``apply`` (Keras 3) or ``apply_gradients`` (Keras 2), in one grouped
allreduce per step, before the wrapped update; ``model.fit`` and custom
loops both go through it. Collective: every rank must step the same
optimizer at the same steps.
"""

import tensorflow as tf

import ringtrain.tensorflow as _hvd
from ringtrain.tensorflow import (Adasum, Average, Compression, Max, Min, Product, ProcessSet, Sum, add_process_set,
                                  allgather_object, barrier, broadcast_object, broadcast_variables, cross_rank,
                                  cross_size, global_process_set, init, is_homogeneous, is_initialized, join,
                                  local_rank, local_size, mpi_built, mpi_enabled, mpi_threads_supported, rank,
                                  remove_process_set, shutdown, size)
from ringtrain.tensorflow.gradients import check_arguments, make_allreduce_grads_fn, reduce_with_locals, source_key

from . import callbacks, elastic

__all__ = ["Adasum", "Average", "Compression", "Max", "Min", "Product", "ProcessSet", "Sum", "add_process_set",
           "allgather_object", "barrier", "broadcast_object", "broadcast_variables", "cross_rank", "cross_size",
           "global_process_set", "init", "is_homogeneous", "is_initialized", "join", "local_rank", "local_size",
           "mpi_built", "mpi_enabled", "mpi_threads_supported", "rank", "remove_process_set", "shutdown", "size",
           "callbacks", "DistributedOptimizer", "broadcast_global_variables", "allreduce", "allgather", "broadcast",
           "reducescatter", "load_model", "elastic"]


class _DistributedKerasOptimizer:
    """What a wrapped Keras optimizer gains (mixed in before its own class; settings in the class's ``_hvd``)."""

    _hvd = None  # (allreduce_grads, process_set, scale_local_gradients), set on the class made for each wrap

    def register_local_var(self, var):
        """Keep ``var``'s gradient local (not reduced; scaled by 1/size when ``scale_local_gradients``)."""
        self.__dict__.setdefault("_hvd_local", set()).add(source_key(var))

    def _hvd_reduce(self, grads, variables):
        allreduce_grads, process_set, scale_local = self._hvd
        return reduce_with_locals(allreduce_grads, list(grads), list(variables),
                                  self.__dict__.get("_hvd_local", set()), process_set, scale_local)

    def apply(self, grads, trainable_variables=None):
        """Keras 3: average ``grads`` across the process set, then the wrapped update (collective)."""
        variables = self._trainable_variables if trainable_variables is None else trainable_variables
        return super().apply(self._hvd_reduce(grads, variables), trainable_variables)

    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        """The wrapped ``apply_gradients``; Keras 2 optimizers average the gradients here first (collective)."""
        if _KERAS_3 and isinstance(self, _keras_base()):
            return super().apply_gradients(grads_and_vars, *args, **kwargs)
        pairs = list(grads_and_vars)
        reduced = self._hvd_reduce([g for g, _ in pairs], [v for _, v in pairs])
        return super().apply_gradients(list(zip(reduced, [v for _, v in pairs])), *args, **kwargs)


_KERAS_3 = hasattr(tf.keras, "version") and tf.keras.version().startswith("3")


def _keras_base():
    import keras

    return keras.optimizers.Optimizer


def DistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="",  # noqa: N802 - Horovod's name
                         compression=Compression.none, sparse_as_dense=False, gradient_predivide_factor=1.0,
                         op=Average, backward_passes_per_step=1, average_aggregated_gradients=False, num_groups=0,
                         groups=None, process_set=global_process_set, scale_local_gradients=True):
    """A copy of ``optimizer`` (same class and config) that averages gradients across ranks (Horovod's signature).

    Raises:
        NotImplementedError: ``backward_passes_per_step > 1`` or ``op=Adasum``.
    """
    groups = check_arguments(op, gradient_predivide_factor, num_groups, groups)
    if backward_passes_per_step > 1:
        raise NotImplementedError("backward_passes_per_step > 1 is not implemented by ringtrain.keras; for Keras 3 "
                                  "use the optimizer's own gradient_accumulation_steps")
    fn = make_allreduce_grads_fn(name or f"Distributed{type(optimizer).__name__}", device_dense, device_sparse,
                                 compression, sparse_as_dense, op, gradient_predivide_factor, groups, process_set)
    base = type(optimizer)
    cls = type(base.__name__, (_DistributedKerasOptimizer, base),
               {"__module__": base.__module__, "_hvd": (fn, process_set, scale_local_gradients)})
    return cls.from_config(optimizer.get_config())


def broadcast_global_variables(root_rank):
    """Horovod's TF1 graph helper; eagerly, use ``broadcast_variables`` or the callback (RuntimeError)."""
    return _hvd.broadcast_global_variables(root_rank)


def allreduce(value, name=None, average=None, prescale_factor=1.0, postscale_factor=1.0, op=None,
              compression=Compression.none):
    """``value`` (any array-like) reduced across ranks, as a NumPy array (collective)."""
    return _hvd.allreduce(tf.constant(value), average=average, prescale_factor=prescale_factor,
                          postscale_factor=postscale_factor, op=op, compression=compression, name=name).numpy()


def allgather(value, name=None):
    """Every rank's ``value`` concatenated on the first dimension, as a NumPy array (collective)."""
    return _hvd.allgather(tf.constant(value), name=name).numpy()


def broadcast(value, root_rank, name=None):
    """``root_rank``'s ``value``, as a NumPy array (collective)."""
    return _hvd.broadcast(tf.constant(value), root_rank, name=name).numpy()


def reducescatter(value, name=None, op=Average):
    """``value`` reduced across ranks, this rank's block of rows, as a NumPy array (collective)."""
    return _hvd.reducescatter(tf.constant(value), op=op, name=name).numpy()


def load_model(filepath, custom_optimizers=None, custom_objects=None, compression=Compression.none):
    """Load a saved Keras model; its optimizer, state kept, then averages gradients as :func:`DistributedOptimizer`.

    The optimizer keeps its loaded slots: its class becomes the wrapped
    class (the same class with the averaging mixed in).
    """
    model = tf.keras.models.load_model(filepath, custom_objects=custom_objects)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and not isinstance(optimizer, _DistributedKerasOptimizer):
        wrapped = DistributedOptimizer(optimizer, compression=compression)
        optimizer.__class__ = type(wrapped)  # the loaded state stays; apply() now averages first
    return model

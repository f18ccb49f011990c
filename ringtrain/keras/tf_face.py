"""``ringtrain.keras`` on TensorFlow's backend: Keras 3 (``tf.keras`` on TF >= 2.16) and Keras 2 (``tf-keras``).

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
from ringtrain.tensorflow.gradients import source_key  # noqa: F401 - the callbacks use it
from ringtrain.tensorflow.keras_optimizer import (DistributedKerasOptimizer, DistributedOptimizer,
                                                  PartialDistributedOptimizer)

__all__ = ["Adasum", "Average", "Compression", "Max", "Min", "Product", "ProcessSet", "Sum", "add_process_set",
           "allgather_object", "barrier", "broadcast_object", "broadcast_variables", "cross_rank", "cross_size",
           "global_process_set", "init", "is_homogeneous", "is_initialized", "join", "local_rank", "local_size",
           "mpi_built", "mpi_enabled", "mpi_threads_supported", "rank", "remove_process_set", "shutdown", "size",
           "DistributedOptimizer", "PartialDistributedOptimizer", "broadcast_global_variables", "allreduce",
           "allgather", "broadcast", "reducescatter", "load_model"]

# What the callbacks (.callbacks) need from a face, beside its collectives: Keras 2's or Keras 3's base
# class (tf.keras is tf-keras under TF_USE_LEGACY_KERAS=1), source_key (a hashable key for a variable), sync_state.
Callback = tf.keras.callbacks.Callback


def sync_state(model):
    """Nothing to do: on TensorFlow a model's variables always hold its state (JAX's ``fit`` keeps it apart)."""


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
    if optimizer is not None and not isinstance(optimizer, DistributedKerasOptimizer):
        wrapped = DistributedOptimizer(optimizer, compression=compression)
        optimizer.__class__ = type(wrapped)  # the loaded state stays; apply() now averages first
    return model

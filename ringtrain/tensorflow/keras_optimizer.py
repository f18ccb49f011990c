"""Horovod's ``DistributedOptimizer`` for Keras optimizers: Keras 3's, and Keras 2's (``tf-keras``).

The wrapped optimizer is a copy of the user's (same class and config, made
with ``from_config``) whose class mixes in :class:`DistributedKerasOptimizer`:
the gradients are averaged across the process set in ``apply`` (Keras 3) or
``apply_gradients`` (Keras 2), in one grouped allreduce per step, before the
wrapped update; ``model.fit`` and custom loops both go through it. On
TensorFlow's backend Keras runs ``fit``'s step in a ``tf.function``: the
allreduce is then a graph op (:mod:`ringtrain.tensorflow.mpi_ops`). Keras's
``jit_compile`` must stay off (Keras turns it off on CPU-only machines):
XLA cannot compile a Python function.

Collective: every rank must step the same optimizer at the same steps.
"""

import tensorflow as tf

from .compression import Compression
from .gradients import check_arguments, make_allreduce_grads_fn, reduce_with_locals, source_key
from .mpi_ops import Average, global_process_set

__all__ = ["DistributedKerasOptimizer", "DistributedOptimizer", "CallableList"]


class DistributedKerasOptimizer:
    """What a wrapped Keras optimizer gains (mixed in before its own class; settings in the class's ``_hvd``)."""

    _hvd = None  # (allreduce_grads, process_set, scale_local_gradients), set on the class made for each wrap

    @property
    def variables(self):
        """The optimizer's variables, as a list that may also be called (``opt.variables()``, Keras 2's spelling)."""
        found = super().variables
        return CallableList(found() if callable(found) else found)

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


class CallableList(list):
    """A list that returns itself when called: ``opt.variables`` (Keras 3) and ``opt.variables()`` (Keras 2)."""

    def __call__(self):
        return self


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
    cls = type(base.__name__, (DistributedKerasOptimizer, base),
               {"__module__": base.__module__, "_hvd": (fn, process_set, scale_local_gradients)})
    return cls.from_config(optimizer.get_config())

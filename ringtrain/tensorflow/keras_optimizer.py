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
from .aggregation import LocalGradientAggregator, check_backward_passes
from .gradients import check_arguments, layers_list, make_allreduce_grads_fn, reduce_with_locals, source_key
from .mpi_ops import Average, Sum, global_process_set

__all__ = ["DistributedKerasOptimizer", "DistributedOptimizer", "PartialDistributedOptimizer", "CallableList"]


class DistributedKerasOptimizer:
    """What a wrapped Keras optimizer gains (mixed in before its own class; settings in the class's ``_hvd``)."""

    _hvd = None  # (allreduce_grads, process_set, scale_local_gradients), set on the class made for each wrap
    _hvd_passes = (1, False, False)  # (backward_passes_per_step, sparse_as_dense, average_aggregated_gradients)

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

    @property
    def _agg_helper(self):
        """The :class:`LocalGradientAggregator` when ``backward_passes_per_step > 1``, else None (Horovod's name)."""
        passes, sparse_as_dense, average = self._hvd_passes
        if passes == 1:
            return None
        if "_hvd_aggregator" not in self.__dict__:
            self.__dict__["_hvd_aggregator"] = LocalGradientAggregator(passes, self._hvd_reduce, sparse_as_dense,
                                                                       average)
        return self.__dict__["_hvd_aggregator"]

    def _hvd_gradients(self, grads, variables):
        """The gradients to apply: reduced now (N = 1), or accumulated and reduced on every N-th pass."""
        aggregator = self._agg_helper
        if aggregator is None:
            return self._hvd_reduce(grads, variables)
        return aggregator.compute_gradients(grads, variables)

    def _hvd_apply(self, apply, grads):
        """``apply()`` now (N = 1), or only after every N-th pass (collective on that pass)."""
        aggregator = self._agg_helper
        return apply() if aggregator is None else aggregator.apply_gradients(apply, self, grads)

    def apply(self, grads, trainable_variables=None):
        """Keras 3: average ``grads`` across the process set, then the wrapped update (collective)."""
        variables = self._trainable_variables if trainable_variables is None else trainable_variables
        grads = list(grads)
        if self._agg_helper is not None and not self.built:
            self.build(variables)  # outside the tf.cond below: Keras makes its slots here
        reduced = self._hvd_gradients(grads, variables)
        return self._hvd_apply(lambda: super(DistributedKerasOptimizer, self).apply(reduced, trainable_variables),
                               reduced)

    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        """The wrapped ``apply_gradients``; Keras 2 optimizers average the gradients here first (collective).

        Gradients that this optimizer's ``compute_gradients`` (or ``_compute_gradients``,
        ``get_gradients``) returned for this step are already reduced, as in Horovod.
        """
        if _KERAS_3 and isinstance(self, _keras_base()):
            return super().apply_gradients(grads_and_vars, *args, **kwargs)
        pairs = list(grads_and_vars)
        grads, variables = [g for g, _ in pairs], [v for _, v in pairs]
        if not self.__dict__.pop("_hvd_reduced", False):
            grads = self._hvd_gradients(grads, variables)
        return self._hvd_apply(lambda: super(DistributedKerasOptimizer, self).apply_gradients(
            list(zip(grads, variables)), *args, **kwargs), grads)

    def _compute_gradients(self, loss, var_list, grad_loss=None, tape=None):
        """Keras 2: the wrapped optimizer's gradients, reduced across the process set (Horovod's; collective).

        The next ``apply_gradients`` takes them as they are (they are not reduced twice).
        """
        base = super()
        tape = tf.GradientTape() if tape is None else tape
        if hasattr(base, "_compute_gradients"):
            pairs = base._compute_gradients(loss, var_list, grad_loss, tape=tape)
        else:
            pairs = base.compute_gradients(loss, var_list, tape=tape)
        pairs = list(pairs)
        variables = [v for _, v in pairs]
        grads = self._hvd_gradients([g for g, _ in pairs], variables)
        self.__dict__["_hvd_reduced"] = True
        return list(zip(grads, variables))

    def compute_gradients(self, loss, var_list, tape=None):
        """Keras 2: as :meth:`_compute_gradients` (Horovod's; collective)."""
        return self._compute_gradients(loss, var_list, None, tape)

    def get_gradients(self, loss, params):
        """Keras 2's legacy optimizers: the wrapped ``get_gradients``, reduced (Horovod's; collective)."""
        grads = self._hvd_gradients(super().get_gradients(loss, params), params)
        self.__dict__["_hvd_reduced"] = True
        return grads


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

    With ``backward_passes_per_step`` N > 1, the gradients of N passes are
    summed locally and reduced, then applied, on every N-th pass (divided by N
    when ``average_aggregated_gradients``); see :mod:`.aggregation`.

    Raises:
        NotImplementedError: ``op=Adasum``.
        ValueError: ``backward_passes_per_step < 1``.
    """
    groups = check_arguments(op, gradient_predivide_factor, num_groups, groups)
    passes = check_backward_passes(backward_passes_per_step)
    fn = make_allreduce_grads_fn(name or f"Distributed{type(optimizer).__name__}", device_dense, device_sparse,
                                 compression, sparse_as_dense, op, gradient_predivide_factor, groups, process_set)
    base = type(optimizer)
    cls = type(base.__name__, (DistributedKerasOptimizer, base),
               {"__module__": base.__module__, "_hvd": (fn, process_set, scale_local_gradients),
                "_hvd_passes": (passes, sparse_as_dense, average_aggregated_gradients)})
    return cls.from_config(optimizer.get_config())


def PartialDistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="",  # noqa: N802 - Horovod's
                                compression=Compression.none, sparse_as_dense=False, gradient_predivide_factor=1.0,
                                op=Average, groups=None, process_set=global_process_set, local_layers=None,
                                scale_local_gradients=True):
    """A :func:`DistributedOptimizer` that keeps the gradients of ``local_layers``' weights local (Horovod's).

    Those gradients are not reduced; with ``scale_local_gradients`` they are
    divided by the process set's size, as Horovod does.
    """
    if op not in (Average, Sum):
        raise ValueError("op currently only supports Average and Sum")
    local_layers = layers_list(local_layers)
    wrapped = DistributedOptimizer(optimizer, name, device_dense, device_sparse, compression, sparse_as_dense,
                                   gradient_predivide_factor, op, groups=groups, process_set=process_set,
                                   scale_local_gradients=scale_local_gradients)
    for layer in local_layers:
        for var in layer.trainable_weights:
            wrapped.register_local_var(var)
    return wrapped

"""Gradients averaged across ranks: ``DistributedGradientTape``, the TF1 ``DistributedOptimizer``, and the reduction.

:func:`make_allreduce_grads_fn` is the one reduction every wrapper uses
(Horovod's ``_make_allreduce_grads_fn``): dense gradients go in **one**
grouped allreduce (one op, so a ``tf.function`` has one collective per step,
fused in the op layer), ``tf.IndexedSlices`` as Horovod reduces them
(allgathers of values and indices) unless ``sparse_as_dense``. Gradients of
*local* sources (registered with ``register_local_source``, or a
:func:`PartialDistributedGradientTape`'s ``local_layers``) are not reduced
and, as in Horovod, are divided by the set's size when
``scale_local_gradients`` is on.

Collective: every member of the process set must compute gradients for the
same sources, in the same order, at the same steps.
"""

import warnings

import tensorflow as tf

from .aggregation import LocalGradientAggregator, check_backward_passes
from .compression import Compression
from .mpi_ops import Adasum, Average, global_process_set
from .reduce import grouped_allreduce

__all__ = ["make_allreduce_grads_fn", "DistributedGradientTape", "PartialDistributedGradientTape",
           "DistributedOptimizer", "check_arguments", "source_key"]


def source_key(variable):
    """A hashable key for a variable: TensorFlow's ``ref()``, or the object itself for a Keras 3 Variable.

    Keras 3's ``Variable`` has no ``ref()`` (the ``AttributeError`` Horovod
    0.28.1 fails with on TensorFlow >= 2.16); it hashes by identity.
    """
    ref = getattr(variable, "ref", None)
    return ref() if ref is not None else ("object", id(variable))


def check_arguments(op, gradient_predivide_factor, num_groups, groups):
    """Horovod's argument checks; the groups to use (``num_groups`` is its deprecated spelling)."""
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed in v0.23.0.",
                      DeprecationWarning, stacklevel=3)
        groups = num_groups if groups is None else groups
    if groups is not None and not (isinstance(groups, list) or groups > 0):
        raise ValueError("groups should be a non-negative integer or a list of list of tf.Variable.")
    return groups


def make_allreduce_grads_fn(name, device_dense, device_sparse, compression, sparse_as_dense, op,
                            gradient_predivide_factor, groups, process_set=global_process_set):
    """``allreduce_grads(grads, vars=None, use_generic_names=False)``: the reduced gradients, None kept as None.

    ``groups`` (Horovod's explicit fusion groups) is accepted: every dense
    gradient already travels in one grouped op.
    """
    del device_dense, device_sparse, groups
    prescale, postscale = 1.0, 1.0
    if op == Average and gradient_predivide_factor != 1.0:
        # Horovod's split average: 1/f before the sum, f/size after it (Average divides by size).
        prescale, postscale = 1.0 / gradient_predivide_factor, gradient_predivide_factor
    if op == Adasum:
        raise NotImplementedError("op=hvd.Adasum is not implemented by ringtrain.tensorflow; use hvd.Average")

    def allreduce_grads(grads, vars=None, use_generic_names=False):  # noqa: A002 - Horovod's keyword
        ps = global_process_set if process_set is None else process_set
        if not ps.included() or ps.size() == 1:
            return list(grads)
        grads = [tf.convert_to_tensor(g) if sparse_as_dense and isinstance(g, tf.IndexedSlices) else g
                 for g in grads]
        present = [i for i, g in enumerate(grads) if g is not None]
        out = list(grads)
        if present:
            with tf.name_scope(f"{name}_Allreduce"):
                reduced = grouped_allreduce([grads[i] for i in present], compression=compression, op=op,
                                            prescale_factor=prescale, postscale_factor=postscale,
                                            process_set=process_set)
            for i, g in zip(present, reduced):
                out[i] = g
        return out

    return allreduce_grads


def reduce_with_locals(allreduce_grads, grads, sources, local_refs, process_set, scale_local_gradients):
    """Reduce the gradients of the sources that are not local; scale the local ones by 1/size (Horovod's rule)."""
    shared = [i for i, s in enumerate(sources) if source_key(s) not in local_refs]
    reduced = allreduce_grads([grads[i] for i in shared], [sources[i] for i in shared])
    out = list(grads)
    for i, g in zip(shared, reduced):
        out[i] = g
    if scale_local_gradients and local_refs:
        n = (global_process_set if process_set is None else process_set).size()
        for i, s in enumerate(sources):
            g = out[i]
            if source_key(s) in local_refs and g is not None:
                if isinstance(g, tf.IndexedSlices):
                    out[i] = tf.IndexedSlices(g.values / n, g.indices, g.dense_shape)
                else:
                    out[i] = g / tf.cast(n, g.dtype)
    return out


class _DistributedTape:
    """What a wrapped ``tf.GradientTape`` gains (mixed in before its own class)."""

    def _setup(self, allreduce_grads, process_set, scale_local_gradients):
        self._allreduce_grads = allreduce_grads
        self.process_set = process_set
        self.scale_local_gradients = scale_local_gradients
        self._local_sources = set()

    def register_local_source(self, source):
        """Keep ``source``'s gradient local: not reduced (scaled by 1/size when ``scale_local_gradients``)."""
        self._local_sources.add(source_key(source))

    def gradient(self, target, sources, output_gradients=None, use_generic_names=False, **kwargs):
        """The wrapped tape's gradients, reduced across the process set (collective)."""
        grads = super().gradient(target, sources, output_gradients, **kwargs)
        flat_sources, flat_grads = tf.nest.flatten(sources), tf.nest.flatten(grads, expand_composites=False)
        reduced = reduce_with_locals(self._allreduce_grads, flat_grads, flat_sources, self._local_sources,
                                     self.process_set, self.scale_local_gradients)
        return tf.nest.pack_sequence_as(grads, reduced)

    def get_local_and_global_gradients(self, target, sources, output_gradients=None, use_generic_names=False):
        """``([(local source, grad)], [(shared source, grad)])``, the gradients as :meth:`gradient` gives them."""
        grads = self.gradient(target, sources, output_gradients, use_generic_names)
        local, shared = [], []
        for s, g in zip(sources, grads):
            (local if source_key(s) in self._local_sources else shared).append((s, g))
        return local, shared


def DistributedGradientTape(gradtape, device_dense="", device_sparse="",  # noqa: N802 - Horovod's name
                            compression=Compression.none, sparse_as_dense=False, op=Average,
                            gradient_predivide_factor=1.0, num_groups=0, groups=None,
                            process_set=global_process_set, scale_local_gradients=True):
    """A tape whose ``gradient()`` averages the gradients across the process set (Horovod's signature).

    Args:
        gradtape: a ``tf.GradientTape`` that recorded the forward pass.
        compression: ``Compression.none`` or ``Compression.fp16``.
        sparse_as_dense: reduce ``IndexedSlices`` gradients as dense tensors.
        op: ``Average`` (default), ``Sum``, ``Min``, ``Max``.
        gradient_predivide_factor: with ``Average``, scale by ``1/f`` before the sum and ``f/size`` after.
        num_groups, groups: Horovod's explicit fusion groups (accepted; one op fuses every gradient).
        process_set: reduce over this process set (default: every rank).
        scale_local_gradients: divide the gradients of local sources by the set's size.
    """
    groups = check_arguments(op, gradient_predivide_factor, num_groups, groups)
    cls = type(type(gradtape).__name__, (_DistributedTape, type(gradtape)), {"__module__": __name__})
    tape = cls(gradtape._persistent, gradtape._watch_accessed_variables)
    tape._tape = gradtape._tape  # the recorded forward pass: the wrapper computes from it
    tape._setup(make_allreduce_grads_fn("DistributedGradientTape", device_dense, device_sparse, compression,
                                        sparse_as_dense, op, gradient_predivide_factor, groups, process_set),
                process_set, scale_local_gradients)
    return tape


def layers_list(local_layers):
    """``local_layers`` (None, one layer, or a list or tuple of them) as a list; ValueError, as Horovod's, for a
    value that is no layer."""
    if local_layers is None:
        return []
    if not isinstance(local_layers, (list, tuple)):
        local_layers = [local_layers]
    if not all(hasattr(layer, "trainable_weights") for layer in local_layers):
        raise ValueError("All local layers must be of tf.keras.layers.Layer type.")
    return list(local_layers)


def PartialDistributedGradientTape(gradtape, device_dense="", device_sparse="",  # noqa: N802 - Horovod's name
                                   compression=Compression.none, sparse_as_dense=False, op=Average,
                                   gradient_predivide_factor=1.0, num_groups=0, groups=None,
                                   process_set=global_process_set, local_layers=None, scale_local_gradients=True):
    """A :func:`DistributedGradientTape` that keeps the gradients of ``local_layers``' weights local."""
    local_layers = layers_list(local_layers)
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression, sparse_as_dense, op,
                                   gradient_predivide_factor, num_groups, groups, process_set, scale_local_gradients)
    for layer in local_layers:
        for var in layer.trainable_weights:
            tape.register_local_source(var)
    return tape


class _LegacyDistributedOptimizer(tf.compat.v1.train.Optimizer):
    """A TF1 ``tf.compat.v1.train.Optimizer`` whose ``compute_gradients`` reduces across the process set."""

    def __init__(self, optimizer, name, use_locking, allreduce_grads, process_set, scale_local_gradients,
                 aggregation=(1, False, False)):
        super().__init__(name=name or f"Distributed{type(optimizer).__name__}", use_locking=use_locking)
        self._optimizer = optimizer
        self._allreduce_grads = allreduce_grads
        self.process_set = process_set
        self.scale_local_gradients = scale_local_gradients
        self._local_vars = set()
        passes, sparse_as_dense, average = aggregation
        self._agg_helper = None if passes == 1 else LocalGradientAggregator(passes, self._reduce, sparse_as_dense,
                                                                            average)

    def _reduce(self, grads, variables):
        return reduce_with_locals(self._allreduce_grads, list(grads), list(variables), self._local_vars,
                                  self.process_set, self.scale_local_gradients)

    def register_local_var(self, var):
        """Keep ``var``'s gradient local (not reduced)."""
        self._local_vars.add(source_key(var))

    def compute_gradients(self, *args, **kwargs):
        """The wrapped optimizer's gradients, reduced across the process set (collective)."""
        pairs = self._optimizer.compute_gradients(*args, **kwargs)
        grads, variables = [list(t) for t in zip(*pairs)] if pairs else ([], [])
        if self._agg_helper is not None:
            return list(zip(self._agg_helper.compute_gradients(grads, variables), variables))
        return list(zip(self._reduce(grads, variables), variables))

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        """The wrapped optimizer's ``apply_gradients`` (with ``backward_passes_per_step`` N, on every N-th pass)."""
        if self._agg_helper is None:
            return self._optimizer.apply_gradients(grads_and_vars, global_step=global_step, name=name)
        grads_and_vars = list(grads_and_vars)
        applied = self._agg_helper.apply_gradients(
            lambda: self._optimizer.apply_gradients(grads_and_vars, global_step=global_step, name=name),
            self._optimizer, [g for g, _ in grads_and_vars], global_step)
        return applied if tf.executing_eagerly() else tf.group(applied)

    def get_slot(self, *args, **kwargs):
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args, **kwargs):
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args, **kwargs):
        return self._optimizer.variables(*args, **kwargs)


def DistributedOptimizer(optimizer, name=None, use_locking=False, device_dense="",  # noqa: N802 - Horovod's name
                         device_sparse="", compression=Compression.none, sparse_as_dense=False,
                         backward_passes_per_step=1, op=Average, gradient_predivide_factor=1.0,
                         average_aggregated_gradients=False, num_groups=0, groups=None,
                         process_set=global_process_set, scale_local_gradients=True):
    """Wrap a TF1 optimizer (``tf.compat.v1.train.Optimizer``); ``hvd.DistributedOptimizer`` sends Keras ones on.

    With ``backward_passes_per_step`` N > 1 the gradients of N passes are summed
    locally, reduced and applied on every N-th pass (:mod:`.aggregation`), in
    TF1 graphs as in Horovod, and eagerly too (where Horovod refuses).

    Raises:
        NotImplementedError: ``op=Adasum``.
        ValueError: ``backward_passes_per_step < 1``.
    """
    groups = check_arguments(op, gradient_predivide_factor, num_groups, groups)
    passes = check_backward_passes(backward_passes_per_step)
    fn = make_allreduce_grads_fn(name or "DistributedOptimizer", device_dense, device_sparse, compression,
                                 sparse_as_dense, op, gradient_predivide_factor, groups, process_set)
    return _LegacyDistributedOptimizer(optimizer, name, use_locking, fn, process_set, scale_local_gradients,
                                       (passes, sparse_as_dense, average_aggregated_gradients))

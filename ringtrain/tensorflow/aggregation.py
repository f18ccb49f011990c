"""Local gradient aggregation: ``backward_passes_per_step``, as Horovod's ``DistributedOptimizer`` does it.

Each backward pass adds its gradients to a local accumulator (one variable
per gradient, this rank's own) and counts the pass; the N-th pass reduces
the accumulated gradients across the process set (one grouped allreduce,
the same reduction as at N = 1), divides them by N when
``average_aggregated_gradients`` and sets the count back to 0; the next pass
starts the accumulators from zero. The wrapped optimizer applies only when the count is 0, that is
after the N-th pass; on the other passes its ``iterations`` (and a TF1
``global_step``) still advance, as in Horovod. Collectives run on the N-th
pass only, so every member must make the same number of passes.

Eager, inside ``tf.function`` and in TF1 graphs: the counter and the
accumulators are ``tf.Variable``s created outside any function
(``tf.init_scope``) on the first pass, and the two choices are ``tf.cond``s,
so one trace serves every pass. The names ``counter``,
``locally_aggregated_grads``, ``compute_gradients`` and ``apply_gradients``
are Horovod's helper's (its tests read ``opt._agg_helper.counter``).
"""

import tensorflow as tf

__all__ = ["LocalGradientAggregator", "check_backward_passes"]


def check_backward_passes(backward_passes_per_step):
    """``backward_passes_per_step`` as an int, or ValueError (Horovod's message) when it is not positive."""
    if int(backward_passes_per_step) <= 0:
        raise ValueError("backward_passes_per_step must be > 0")
    return int(backward_passes_per_step)


def _dense(grad, sparse_as_dense):
    """``grad``, an ``IndexedSlices`` made dense when ``sparse_as_dense`` (else Horovod's ValueError)."""
    if isinstance(grad, tf.IndexedSlices):
        if not sparse_as_dense:
            raise ValueError("IndexedSlices are not supported when `backward_passes_per_step` > 1 and "
                             "`sparse_as_dense` is False.")
        return tf.convert_to_tensor(grad)
    return grad


def _after(result, value):
    """``value`` (a tensor) that runs after ``result``'s ops: TF1 graphs keep a cond branch's effects only so."""
    if tf.executing_eagerly():
        return value
    deps = [r if isinstance(r, tf.Operation) else r.op for r in tf.nest.flatten(result)
            if isinstance(r, tf.Operation) or isinstance(getattr(r, "op", None), tf.Operation)]
    with tf.control_dependencies(deps):
        return tf.identity(value)


class LocalGradientAggregator:
    """Accumulates gradients over ``passes`` backward passes; reduces and applies on the last one.

    Args:
        passes: backward passes per optimizer step (>= 1).
        reduce: ``reduce(grads, variables) -> grads``, the reduction across the
            process set (local variables kept local); collective.
        sparse_as_dense: make ``IndexedSlices`` gradients dense (else they are refused).
        average: divide the reduced sum of the passes by ``passes``.
    """

    def __init__(self, passes, reduce, sparse_as_dense, average):
        self.backward_passes_per_step = check_backward_passes(passes)
        self.average_aggregated_gradients = average
        self.sparse_as_dense = sparse_as_dense
        self._reduce = reduce
        self.counter = None
        self.locally_aggregated_grads = {}  # gradient's index -> its accumulator

    def _build(self, grads, variables):
        """The counter, and an accumulator for each gradient that is not None, made once outside any function."""
        with tf.init_scope():
            if self.counter is None:
                self.counter = tf.Variable(0, dtype=tf.int32, trainable=False, name="aggregation_counter")
            for i, (g, v) in enumerate(zip(grads, variables)):
                if g is not None and i not in self.locally_aggregated_grads:
                    shape = g.shape if g.shape.is_fully_defined() else tf.TensorShape(v.shape)
                    self.locally_aggregated_grads[i] = tf.Variable(tf.zeros(shape, g.dtype), trainable=False,
                                                                   name=f"aggregated_gradient_{i}")

    def compute_gradients(self, grads, variables):
        """Add ``grads`` to the accumulators; on the N-th pass, their reduction (collective then).

        Returns:
            one gradient per input (None stays None): the accumulated sums on the
            passes that do not reduce, the reduced (and maybe averaged) sums on the N-th.
        """
        grads = [None if g is None else _dense(g, self.sparse_as_dense) for g in grads]
        variables = list(variables)
        self._build(grads, variables)
        present = [i for i, g in enumerate(grads) if g is not None]
        graph = not tf.executing_eagerly()
        # The first pass of a step starts from zero. Cleared here rather than after the N-th pass's
        # reduction: in a TF1 graph that clear could overwrite the sums the apply was still to read.
        cleared = tf.cond(tf.equal(self.counter, 0), lambda: _after(self._zero(present), tf.constant(True)),
                          lambda: tf.constant(False))
        with tf.control_dependencies([cleared] if graph else []):
            added = [self.locally_aggregated_grads[i].assign_add(grads[i]) for i in present]
        with tf.control_dependencies(added if graph else []):
            count = self.counter.assign_add(1, read_value=True)
            sums = [tf.identity(self.locally_aggregated_grads[i].read_value()) for i in present]
        if not present:
            return list(grads)
        chosen = tf.cond(tf.equal(count, self.backward_passes_per_step),
                         lambda: self._reduce_and_restart(sums, [variables[i] for i in present]),
                         lambda: list(sums))
        out = list(grads)
        for i, g in zip(present, tf.nest.flatten(chosen)):
            out[i] = g
        return out

    def _zero(self, present):
        return [self.locally_aggregated_grads[i].assign(tf.zeros_like(self.locally_aggregated_grads[i]))
                for i in present]

    def _reduce_and_restart(self, sums, variables):
        """The N-th pass: reduce the sums across the process set, then set the count back to 0."""
        reduced = self._reduce(sums, variables)
        if self.average_aggregated_gradients:
            reduced = [g / tf.cast(self.backward_passes_per_step, g.dtype) for g in reduced]
        with tf.control_dependencies(reduced if not tf.executing_eagerly() else []):
            restarted = self.counter.assign(0)
        return [_after(restarted, g) for g in reduced]

    def is_aggregation_step(self):
        """A boolean tensor: True after the N-th pass, when the wrapped optimizer applies."""
        return tf.equal(self.counter, 0)

    def apply_gradients(self, apply, optimizer, grads=(), global_step=None):
        """``apply()`` after the N-th pass; on the others advance ``optimizer.iterations`` (and ``global_step``).

        Args:
            apply: the wrapped optimizer's apply, a function of no arguments.
            optimizer: the optimizer whose ``iterations`` advance on the other passes.
            grads: this pass's gradients from :meth:`compute_gradients`: in a TF1
                graph the counter is read after them (after this pass counted).
            global_step: a TF1 ``global_step`` to advance on the other passes.

        Returns:
            a boolean tensor, True where the step applied, that runs after the chosen branch's effects.
        """
        def skip():
            steps = []
            iterations = getattr(optimizer, "iterations", None)
            if iterations is not None:
                steps.append(iterations.assign_add(1))
            if global_step is not None:
                steps.append(global_step.assign_add(tf.constant(1, dtype=global_step.dtype)))
            return _after(steps, tf.constant(False))

        if self.counter is None:  # no pass was counted: nothing to apply yet
            return skip()
        counted = [] if tf.executing_eagerly() else [g for g in grads if isinstance(g, tf.Tensor)]
        with tf.control_dependencies(counted):
            applies = self.is_aggregation_step()
        return tf.cond(applies, lambda: _after(apply(), tf.constant(True)), skip)

"""Horovod's ``SyncBatchNormalization``: batch statistics averaged across ranks while training.

A subclass of ``tf.keras.layers.BatchNormalization`` (Keras 3, or Keras 2
under ``TF_USE_LEGACY_KERAS=1``) whose per-batch moments are replaced by the
moments of every rank's batch together: each rank's mean and mean of
squares are averaged in one allreduce, and the variance is
``E[x^2] - E[x]^2``. With equal batches per rank, training matches one
process that sees the whole batch. Collective: every rank must call the
layer in training mode at the same steps.
"""

import tensorflow as tf

from .mpi_ops import Sum, allreduce_op, size

__all__ = ["SyncBatchNormalization"]


def _average_moments(mean, variance):
    if size() == 1:
        return mean, variance
    stacked = tf.stack([mean, variance + tf.math.square(mean)])
    summed = allreduce_op(stacked, op=Sum) / tf.cast(size(), stacked.dtype)
    group_mean, group_mean_of_square = tf.unstack(summed)
    return group_mean, group_mean_of_square - tf.math.square(group_mean)


class SyncBatchNormalization(tf.keras.layers.BatchNormalization):
    """Batch normalization whose statistics are synchronized across every rank during training.

    Args:
        fused: must be False or absent (Horovod's rule: the fused kernel computes its own moments).
        **kwargs: ``tf.keras.layers.BatchNormalization``'s arguments.
    """

    def __init__(self, fused=False, **kwargs):
        if fused in (True, None):
            raise ValueError("SyncBatchNormalization does not support fused=True.")
        kwargs.setdefault("name", "sync_batch_normalization")
        if "fused" in tf.keras.layers.BatchNormalization.__init__.__code__.co_varnames:
            kwargs["fused"] = False  # Keras 2 (tf-keras) has the argument; Keras 3 has none
        super().__init__(**kwargs)

    def _moments(self, *args, **kwargs):
        mean, variance = super()._moments(*args, **kwargs)
        return _average_moments(mean, variance)

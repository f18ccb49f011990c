"""Horovod's Keras elastic names: ``KerasState`` and the callbacks that keep a state's epoch and batch."""

import tensorflow as tf

from ringtrain.tensorflow.elastic import ObjectState, TensorFlowKerasState, run

__all__ = ["KerasState", "ObjectState", "run", "CommitStateCallback", "UpdateBatchStateCallback",
           "UpdateEpochStateCallback"]

KerasState = TensorFlowKerasState


class CommitStateCallback(tf.keras.callbacks.Callback):
    """Commit ``state`` every ``batches_per_commit`` batches."""

    def __init__(self, state, batches_per_commit=1):
        super().__init__()
        self.state = state
        self.batches_per_commit = batches_per_commit
        self.batches_remaining = batches_per_commit

    def on_batch_end(self, batch, logs=None):
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.state.commit()
            self.batches_remaining = self.batches_per_commit


class UpdateBatchStateCallback(tf.keras.callbacks.Callback):
    """Keep ``state.batch`` at the batch in progress (0 at each epoch's start)."""

    def __init__(self, state):
        super().__init__()
        self.state = state

    def on_batch_end(self, batch, logs=None):
        self.state.batch = batch

    def on_epoch_end(self, epoch, logs=None):
        self.state.batch = 0


class UpdateEpochStateCallback(tf.keras.callbacks.Callback):
    """Keep ``state.epoch`` at the epoch in progress."""

    def __init__(self, state):
        super().__init__()
        self.state = state

    def on_epoch_end(self, epoch, logs=None):
        self.state.epoch = epoch + 1

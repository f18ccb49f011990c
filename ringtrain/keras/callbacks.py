"""Horovod's Keras callbacks: broadcast the start, average the metrics, schedule and warm up the learning rate.

Each works with Keras 3 (``keras`` / ``tf.keras`` on TF >= 2.16, and Keras 3's
torch and JAX backends) and Keras 2 (``tf-keras`` under ``TF_USE_LEGACY_KERAS=1``),
through the face :mod:`ringtrain.keras` runs on (:mod:`.backends`). Under JAX,
``fit`` keeps the variables' values apart during an epoch; the callbacks that
read or assign variables write that state back first (``sync_state``). The collective ones
(:class:`BroadcastGlobalVariablesCallback`, :class:`MetricAverageCallback`)
run at the same points of ``fit`` on every rank, so every rank must train
with them, in the same order.
"""

import numpy as np

from .backends import face

hvd = face()

__all__ = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback", "LearningRateScheduleCallback",
           "LearningRateWarmupCallback"]

Callback = hvd.Callback


def optimizer_variables(optimizer):
    """An optimizer's variables, in Keras 3 (a property) and Keras 2 (a method)."""
    found = optimizer.variables
    return list(found() if callable(found) else found)


def _lr_variable(optimizer):
    return optimizer.learning_rate if hasattr(optimizer, "learning_rate") else optimizer.lr


def get_lr(optimizer):
    """The optimizer's learning rate, as a float."""
    return float(np.asarray(_lr_variable(optimizer)))


def set_lr(optimizer, value):
    """Set the optimizer's learning rate (a variable in both Keras 3 and Keras 2)."""
    lr = _lr_variable(optimizer)
    if hasattr(lr, "assign"):
        lr.assign(value)
    else:
        optimizer.learning_rate = value


class BroadcastGlobalVariablesCallback(Callback):
    """Give every rank ``root_rank``'s weights and optimizer state at the start of training (collective).

    The model's variables are broadcast when training begins (if the model
    is built) and again, with the optimizer's, after the first batch, once
    the optimizer's slots exist, as Horovod does.
    """

    def __init__(self, root_rank, device="", local_variables=None):
        """``local_variables``: a variable or a list of them that each rank keeps its own (not broadcast)."""
        super().__init__()
        self.root_rank = root_rank
        self.device = device
        self.broadcast_done = False
        self._local_vars = set()
        if local_variables is None:
            local_variables = []
        elif not isinstance(local_variables, (list, tuple)):
            local_variables = [local_variables]
        if not all(hasattr(var, "assign") for var in local_variables):
            raise ValueError("All local variables must be of tf.Variable type.")
        for var in local_variables:
            self.register_local_var(var)

    def register_local_var(self, var):
        """Leave ``var`` out of the broadcast."""
        self._local_vars.add(hvd.source_key(var))

    def _model_variables(self):
        return [v for v in self.model.variables if hvd.source_key(v) not in self._local_vars]

    def on_train_begin(self, logs=None):
        if self.model.built:
            hvd.broadcast_variables(self._model_variables(), root_rank=self.root_rank)

    def on_batch_end(self, batch, logs=None):
        if self.broadcast_done:
            return
        hvd.sync_state(self.model)
        hvd.broadcast_variables(self._model_variables(), root_rank=self.root_rank)
        hvd.broadcast_variables(optimizer_variables(self.model.optimizer), root_rank=self.root_rank)
        self.broadcast_done = True


class MetricAverageCallback(Callback):
    """Average the epoch's metrics (``logs``) across ranks at the end of each epoch (collective)."""

    def __init__(self, device=""):
        super().__init__()
        self.device = device

    def on_epoch_end(self, epoch, logs=None):
        if not logs:
            return
        names = sorted(k for k, v in logs.items() if np.ndim(v) == 0)
        values = np.array([float(logs[k]) for k in names], np.float64)
        averaged = hvd.allreduce(values, op=hvd.Average, name="MetricAverageCallback")
        for k, v in zip(names, averaged):
            logs[k] = float(v)


class LearningRateScheduleCallback(Callback):
    """Set the learning rate to ``initial_lr * multiplier(epoch)`` from ``start_epoch`` to ``end_epoch``.

    Args:
        initial_lr: the learning rate the multiplier scales.
        multiplier: a number (``multiplier ** (epoch - start_epoch)``) or a function of the epoch.
        start_epoch, end_epoch: the epochs it applies to (``end_epoch`` excluded; None: to the end).
        staircase: change once per epoch; else every batch, with a fractional epoch.
        momentum_correction: scale the momentum with the learning rate for the step that changes it.
        steps_per_epoch: batches per epoch (default: from ``fit``'s parameters).
    """

    def __init__(self, initial_lr, multiplier, start_epoch=0, end_epoch=None, staircase=True,
                 momentum_correction=True, steps_per_epoch=None):
        super().__init__()
        if initial_lr is None:
            raise ValueError("Parameter `initial_lr` is required")
        self.initial_lr = initial_lr
        self.start_epoch, self.end_epoch = start_epoch, end_epoch
        self.staircase = staircase
        self.momentum_correction = momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.current_epoch = None
        self.restore_momentum = None
        self.multiplier = multiplier if callable(multiplier) else (
            lambda epoch: multiplier ** (epoch - start_epoch))

    def _steps(self):
        params = self.params or {}
        if params.get("steps"):
            return params["steps"]
        if params.get("samples") and params.get("batch_size"):
            return params["samples"] // params["batch_size"]
        raise ValueError(f"Could not autodetect the number of steps per epoch. Please specify the steps_per_epoch "
                         f"parameter to the {type(self).__name__}()")

    def _adjust(self, epoch):
        hvd.sync_state(self.model)
        optimizer = self.model.optimizer
        old = get_lr(optimizer)
        new = self.initial_lr * self.multiplier(epoch)
        set_lr(optimizer, new)
        momentum = getattr(optimizer, "momentum", None)
        if self.momentum_correction and momentum is not None and old:
            self.restore_momentum = float(np.asarray(momentum))
            _set_momentum(optimizer, self.restore_momentum * new / old)

    def on_train_begin(self, logs=None):
        if not self.staircase and not self.steps_per_epoch:
            self.steps_per_epoch = self._steps()

    def on_epoch_begin(self, epoch, logs=None):
        self.current_epoch = epoch

    def on_batch_begin(self, batch, logs=None):
        if self.current_epoch < self.start_epoch or (self.end_epoch is not None
                                                     and self.current_epoch >= self.end_epoch):
            return
        if self.staircase and batch == 0:
            self._adjust(self.current_epoch)
        elif not self.staircase:
            self._adjust(self.current_epoch + float(batch) / self.steps_per_epoch)

    def on_batch_end(self, batch, logs=None):
        if self.restore_momentum is not None:
            hvd.sync_state(self.model)
            _set_momentum(self.model.optimizer, self.restore_momentum)
            self.restore_momentum = None

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = get_lr(self.model.optimizer)


def _set_momentum(optimizer, value):
    momentum = optimizer.momentum
    if hasattr(momentum, "assign"):
        momentum.assign(value)
    else:
        optimizer.momentum = value


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Ramp the learning rate from ``initial_lr / size`` to ``initial_lr`` over ``warmup_epochs`` (Goyal et al.)."""

    def __init__(self, initial_lr, warmup_epochs=5, momentum_correction=True, steps_per_epoch=None, verbose=0):
        def multiplier(epoch):
            epoch += 1.0 / self.steps_per_epoch
            return 1.0 / hvd.size() * (epoch * (hvd.size() - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs, staircase=False,
                         momentum_correction=momentum_correction, steps_per_epoch=steps_per_epoch)
        self.verbose = verbose

    def on_epoch_end(self, epoch, logs=None):
        super().on_epoch_end(epoch, logs)
        if epoch == self.end_epoch - 1 and self.verbose > 0 and hvd.rank() == 0:
            print(f"\nEpoch {epoch + 1}: finished gradual learning rate warmup to {get_lr(self.model.optimizer):g}.")

"""``hvd.elastic`` for TensorFlow and Keras: states that commit, restore and sync, and ``run``.

The states keep Horovod's contract: ``commit()`` saves a copy in memory,
``restore()`` goes back to the last commit, ``sync()`` gives every rank rank
0's values (collective). ``run(func)`` syncs the state, then calls
``func(state, ...)``. An MPI world cannot lose or gain ranks, so a failure
ends the job (the failure model of :mod:`ringtrain.tensorflow.collectives`)
instead of a reset among the survivors; the restart from a commit on disk
that ``ringtrain.torch.elastic`` offers under ``ringtrain launch --min-np``
is not served by the TensorFlow face yet.
"""

import copy
import functools

import numpy as np

from .collectives import HorovodInternalError
from .functions import broadcast_object, broadcast_variables

__all__ = ["State", "ObjectState", "TensorFlowState", "TensorFlowKerasState", "run", "HorovodInternalError"]


class State:
    """What every state has: reset callbacks and ``commit`` (save, then check for host updates)."""

    def __init__(self):
        self._reset_callbacks = []

    def register_reset_callbacks(self, callbacks):
        """Functions to call after a reset (kept for Horovod's API; a failure here ends the job)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self):
        for callback in self._reset_callbacks:
            callback()

    def commit(self):
        """Save the state in memory, to go back to with :meth:`restore`."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self):
        """Nothing to do: the MPI world does not change under a running job."""

    def save(self):
        raise NotImplementedError

    def restore(self):
        raise NotImplementedError

    def sync(self):
        raise NotImplementedError


class ObjectState(State):
    """Plain attributes (``epoch=0, batch=0``): saved by deep copy, synced from rank 0 pickled."""

    def __init__(self, bcast_object=broadcast_object, get_rank=None, **kwargs):
        super().__init__()
        self._bcast_object = bcast_object
        self._saved_state = dict(kwargs)
        for name, value in kwargs.items():
            setattr(self, name, value)

    def save(self):
        self._saved_state = {name: copy.deepcopy(getattr(self, name)) for name in self._saved_state}

    def restore(self):
        for name, value in self._saved_state.items():
            setattr(self, name, copy.deepcopy(value))

    def sync(self):
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state, root_rank=0)
            self.restore()


class TensorFlowState(ObjectState):
    """TensorFlow variables and plain attributes."""

    def __init__(self, variables=None, **kwargs):
        self.variables = list(variables or [])
        self._values = None
        super().__init__(**kwargs)
        self._values = self._read()

    def _read(self):
        return [np.array(v.numpy() if hasattr(v, "numpy") else v, copy=True) for v in self.variables]

    def save(self):
        self._values = self._read()
        super().save()

    def restore(self):
        for v, value in zip(self.variables, self._values):
            v.assign(value)
        super().restore()

    def sync(self):
        broadcast_variables(self.variables, root_rank=0)
        self._values = self._read()
        super().sync()


class TensorFlowKerasState(TensorFlowState):
    """A Keras model's (and optimizer's) variables and plain attributes (Horovod's ``KerasState``)."""

    def __init__(self, model, optimizer=None, **kwargs):
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        variables = list(model.variables)
        if self.optimizer is not None:
            found = self.optimizer.variables
            variables += list(found() if callable(found) else found)
        super().__init__(variables, **kwargs)


def run(func):
    """Call ``func(state, *args, **kwargs)`` after syncing ``state`` from rank 0 (collective)."""
    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        state.sync()
        return func(state, *args, **kwargs)
    return wrapper

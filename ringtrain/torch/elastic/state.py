"""Horovod's elastic state: ``State``, ``ObjectState``, ``TorchState``, and their commits that outlive the process.

As in Horovod, ``commit()`` keeps a copy of the state in memory on every
rank (``restore()`` goes back to it) and checks for host changes; here it
also has rank 0 write that copy to disk, whole or not at all, when the job
runs under an elastic launcher (:class:`~ringtrain.torch.elastic.commits.CommitStore`).
A job the launcher restarts (on other hosts, at another size) finds the
last commit there: ``hvd.elastic.run`` restores it on rank 0 and ``sync()``
gives it to every rank.

Contract: ``commit()``, ``sync()`` and ``check_host_updates()`` are
collective: every rank calls them at the same point, as in Horovod. A
commit that rank 0 could not write raises the same error on every rank.
"""

import copy
import queue
import time

import torch

from ..errors import HostsUpdatedInterrupt
from ..functions import allgather_object, broadcast_object, broadcast_optimizer_state, broadcast_parameters
from ..runtime import rank, size
from .sampler import ElasticSampler

__all__ = ["State", "ObjectState", "TorchState", "StateHandler", "ModelStateHandler", "OptimizerStateHandler",
           "SamplerStateHandler", "CommitFailed", "get_handler_registry", "set_handler_registry"]


class CommitFailed(RuntimeError):
    """Rank 0 could not write a commit (raised on every rank, so none waits for the others)."""


class State:
    """State kept in step across workers, with Horovod's reset callbacks and host-update checks.

    Args:
        bcast_object: broadcasts a Python object from rank 0 (default :func:`~ringtrain.torch.broadcast_object`).
        get_rank: returns this worker's rank (default :func:`~ringtrain.torch.rank`).
    """

    def __init__(self, bcast_object=None, get_rank=None):
        self._bcast_object = bcast_object or broadcast_object
        self._rank = get_rank or rank
        self._host_messages = queue.Queue()
        self._last_updated_timestamp = 0
        self._reset_callbacks = []
        self._store = None  # where commits go; set by hvd.elastic.run under an elastic launcher
        self._sequence = 0  # the number of the last commit on disk
        self._restart_wanted = False  # the launcher's notice asked for a restart on new hosts
        self.last_write_seconds = None  # how long rank 0's last commit write took (what a commit costs)

    def register_reset_callbacks(self, callbacks):
        """Call each of ``callbacks`` after every reset: an in-process one, and a restart from a commit."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self):
        self._host_messages = queue.Queue()
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp, update_res):
        """Queue a host update (Horovod's notification hook; the launcher's notices arrive through the commit store)."""
        self._host_messages.put((timestamp, update_res))

    def commit(self):
        """Keep the state in memory, write it to disk on rank 0 (under a launcher), and check for host changes.

        Collective. Raises :class:`HostsUpdatedInterrupt` on every rank when
        the hosts changed, and :class:`CommitFailed` on every rank when rank
        0 could not write the commit (the previous commit stays on disk).
        """
        self.save()
        news = self._persist()
        try:
            self._check(news)
        except HostsUpdatedInterrupt as exc:
            exc.committed = True  # what the state holds now is on disk already
            raise

    def check_host_updates(self):
        """Raise :class:`HostsUpdatedInterrupt` on every rank when a host update arrived (collective)."""
        self._check(self._bcast_object(self._root_news(None)))

    def _root_news(self, error):
        """What rank 0 tells everyone at a check: its write error, and the newest host update it knows of."""
        if self._rank() != 0:
            return None
        newest, changes = self._last_updated_timestamp, set()
        while not self._host_messages.empty():
            stamp, update = self._host_messages.get()
            if stamp > newest:
                newest, changes = stamp, changes | set(_update_words(update))
        restart = False
        if self._store is not None:
            notice = self._store.notice()
            if notice is not None and notice[0] > self._store.generation:
                self._store.generation = notice[0]  # heard once
                newest, changes, restart = max(newest, self._last_updated_timestamp + 1), set(notice[1]), True
        return error, newest, sorted(changes), restart

    def _check(self, news):
        error, newest, changes, restart = news
        if error is not None:
            raise CommitFailed(error)
        previous, self._last_updated_timestamp = self._last_updated_timestamp, newest
        if newest > previous:
            self._restart_wanted = self._restart_wanted or restart
            raise HostsUpdatedInterrupt(set(changes) == {"removed"})

    def _persist(self, finished=False, result=None):
        """Rank 0 writes the saved state (collective: the others learn whether it worked).

        Every rank of an elastic launch has the same environment, so all
        agree on whether there is a store, and so on the sampler's gathers.
        """
        error = None
        if self._store is not None:
            snapshot = self._snapshot()  # collective for samplers
            if self._rank() == 0:
                started = time.perf_counter()
                try:
                    self._store.write(self._sequence + 1,
                                      {"state": snapshot, "finished": finished, "result": result}, size(), finished)
                    self._sequence += 1
                except Exception as exc:  # noqa: BLE001 - every rank must hear of it
                    error = f"rank 0 could not write the commit: {exc}"
                self.last_write_seconds = time.perf_counter() - started
        return self._bcast_object(self._root_news(error))

    def _snapshot(self):
        """The saved state in the form written to disk (subclasses add theirs)."""
        return {}

    def _load_snapshot(self, snapshot):
        """Make ``snapshot`` (read from disk on rank 0) the saved state; :meth:`restore` then applies it."""

    def save(self):
        """Keep the state in host memory."""
        raise NotImplementedError()

    def restore(self):
        """Go back to the last committed state, undoing changes since."""
        raise NotImplementedError()

    def sync(self):
        """Give every rank rank 0's state (collective)."""
        raise NotImplementedError()

    def reset(self):
        """Reset objects after a reset event, before they are synchronized."""


def _update_words(update):
    # Horovod's HostUpdateResult flags: 1 removed, 2 added.
    value = int(update)
    return [word for bit, word in ((1, "removed"), (2, "added")) if value & bit]


class ObjectState(State):
    """State made of plain Python objects, given as keyword arguments and kept as attributes.

    Args:
        bcast_object, get_rank: as for :class:`State` (Horovod passes them first).
        kwargs: the values to keep; ``state.name`` reads and sets each.
    """

    def __init__(self, bcast_object=None, get_rank=None, **kwargs):
        self._saved_state = kwargs
        self._set_attrs()
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    def save(self):
        self._saved_state = {name: getattr(self, name) for name in self._saved_state}

    def restore(self):
        self._set_attrs()

    def sync(self):
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def _set_attrs(self):
        for name, value in self._saved_state.items():
            setattr(self, name, value)

    def _snapshot(self):
        return {"objects": self._saved_state}

    def _load_snapshot(self, snapshot):
        saved = snapshot["objects"]
        if set(saved) != set(self._saved_state):
            raise ValueError(_mismatch("values", saved, self._saved_state))
        self._saved_state = saved


def _mismatch(what, then, now):
    return (f"the last commit holds the {what} {sorted(then)} but this state has {sorted(now)}; it was made by "
            "another program: remove the commit directory to start afresh")


class TorchState(ObjectState):
    """The state of a PyTorch training process: models, optimizers, samplers and plain values.

    Each keyword argument becomes an attribute; a ``torch.nn.Module``, a
    ``torch.optim.Optimizer`` or an :class:`ElasticSampler` is saved, restored
    and synchronized through its handler, anything else as a plain object.

    Args:
        model: a PyTorch model, or None.
        optimizer: a PyTorch optimizer (a ``DistributedOptimizer`` too), or None.
        kwargs: more values to keep.
    """

    def __init__(self, model=None, optimizer=None, **kwargs):
        kwargs.update(model=model, optimizer=optimizer)
        self._handlers, kwargs = _get_handlers(kwargs)
        for name, handler in self._handlers.items():
            setattr(self, name, handler.value)
        super().__init__(bcast_object=broadcast_object, get_rank=rank, **kwargs)

    def save(self):
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self):
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self):
        for handler in self._handlers.values():
            handler.sync()
        super().sync()

    def __setattr__(self, name, value):
        if hasattr(self, name) and name in self._handlers:
            self._handlers[name].set_value(value)
        super().__setattr__(name, value)

    def _snapshot(self):
        snapshot = super()._snapshot()
        snapshot["handlers"] = {name: handler.snapshot() for name, handler in self._handlers.items()}
        return snapshot

    def _load_snapshot(self, snapshot):
        handlers = snapshot.get("handlers", {})
        if set(handlers) != set(self._handlers):
            raise ValueError(_mismatch("objects", handlers, self._handlers))
        super()._load_snapshot(snapshot)
        for name, handler in self._handlers.items():
            handler.load_snapshot(handlers[name])


class StateHandler:
    """How one kind of object is saved, restored, synchronized and written to a commit."""

    def __init__(self, value):
        self.value = value

    def save(self):
        raise NotImplementedError()

    def restore(self):
        raise NotImplementedError()

    def sync(self):
        raise NotImplementedError()

    def snapshot(self):
        """The saved copy, as written to disk (collective where the copy differs between ranks)."""
        raise NotImplementedError(f"{type(self).__name__} cannot be written to a commit")

    def load_snapshot(self, snapshot):
        raise NotImplementedError(f"{type(self).__name__} cannot be read from a commit")

    def set_value(self, value):
        self.value = value
        self.save()


class ModelStateHandler(StateHandler):
    def __init__(self, model):
        super().__init__(model)
        self._saved_model_state = copy.deepcopy(self.value.state_dict())

    def save(self):
        self._saved_model_state = copy.deepcopy(self.value.state_dict())

    def restore(self):
        self.value.load_state_dict(self._saved_model_state)

    def sync(self):
        broadcast_parameters(self.value.state_dict(), root_rank=0)

    def snapshot(self):
        return self._saved_model_state

    def load_snapshot(self, snapshot):
        self._saved_model_state = snapshot


class OptimizerStateHandler(StateHandler):
    def __init__(self, optimizer):
        super().__init__(optimizer)
        self._saved_optimizer_state = copy.deepcopy(self.value.state_dict())

    def save(self):
        self._saved_optimizer_state = copy.deepcopy(self.value.state_dict())

    def restore(self):
        self.value.load_state_dict(self._saved_optimizer_state)

    def sync(self):
        broadcast_optimizer_state(self.value, root_rank=0)

    def snapshot(self):
        return self._saved_optimizer_state

    def load_snapshot(self, snapshot):
        self._saved_optimizer_state = snapshot


class SamplerStateHandler(StateHandler):
    """An :class:`ElasticSampler`: its position is every rank's samples since the partition, added up."""

    def __init__(self, sampler):
        super().__init__(sampler)
        self._saved_sampler_state = copy.deepcopy(self.value.state_dict())

    def save(self):
        self._saved_sampler_state = copy.deepcopy(self.value.state_dict())

    def restore(self):
        self.value.load_state_dict(self._saved_sampler_state)

    def sync(self):
        state = self.value.state_dict()
        state = ElasticSampler.merged(broadcast_object(state), allgather_object(state["local_done"]))
        self.value.load_state_dict(state)
        self.save()

    def snapshot(self):
        saved = self._saved_sampler_state
        return ElasticSampler.merged(saved, allgather_object(saved["local_done"]))

    def load_snapshot(self, snapshot):
        self._saved_sampler_state = snapshot


_handler_registry = [
    (torch.nn.Module, ModelStateHandler),
    (torch.optim.Optimizer, OptimizerStateHandler),
    (ElasticSampler, SamplerStateHandler),
]


def get_handler_registry():
    """The ``(type, handler class)`` pairs TorchState consults, first match wins."""
    return _handler_registry


def set_handler_registry(registry):
    """Replace the handler registry (Horovod's hook for objects of other kinds)."""
    global _handler_registry
    _handler_registry = registry


def _get_handlers(kwargs):
    handlers, rest = {}, {}
    for name, value in kwargs.items():
        for kind, handler in _handler_registry:
            if isinstance(value, kind):
                handlers[name] = handler(value)
                break
        else:
            rest[name] = value
    return handlers, rest

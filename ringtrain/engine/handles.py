"""Handles: a submitted op (:class:`Entry`), its completion (:class:`Pending`), what ``poll`` and ``synchronize`` take.

A handle is an int, as in Horovod, naming a :class:`Pending` op in this
process's table until :func:`synchronize` takes it out. ``synchronize``
does more than wait: when no other thread is running the op's process set,
the caller's own thread runs it (announces it, hears the leader's decision,
moves the bytes), so a blocking op costs no hand-off to a background thread.
"""

import itertools
import threading
import time

from .errors import HorovodInternalError

__all__ = ["Entry", "Pending", "Countdown", "register", "poll", "synchronize", "outcome", "outstanding"]

_table = {}
_counter = itertools.count(1)
_lock = threading.Lock()


class Entry:
    """One submitted op: its key, what is announced (its ``record``, ``info``) and what the kernel needs.

    ``where`` is what errors name it by (a string, or ``(name, process set)``
    made into one only when needed); ``local`` marks an op small enough for
    its data to go with its announcement.
    """

    __slots__ = ("key", "where", "kind", "record", "info", "args", "pending", "submitted", "local")

    def __init__(self, key, where, kind, record, info, args, pending, local=False):
        self.key, self.where, self.kind = key, where, kind
        self.record, self.info, self.args, self.pending = record, info, args, pending
        self.submitted = time.monotonic()
        self.local = local

    @property
    def label(self):
        """How errors name the op: ``allreduce 'loss'``, ``... on process set 2``."""
        if isinstance(self.where, str):
            return self.where
        name, set_id = self.where
        return f"{self.kind} {name!r}" + (f" on process set {set_id}" if set_id else "")


class Countdown:
    """Calls ``callback`` when :meth:`one` has been called ``n`` times, from any threads (at once if ``n`` is 0)."""

    def __init__(self, n, callback):
        self._left, self._callback, self._lock = n, callback, threading.Lock()
        if n == 0:
            callback()

    def one(self):
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            self._callback()


class Pending:
    """One submitted op's completion: set once, with a result or an error, by whichever thread ran it.

    ``channel`` is the process set's :class:`~ringtrain.engine.channel.Channel`
    (None for an op that needs no driving); ``finish_fn`` runs on the
    caller's thread in :func:`synchronize` (decompression, for example).
    The event a waiting thread sleeps on is made only when one waits: an op
    the caller's own thread runs never needs one.
    """

    __slots__ = ("finished", "result", "error", "finish_fn", "channel", "_event")

    def __init__(self, finish_fn=None):
        self.finished = False
        self.result = None
        self.error = None
        self.finish_fn = finish_fn
        self.channel = None
        self._event = None

    def succeed(self, result):
        self.result = result
        self.finished = True
        event = self._event  # read after the flag is set: a waiter that made it sooner is woken
        if event is not None:
            event.set()

    def fail(self, error):
        self.error = error
        self._finish()

    def _finish(self):
        self.finished = True
        event = self._event  # read after the flag is set: a waiter that made it sooner is woken
        if event is not None:
            event.set()

    def done(self):
        return self.finished

    def wait(self, timeout=None):
        """Wait until done (or ``timeout`` seconds); True when done."""
        if self.finished:
            return True
        with _lock:
            if self._event is None:
                self._event = threading.Event()
        if self.finished:  # finished before the event existed: nobody will set it
            return True
        return self._event.wait(timeout)

    def complete(self):
        """Run the op to completion on this thread if its process set is idle, else wait for it."""
        if self.channel is not None and not self.finished:
            self.channel.drive(self)
        # Waiting in slices keeps Ctrl-C working: a bare Event.wait() blocks signals.
        while not self.wait(0.5):
            pass


def register(pending):
    """Put ``pending`` in the table; return its handle."""
    handle = next(_counter)  # (a counter's next and a dict's item assignment are atomic: no lock needed)
    _table[handle] = pending
    return handle


def outstanding():
    """How many handles have not been synchronized."""
    return len(_table)


def poll(handle):
    """True when the op behind ``handle`` has finished, so :func:`synchronize` will not block."""
    pending = _table.get(handle)
    if pending is None:
        raise ValueError(f"poll: unknown handle {handle!r} (already synchronized?)")
    return pending.done()


def synchronize(handle):
    """Wait for the op behind ``handle``; return its output (a tensor, a list, or a tuple of tensors).

    Raises the op's error (a :class:`HorovodInternalError`, or its subclass for
    ranks that disagreed) if it failed. An unknown handle returns None, as in
    Horovod.
    """
    pending = _table.get(handle)
    if pending is None:
        return None
    try:
        pending.complete()
    finally:
        _table.pop(handle, None)
    return outcome(pending)


def outcome(pending):
    """A finished op's output (through its ``finish_fn``), or its error raised as :func:`synchronize` raises it."""
    if pending.error is not None:
        error = pending.error
        if not isinstance(error, RuntimeError):
            error = HorovodInternalError(str(error))
        raise error
    result = pending.result
    return pending.finish_fn(result) if pending.finish_fn is not None else result

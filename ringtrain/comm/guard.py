"""The library collectives' two promises: a time bound, and one thread at a time per communicator.

The trainer watches its own collectives (``--timeout``); a program that
calls :func:`ringtrain.allreduce` itself gets the same promise here. A
collective called on one rank only, or one whose peer raised and left, would
otherwise wait for ever inside MPI. With a timeout set, every public
collective is watched by a :class:`ringtrain.watchdog.Watchdog`: past the
bound, each waiting rank prints one line (the collective, and which call on
that communicator it was) and the job is ended with ``MPI_Abort``. The rank
to look at is the one that printed nothing: it was not in that collective.

Setting the bound (seconds; ``None`` turns it off, the default)::

    ringtrain.comm.set_timeout(60)                 # every later call on COMM_WORLD
    with ringtrain.comm.timeout(600, comm=sub):    # for a block, on one communicator
        ...
    RINGTRAIN_TIMEOUT=60 mpirun -np 4 python my_program.py   # the default, without changing code

Two threads in collectives on one communicator at once would pair one
thread's messages with another's on the other ranks: silently wrong results,
or a hang. The second thread to enter is refused with a
:class:`~ringtrain.errors.UsageError` that names both calls. (The overlapping
:class:`~ringtrain.comm.reducer.Reducer` reduces on a duplicate of the
communicator for this reason.)

:func:`collective` is the one line each public collective carries.
"""

import contextlib
import functools
import inspect
import math
import os
import threading
import weakref
from threading import get_ident

from ..environment import env_seconds
from ..errors import UsageError
from ..watchdog import Watchdog
from .state import state_of

__all__ = ["ENV", "set_timeout", "get_timeout", "timeout", "collective", "guard_of", "parse_timeout",
           "timeout_from_env"]

ENV = "RINGTRAIN_TIMEOUT"
HINT = ("a rank that printed no such line is not in this collective: it raised, returned or called another; "
        "raise ringtrain.comm.set_timeout() or RINGTRAIN_TIMEOUT if this is expected")

_GUARDS = weakref.WeakKeyDictionary()  # CommState -> _Guard: lives and dies with the communicator's state


def parse_timeout(value, what="timeout"):
    """``value`` as a timeout in seconds: a number > 0, or None for no bound (pure)."""
    if value is None:
        return None
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = math.nan
    if isinstance(value, bool) or not (math.isfinite(seconds) and seconds > 0):
        raise UsageError(f"{what} must be a number of seconds > 0, or None for no bound; got {value!r}",
                         everywhere=True)
    return seconds


# Longer than any job (so a longer bound means the same), and short enough for a select() or a thread's
# wait to be given without overflowing.
MAX_TIMEOUT = 1e9


def timeout_from_env(env=None):
    """The bound :data:`ENV` sets, or None when it is unset or empty (pure, given ``env``).

    Raises:
        EnvironmentValueError: (a UsageError, on every rank alike) for anything but a plain
            number of seconds > 0: a bound that is misspelt must not quietly be no bound.
    """
    seconds = env_seconds(os.environ if env is None else env, ENV, None, positive=True, fix="unset it for no bound",
                          everywhere=True)
    return None if seconds is None else min(seconds, MAX_TIMEOUT)


class _Guard:
    """One communicator's state, its watchdog, and the thread now in one of its collectives."""

    __slots__ = ("state", "timeout", "calls", "busy", "holder", "_dog", "__weakref__")

    def __init__(self, state):
        self.state = state
        self.timeout = timeout_from_env()
        self.calls = 0
        self.busy = threading.Lock()
        self.holder = None  # (thread id, collective) of the thread inside one
        self._dog = None

    def set_timeout(self, seconds):
        if self._dog is not None:
            self._dog.close()
            self._dog = None
        self.timeout = seconds

    def enter(self, who):
        """Mark this thread as in ``who`` on the communicator; True for the outermost collective.

        A nested call from the same thread (a collective made of collectives,
        such as ``average_gradients_``) returns False: the outer call is the
        one watched and the one whose exit releases. Another thread is refused.
        """
        if self.busy.acquire(False):
            self.holder = (threading.get_ident(), who)
            self.calls += 1
            if self.timeout is not None:
                try:
                    self._arm(who)
                except BaseException:
                    self.exit()
                    raise
            return True
        holder = self.holder
        if holder is not None and holder[0] == threading.get_ident():
            return False
        raise UsageError(f"{who}: another thread is in {holder[1] if holder else 'a collective'} on this "
                         "communicator; call ringtrain's collectives on one communicator from one thread at a time "
                         "(use a lock, or give each thread its own communicator with comm.Dup())")

    def _arm(self, who):
        if self._dog is None:
            self._dog = Watchdog(self.state.comm, self.timeout, hint=HINT)
            # The watchdog's thread ends with this guard (a freed communicator), not with the process.
            weakref.finalize(self, self._dog.close)
        self._dog.arm(f"{who} (call {self.calls} on this communicator)")

    def exit(self):
        """Leave the outermost collective: disarm, and let another thread in."""
        if self._dog is not None:
            self._dog.disarm()
        self.holder = None
        self.busy.release()

    def call(self, who, function, *args, **kwargs):
        """``function(*args, **kwargs)`` as the collective ``who``: watched, and one thread at a time.

        The general path. The common one (no bound set, no call inside) is
        written inline by the callers on the small-call path, where this
        method's own cost would show: take ``busy`` without waiting, set
        ``holder`` and count the call, run, then clear ``holder`` and release.
        """
        if not self.enter(who):
            return function(*args, **kwargs)  # nested in this thread's own collective
        try:
            return function(*args, **kwargs)
        finally:
            self.exit()


def guard_of(comm):
    """The guard of ``comm`` (default ``MPI.COMM_WORLD``); its ``state`` is the communicator's CommState.

    One lookup gives both: a collective asks for nothing else per call.
    """
    # Looking a communicator's state up goes through MPI attribute caching,
    # as slow as the rest of a small call; a program asks about one or two
    # communicators thousands of times. So the guard of COMM_WORLD and of the
    # last communicator asked about are kept at hand (each read and written
    # as one tuple, so a thread never pairs one's communicator with another's guard).
    world, last = _RECENT
    if comm is None and world is not None:
        return world
    if comm is not None and comm is last[0]:
        return last[1]
    state = state_of(comm)
    guard = _GUARDS.get(state)
    if guard is None:
        guard = _GUARDS[state] = _Guard(state)
    _RECENT[:] = [guard, last] if comm is None else [world, (comm, guard)]
    return guard


_RECENT = [None, (None, None)]  # [the guard of comm=None, (the last communicator given, its guard)]


def set_timeout(seconds, comm=None):
    """Bound every later collective on ``comm`` (default ``MPI.COMM_WORLD``) to ``seconds``; None: no bound.

    Not collective, but give every rank the same bound: the ranks that wait
    are the ones that must notice. Returns the previous bound.
    """
    seconds = parse_timeout(seconds)
    guard = guard_of(comm)
    previous = guard.timeout
    guard.set_timeout(seconds)
    return previous


def get_timeout(comm=None):
    """The bound on ``comm``'s collectives in seconds, or None."""
    return guard_of(comm).timeout


@contextlib.contextmanager
def timeout(seconds, comm=None):
    """Bound ``comm``'s collectives to ``seconds`` inside the block; the previous bound after it."""
    previous = set_timeout(seconds, comm)
    try:
        yield
    finally:
        set_timeout(previous, comm)


def collective(who):
    """Decorate a public collective that takes ``comm``: watched, and one thread at a time.

    When the decorated function's first parameter is ``state``, it is given
    the communicator's :class:`~ringtrain.comm.state.CommState`, found with
    the guard in one lookup, and the public function takes the remaining
    parameters (its signature shows them). Otherwise it is called as it is.
    """
    def wrap(function):
        names = list(inspect.signature(function).parameters)
        takes_state = names[0] == "state"
        position = names.index("comm") - takes_state

        @functools.wraps(function)
        def watched(*args, **kwargs):
            guard = guard_of(args[position] if len(args) > position else kwargs.get("comm"))
            if takes_state:
                args = (guard.state, *args)
            busy = guard.busy
            # The common case, inline: no bound to arm, no other call inside.
            if guard.timeout is None and busy.acquire(False):
                guard.holder = (get_ident(), who)
                guard.calls += 1
                try:
                    return function(*args, **kwargs)
                finally:
                    guard.holder = None
                    busy.release()
            return guard.call(who, function, *args, **kwargs)

        if takes_state:
            signature = inspect.signature(function)
            watched.__signature__ = signature.replace(parameters=list(signature.parameters.values())[1:])
        return watched

    return wrap

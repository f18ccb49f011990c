"""Installing signal handlers for a while, and putting the previous ones back.

The launcher (:class:`ringtrain.cluster.jobs.Forwarder`) and the trainer
(:class:`ringtrain.training.stopping.StopSignals`) both take over a few
signals for the length of one call and must hand them back exactly as they
found them, so a program that calls ``ringtrain.train()`` or
``ringtrain.launch()`` keeps its own handlers. Imports only the standard library.
"""

import atexit
import contextlib
import os
import signal
import sys
import threading

__all__ = ["swapped_handlers", "restorable", "exit_at_once_on"]


def restorable(previous):
    """What to hand back to ``signal.signal`` for a handler ``signal.signal`` returned (pure).

    ``signal.signal`` returns None when the previous handler was installed
    from C (an embedding program, a C extension); Python cannot reinstall
    that one and ``signal.signal(signum, None)`` raises TypeError, so the
    default action is the nearest thing it can restore.
    """
    return signal.SIG_DFL if previous is None else previous


@contextlib.contextmanager
def swapped_handlers(signums, handler):
    """Install ``handler`` for each of ``signums`` inside the block; restore the previous ones after it.

    Python lets only the main thread set handlers: called from any other
    thread (a library's worker, a notebook's executor) it installs nothing
    and signals keep their old meaning.

    Yields:
        ``{signum: previous handler}`` for the handlers it installed (empty off the main thread).
    """
    previous = {}
    try:
        if threading.current_thread() is threading.main_thread():
            for signum in signums:
                previous[signum] = signal.signal(signum, handler)
        yield previous
    finally:
        for signum, old in previous.items():
            signal.signal(signum, restorable(old))


def exit_at_once_on(signums, status=None):
    """From now on, end this process at once and quietly on any of ``signums``.

    For a command whose work is done and saved, on its way out (MPI's
    finalisation, interpreter shutdown): a second Ctrl-C there would
    otherwise raise KeyboardInterrupt wherever it lands, print a traceback
    and end with whatever status the unwinding happens to produce. The exit
    status is ``status`` (the one the first signal promised), or ``128 +``
    the signal's number. Main thread only, as every handler.

    Once the interpreter starts to shut down, the signals are ignored
    instead: Python puts the default action back under its own handlers late
    in its shutdown, while ``MPI_Finalize`` (mpi4py's last exit function) may
    still wait for slower ranks, and a signal there would kill the process,
    which mpiexec reports as the signal's number (2 for SIGINT, 10 for
    SIGUSR1), not as the status promised.
    """
    signums = tuple(signums)

    def handler(signum, frame):
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(status if status is not None else 128 + signum)

    if threading.current_thread() is threading.main_thread():
        for signum in signums:
            signal.signal(signum, handler)
        # Registered after mpi4py's, so it runs before MPI is finalised.
        atexit.register(_ignore, signums)


def _ignore(signums):
    if threading.current_thread() is threading.main_thread():
        for signum in signums:
            signal.signal(signum, signal.SIG_IGN)

"""A watchdog that turns a stalled collective into a loud, quick abort.

A rank that stops answering (a deadlock, a stuck file system, a peer that
sleeps) leaves its peers blocked inside MPI, where no Python exception can
reach them. The watchdog is a daemon thread: before a collective the trainer
arms it with what it is doing and whom it waits on; if the collective is
still running after ``timeout`` seconds, the thread prints one line naming
the operation, the step and the awaited rank, and calls ``MPI_Abort``, which
ends every rank. (mpi4py initialises MPI with ``MPI_THREAD_MULTIPLE`` by
default, so calling Abort from this thread is allowed.)

In a ring every rank waits on its left neighbour, and all of them time out
at about the same moment; the first to fire is often not the stalled rank's
neighbour, so its line alone would blame a rank that is itself only waiting.
Each watchdog therefore waits a short grace period between printing its line
and aborting: every waiting rank gets its line out, the stalled rank is the
one that printed none, and its right neighbour's line names it.
"""

import os
import select
import signal
import sys
import threading
import time

from .cluster.launch import rank_from_env, size_from_env

__all__ = ["Watchdog", "WatchedComm", "StartupWatchdog", "left_neighbour"]


def left_neighbour(rank, size):
    """The rank that ``rank`` receives from in a ring: in a stall, the one it waits on."""
    return (rank - 1) % size


class Watchdog:
    """Abort the job when an armed operation outlives its deadline.

    Use as ``with dog.watch("allreduce", step=12, waiting_on=3): ...``.
    ``timeout=None`` or a single-rank job makes it a no-op. ``grace`` is the
    pause between printing the line and aborting (default ``min(2, timeout)``
    seconds) so that the other ranks that time out print theirs too.
    """

    def __init__(self, comm, timeout, stream=None, clock=time.monotonic, abort=None, grace=None,
                 hint="raise --timeout if this is expected"):
        self._comm = comm
        self._timeout = timeout
        self._hint = hint
        # Long enough for the other waiting ranks' watchdogs (polling at
        # timeout/20, at most 1 s) to fire and print; short next to any timeout.
        self._grace = grace if grace is not None else (min(2.0, timeout) if timeout else 0.0)
        self._stream = stream or sys.stderr
        self._clock = clock
        self._abort = abort or (lambda: comm.Abort(1))
        self._lock = threading.Lock()
        self._armed = None  # (deadline, operation, step, waiting_on)
        self._stop = threading.Event()
        self._thread = None
        if timeout is not None and comm.Get_size() > 1:
            self._thread = threading.Thread(target=self._run, name="ringtrain-watchdog", daemon=True)
            self._thread.start()

    def watch(self, operation, step=None, waiting_on=None):
        """Context manager arming the watchdog for one operation."""
        return _Armed(self, operation, step, waiting_on)

    def arm(self, operation, step=None, waiting_on=None):
        if self._thread is None:
            return
        with self._lock:
            self._armed = (self._clock() + self._timeout, operation, step, waiting_on)

    def disarm(self):
        if self._thread is None:
            return
        with self._lock:
            self._armed = None

    def close(self):
        """Stop the thread (it is a daemon, so a forgotten close never blocks exit)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def message(self, operation, step, waiting_on):
        rank = self._comm.Get_rank()
        at = f" at step {step}" if step is not None else ""
        on = f"; waiting on rank {waiting_on}" if waiting_on is not None else ""
        return f"rank {rank}: {operation}{at} did not finish within {self._timeout:g}s{on} ({self._hint})"

    def _run(self):
        # Poll a few times per timeout: cheap, and precise enough for a deadline
        # meant in seconds or minutes.
        interval = min(1.0, max(0.05, self._timeout / 20))
        while not self._stop.wait(interval):
            with self._lock:
                armed = self._armed
            if armed is not None and self._clock() > armed[0]:
                self._stream.write(self.message(*armed[1:]) + "\n")
                self._stream.flush()
                time.sleep(self._grace)
                self._abort()
                return


class _Armed:
    def __init__(self, dog, operation, step, waiting_on):
        self._dog, self._args = dog, (operation, step, waiting_on)

    def __enter__(self):
        self._dog.arm(*self._args)
        return self

    def __exit__(self, *exc):
        self._dog.disarm()
        return False


class WatchedComm:
    """``comm`` with each of its collectives under ``dog``, for code that makes collectives of its own.

    Start-up hands this to functions such as
    :func:`ringtrain.data.load.load_sharded` that take a communicator and talk
    through it between stretches of local work (reading files). Only the time
    spent inside a collective is watched, never the reading: a rank that
    stalls in its own work arms nothing and prints nothing, while every rank
    waiting for it names the operation, so here too the stalled rank is the
    one that printed no line. Everything else (``Get_rank``, ``Get_size``)
    passes straight through.
    """

    # The lower-case (pickle) and buffer collectives of mpi4py's Comm.
    COLLECTIVES = frozenset({"allgather", "allreduce", "alltoall", "barrier", "bcast", "gather", "reduce", "scatter",
                             "Allgather", "Allgatherv", "Allreduce", "Barrier", "Bcast", "Gather", "Reduce",
                             "Reduce_scatter", "Scatter"})

    def __init__(self, comm, dog, what):
        self._comm, self._dog, self._what = comm, dog, what

    def __getattr__(self, name):
        attr = getattr(self._comm, name)
        if name not in self.COLLECTIVES:
            return attr

        def watched(*args, **kwargs):
            with self._dog.watch(f"{self._what} ({name})"):
                return attr(*args, **kwargs)

        return watched



class StartupWatchdog:
    """Bound MPI's start and the first agreement with a watcher process, not a thread.

    A rank stopped right after it starts (SIGSTOP, a slow file system, a
    ``sleep`` before the program) leaves every other rank blocked inside
    ``MPI_Init``, which waits for all of them. No thread can help there:
    mpi4py calls ``MPI_Init`` at import, holding the GIL, so a watchdog
    thread never runs, and no communicator exists yet to abort. So a forked
    watcher waits on a pipe: when the block ends the pipe is closed and the
    watcher exits; if ``timeout`` seconds pass first, it prints one line,
    waits ``grace`` seconds (so every waiting rank gets its line out), and
    kills this rank with SIGKILL, which every mpiexec answers by ending the
    job. The watcher only reads, writes and signals: no Python thread, no MPI.

    Use as ``with StartupWatchdog(timeout, "start-up: ..."): from mpi4py import MPI; ...``.
    A single-rank job (or ``timeout=None``) starts no watcher.
    """

    def __init__(self, timeout, operation, hint="raise --timeout if this is expected", env=None, grace=None,
                 stream_fd=2):
        env = os.environ if env is None else env
        rank, size = rank_from_env(env) or 0, size_from_env(env) or 1
        self._timeout = timeout if timeout and size > 1 else None
        self._grace = grace if grace is not None else (min(2.0, timeout) if timeout else 0.0)
        self._line = f"rank {rank}: {operation} did not finish within {timeout:g}s ({hint})\n" if timeout else ""
        self._fd = stream_fd
        self._pipe = self._child = None

    def __enter__(self):
        if self._timeout is None:
            return self
        read_end, self._pipe = os.pipe()
        parent = os.getpid()
        self._child = os.fork()
        if self._child == 0:  # the watcher
            os.close(self._pipe)
            _watch(read_end, parent, self._timeout, self._grace, self._line.encode(), self._fd)
        os.close(read_end)
        return self

    def __exit__(self, *exc):
        if self._child is not None:
            os.close(self._pipe)  # the watcher sees end-of-file and exits
            os.waitpid(self._child, 0)
            self._child = None
        return False


def _watch(read_end, parent, timeout, grace, line, fd):
    """The watcher's whole life (in the forked child; never returns)."""
    try:
        ready, _, _ = select.select([read_end], [], [], timeout)
        if not ready:
            os.write(fd, line)
            time.sleep(grace)
            os.kill(parent, signal.SIGKILL)
    finally:
        os._exit(0)

"""What rank 0 writes and prints: the run directory, metrics.jsonl, TensorBoard scalars, epoch lines.

Only the master writes or prints; on every other rank a RunLog is silent, so
the trainer calls it unconditionally and stays free of ``if rank == 0``.

The run directory's files are :mod:`ringtrain.io.rundir`'s: the lock that
makes it one job's at a time (a second job given the same directory is
refused before it reads or writes anything there), ``config.json`` and
``metrics.jsonl``, none of them ever written through a symbolic link.

Writing the log must never stop training: a full disk or a permission
change on ``metrics.jsonl`` or ``config.json`` is one warning (not one per
step) and the run goes on; each metrics line is written whole or not at
all, so a reader never sees half a record; a run directory deleted while
the job runs is noticed, said, and recreated for what follows. A closed or
full standard output (``| head -1``, ``>/dev/full``) is one warning on
stderr; the lines meant for it are dropped and training goes on.
"""

import contextlib
import os
import stat
import sys
import time

from ..errors import UsageError
from ..io.rundir import (CONFIG_NAME, LOCK_NAME, METRICS_NAME, MetricsFile, RunDirInUse, RunDirLock,
                         default_run_dir, write_json_atomic)
from ..io.safeio import one_line, os_reason, printable
from ..io.tensorboard import TensorBoard

__all__ = ["RunLog", "RunDirInUse", "default_run_dir", "write_json_atomic", "LOCK_NAME"]


class RunLog:
    """The master's log: ``config.json``, ``metrics.jsonl`` and one printed line per epoch.

    Args:
        run_dir: the run directory (created by :meth:`open`).
        is_master: False makes every method a no-op.
        stream: where lines are printed (default stdout).
        tensorboard: a folder for TensorBoard scalars of the train and eval
            events (``--tensorboard``), or None.
        log_every: the run's ``--log-every`` (TensorBoard's windows are that many steps long).
    """

    def __init__(self, run_dir, is_master, stream=None, tensorboard=None, log_every=50):
        self.run_dir = run_dir
        self.is_master = is_master
        self.stream = stream or sys.stdout
        self._start = time.time()
        self._config = None
        self._lock = RunDirLock(run_dir)
        self._metrics = MetricsFile(os.path.join(run_dir, METRICS_NAME), self.warn)
        self._dir_id = None  # (st_dev, st_ino) of the run directory once open
        self._gone = False  # the run directory was deleted and could not be recreated
        self._warned = set()
        self._board = TensorBoard(tensorboard, self.warn, log_every) if tensorboard is not None and is_master else None
        # A context in which a line is printed: the trainer's progress bar
        # sets one that clears the bar first, so lines are never torn.
        self.pause = contextlib.nullcontext

    @property
    def checkpoint_dir(self):
        return os.path.join(self.run_dir, "checkpoints")

    @property
    def metrics_path(self):
        return self._metrics.path

    def claim(self):
        """Take the run directory's lock if the directory already has one.

        Returns None, or a one-line problem (another job holds it). Call it on
        every rank and hand the result to :func:`ringtrain.failure.agree`, so
        every rank stops when the master refuses; only the master looks, and
        it creates nothing (:meth:`open` takes the lock of a new directory).
        """
        if not self.is_master:
            return None
        if os.path.islink(self.checkpoint_dir):  # saves and pruning would happen wherever it points
            return (f"--run-dir {self.run_dir}: its checkpoints directory is a symbolic link, which ringtrain never "
                    "follows; remove it (to keep checkpoints on other storage, give a --run-dir there)")
        return self._lock.claim()

    # -- writing ---------------------------------------------------------------
    def open(self, config):
        """Create the run directory, lock it, and write the resolved configuration.

        Raises:
            OSError: the directory cannot be created (nothing can be written).
            RunDirInUse: another job holds the directory.
        A failure to write ``config.json`` or open ``metrics.jsonl`` is a
        warning: training goes on.
        """
        if not self.is_master:
            return
        self._config = config
        os.makedirs(self.checkpoint_dir, exist_ok=True)
        if not self._lock.held:
            self._lock.take(create=True)
        self._dir_id = _identity(self.run_dir)
        self._write_files()

    def _write_files(self):
        path = os.path.join(self.run_dir, CONFIG_NAME)
        try:
            write_json_atomic(path, self._config)
        except OSError as exc:
            self._warn_once("config", f"{path}: not written ({os_reason(exc)}); training goes on without it")
        self._metrics.open()

    def event(self, event, **fields):
        """Append one JSON object (``event``, the fields, and ``time`` since start) to metrics.jsonl.

        The line goes out in one ``os.write`` on an ``O_APPEND`` descriptor;
        if that fails part-way it is cut back off, so every line is whole.
        """
        if not self.is_master or self._dir_id is None:
            return
        self._check_dir()
        self._metrics.append({"event": event, **fields, "time": round(time.time() - self._start, 4)})
        if self._board is not None:
            self._board.write(event, fields)

    def _check_dir(self, recreate=True):
        """Notice a run directory deleted (or replaced) under a running job; say what was lost; recreate it."""
        if self._gone or _identity(self.run_dir) == self._dir_id:
            return
        self.warn(f"run directory {self.run_dir} was deleted while this job ran: its config.json, metrics.jsonl "
                  "and earlier checkpoints are lost" + ("; recreating it for what follows" if recreate else ""))
        if not recreate:
            self._gone = True
            return
        try:
            os.makedirs(self.checkpoint_dir, exist_ok=True)
            self._lock.take(create=True)
        except (OSError, UsageError) as exc:
            reason = os_reason(exc) if isinstance(exc, OSError) else str(exc)
            self.warn(one_line(f"run directory {self.run_dir}: cannot recreate it ({reason}); "
                               "nothing more is recorded there"))
            self._gone = True
            self._metrics.close()
            return
        self._dir_id = _identity(self.run_dir)
        self._write_files()

    # -- printing --------------------------------------------------------------
    def print(self, line):
        """Print a line on the master; a closed or full output is one warning, never the end of training."""
        if self.is_master and self.stream is not None:
            with self.pause():
                if not print_safely(printable(line), self.stream):
                    self._output_failed()

    def _output_failed(self):
        # Later lines would fail the same way; and the interpreter's own flush
        # at exit would fail again (status 120), so stdout goes to /dev/null.
        stream, self.stream = self.stream, None
        if stream is sys.stdout:
            _silence_stdout()
        self.warn("standard output cannot be written (closed or full); its lines are dropped, training goes on")

    def warn(self, line):
        if self.is_master:
            with self.pause():
                print_safely(f"ringtrain: warning: {printable(one_line(line, 500))}", sys.stderr)

    def _warn_once(self, key, line):
        if key not in self._warned:
            self._warned.add(key)
            self.warn(line)

    def close(self):
        """Close metrics.jsonl and the TensorBoard file and give up the run directory's lock."""
        if self._board is not None:
            self._board.close()
        if self._dir_id is not None:
            self._check_dir(recreate=False)
        self._metrics.close()
        if self._metrics.lost:
            self.warn(f"{self.metrics_path}: {self._metrics.lost} metrics record(s) were not written")
            self._metrics.lost = 0
        self._lock.release()


def print_safely(line, stream):
    """Print ``line`` and flush; False (and nothing raised) when the stream cannot be written."""
    try:
        print(line, file=stream, flush=True)
        return True
    except (OSError, ValueError):  # EPIPE, ENOSPC, EIO; ValueError: the stream was closed
        return False


def _silence_stdout():
    try:
        fd = os.open(os.devnull, os.O_WRONLY)
        os.dup2(fd, sys.stdout.fileno())
        os.close(fd)
    except (OSError, ValueError):
        pass


def _identity(path):
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISDIR(st.st_mode) else None

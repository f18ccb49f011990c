"""What rank 0 writes and prints: the run directory, metrics.jsonl, epoch lines.

Only the master writes or prints; on every other rank a RunLog is silent, so
the trainer calls it unconditionally and stays free of ``if rank == 0``.

The run directory belongs to one job at a time. The master holds an
exclusive ``flock`` on ``.ringtrain.lock`` in it for the job's whole life:
the kernel drops the lock when the process dies however it dies, so a
crashed job never leaves a stale claim behind (a marker file would). A
second job given the same directory is refused before it reads or writes
anything there. The lock file itself is never deleted: unlinking it while
another process has it open would let two jobs each lock a different inode.

Writing the log must never stop training: a full disk or a permission
change on ``metrics.jsonl`` or ``config.json`` is one warning (not one per
step) and the run goes on; each metrics line is written whole or not at
all, so a reader never sees half a record; a run directory deleted while
the job runs is noticed, said, and recreated for what follows.
"""

import contextlib
import errno
import fcntl
import json
import os
import socket
import stat
import sys
import time

from ..errors import UsageError
from ..io.safeio import file_kind, one_line, os_reason

__all__ = ["RunLog", "RunDirInUse", "default_run_dir", "write_json_atomic", "LOCK_NAME"]

LOCK_NAME = ".ringtrain.lock"
_TAIL_BYTES = 1 << 16  # how far back open() looks for the end of the last whole metrics line


class RunDirInUse(UsageError):
    """Another live job holds the run directory's lock."""


def default_run_dir(now=None, root="runs"):
    """Create and return a new ``runs/<timestamp>``, e.g. ``runs/20261121-153012``.

    The directory is made with ``os.mkdir``, which fails if it exists, so two
    jobs started in the same second (on one host or on several sharing the
    file system) get ``runs/20261121-153012`` and ``runs/20261121-153012-2``,
    never the same directory. If it cannot be created, the plain name is
    returned and opening the log reports why.
    """
    base = os.path.join(root, time.strftime("%Y%m%d-%H%M%S", time.localtime(now)))
    try:
        os.makedirs(root, exist_ok=True)
    except OSError:
        return base
    for n in range(1, 10_000):
        name = base if n == 1 else f"{base}-{n}"
        try:
            os.mkdir(name)
            return name
        except FileExistsError:
            continue
        except OSError:
            return name
    return base


def write_json_atomic(path, obj):
    """Write JSON through a temporary file and rename, so a reader never sees half of it."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as fh:
            json.dump(obj, fh, indent=2, sort_keys=True)
            fh.write("\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


class RunLog:
    """The master's log: ``config.json``, ``metrics.jsonl`` and one printed line per epoch.

    Args:
        run_dir: the run directory (created by :meth:`open`).
        is_master: False makes every method a no-op.
        stream: where lines are printed (default stdout).
    """

    def __init__(self, run_dir, is_master, stream=None):
        self.run_dir = run_dir
        self.is_master = is_master
        self.stream = stream or sys.stdout
        self._start = time.time()
        self._config = None
        self._lock_fd = None
        self._metrics_fd = None
        self._dir_id = None  # (st_dev, st_ino) of the run directory once open
        self._lost = 0  # metrics records not written since the last one that was
        self._gone = False  # the run directory was deleted and could not be recreated
        self._warned = set()
        # A context in which a line is printed: the trainer's progress bar
        # sets one that clears the bar first, so lines are never torn.
        self.pause = contextlib.nullcontext

    @property
    def checkpoint_dir(self):
        return os.path.join(self.run_dir, "checkpoints")

    @property
    def metrics_path(self):
        return os.path.join(self.run_dir, "metrics.jsonl")

    # -- the run directory's owner ---------------------------------------------
    def claim(self):
        """Take the run directory's lock if the directory already has one.

        Returns None, or a one-line problem (another job holds it). Call it on
        every rank and hand the result to :func:`ringtrain.failure.agree`, so
        every rank stops when the master refuses; only the master looks. A
        directory without a lock file is new (or from a job that never ran):
        nothing is created here, so a job refused later has written nothing;
        :meth:`open` takes the lock when it creates the directory.
        """
        if not self.is_master or self._lock_fd is not None:
            return None
        if not os.path.lexists(os.path.join(self.run_dir, LOCK_NAME)):
            return None
        try:
            self._lock(create=False)
        except UsageError as exc:
            return str(exc)
        except FileNotFoundError:
            return None  # removed since we looked: open() will create it
        except OSError as exc:
            return f"--run-dir {self.run_dir}: cannot lock {LOCK_NAME} ({os_reason(exc)})"
        return None

    def _lock(self, create):
        path = os.path.join(self.run_dir, LOCK_NAME)
        flags = os.O_RDWR | os.O_NONBLOCK | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(path, flags | (os.O_CREAT if create else 0), 0o644)
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # O_NOFOLLOW's answer to a symbolic link
                raise UsageError(f"--run-dir {self.run_dir}: {LOCK_NAME} is a symbolic link; remove it") from None
            raise
        try:
            kind = file_kind(os.fstat(fd).st_mode)
            if kind is not None:
                raise UsageError(f"--run-dir {self.run_dir}: {LOCK_NAME} is {kind}, not a regular file; remove it")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = one_line(os.pread(fd, 200, 0).decode("utf-8", "replace"), 120) or "a live process"
                raise RunDirInUse(f"--run-dir {self.run_dir}: in use by another ringtrain job ({holder}); "
                                  "give another --run-dir, or wait for that job to finish") from None
        except BaseException:
            os.close(fd)
            raise
        # Who holds it, for the message a refused job prints. The lock, not
        # this text, is what counts, so a full disk here is no matter.
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, since "
                          f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode(), 0)
        except OSError:
            pass
        if self._lock_fd is not None:
            os.close(self._lock_fd)
        self._lock_fd = fd

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
        if self._lock_fd is None:
            self._lock(create=True)
        self._dir_id = _identity(self.run_dir)
        self._write_files()

    def _write_files(self):
        path = os.path.join(self.run_dir, "config.json")
        try:
            write_json_atomic(path, self._config)
        except OSError as exc:
            self._warn_once("config", f"{path}: not written ({os_reason(exc)}); training goes on without it")
        self._open_metrics()

    def _open_metrics(self):
        path = self.metrics_path
        if self._metrics_fd is not None:
            os.close(self._metrics_fd)
            self._metrics_fd = None
        try:
            # Appending keeps the history of a resumed run in one file.
            fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0),
                         0o644)
        except OSError as exc:
            self._warn_once("metrics", f"{path}: cannot open ({os_reason(exc)}); metrics are not being "
                                       "recorded; training goes on")
            return
        kind = file_kind(os.fstat(fd).st_mode)
        if kind is not None:
            os.close(fd)
            self._warn_once("metrics", f"{path}: is {kind}, not a regular file; metrics are not being recorded")
            return
        self._metrics_fd = fd
        self._drop_torn_tail()

    def _drop_torn_tail(self):
        # A job killed mid-write can leave half a line; the next record
        # appended would be glued onto it and both lost. Cut it off first.
        fd, path = self._metrics_fd, self.metrics_path
        try:
            size = os.fstat(fd).st_size
            tail = os.pread(fd, min(size, _TAIL_BYTES), max(0, size - _TAIL_BYTES))
            if not tail or tail.endswith(b"\n"):
                return
            cut = tail.rfind(b"\n") + 1
            keep = size - len(tail) + cut
            os.ftruncate(fd, keep)
            self.warn(f"{path}: removed a torn last line ({size - keep} bytes) left by an interrupted run")
        except OSError:
            pass

    def event(self, event, **fields):
        """Append one JSON object (``event``, the fields, and ``time`` since start) to metrics.jsonl.

        The line goes out in one ``os.write`` on an ``O_APPEND`` descriptor;
        if that fails part-way it is cut back off, so every line is whole.
        """
        if not self.is_master or self._dir_id is None:
            return
        self._check_dir()
        record = {"event": event, **fields, "time": round(time.time() - self._start, 4)}
        self._append((json.dumps(record, default=float) + "\n").encode())

    def _append(self, line):
        fd, path = self._metrics_fd, self.metrics_path
        if fd is None:
            self._lost += 1
            return
        size = None
        try:
            size = os.fstat(fd).st_size
            written = os.write(fd, line)
            if written != len(line):
                # A short write to a regular file: the disk filled part-way through the line.
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError as exc:
            if size is not None:
                try:
                    os.ftruncate(fd, size)  # the only writer: cutting back to the last whole line is safe
                except OSError:
                    pass
            self._lost += 1
            self._warn_once("metrics", f"{path}: cannot write ({os_reason(exc)}); metrics are not being "
                                       "recorded until it can be; training goes on")
            return
        if self._lost:
            self.warn(f"{path}: writing again; {self._lost} record(s) before this one were lost")
            self._lost = 0
            self._warned.discard("metrics")

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
            self._lock(create=True)
        except (OSError, UsageError) as exc:
            reason = os_reason(exc) if isinstance(exc, OSError) else str(exc)
            self.warn(one_line(f"run directory {self.run_dir}: cannot recreate it ({reason}); "
                               "nothing more is recorded there"))
            self._gone = True
            if self._metrics_fd is not None:
                os.close(self._metrics_fd)
                self._metrics_fd = None
            return
        self._dir_id = _identity(self.run_dir)
        self._write_files()

    # -- printing --------------------------------------------------------------
    def print(self, line):
        if self.is_master:
            with self.pause():
                print(line, file=self.stream, flush=True)

    def warn(self, line):
        if self.is_master:
            with self.pause():
                print(f"ringtrain: warning: {one_line(line, 500)}", file=sys.stderr, flush=True)

    def _warn_once(self, key, line):
        if key not in self._warned:
            self._warned.add(key)
            self.warn(line)

    def close(self):
        """Close metrics.jsonl and give up the run directory's lock."""
        if self._dir_id is not None:
            self._check_dir(recreate=False)
        if self._metrics_fd is not None:
            os.close(self._metrics_fd)
            self._metrics_fd = None
        if self._lost:
            self.warn(f"{self.metrics_path}: {self._lost} metrics record(s) were not written")
            self._lost = 0
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the last descriptor releases the flock
            self._lock_fd = None


def _identity(path):
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISDIR(st.st_mode) else None

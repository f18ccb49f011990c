"""The run directory's own files: its lock, ``config.json`` and ``metrics.jsonl``.

The run directory belongs to one job at a time. The master holds an
exclusive ``flock`` on ``.ringtrain.lock`` in it for the job's whole life:
the kernel drops the lock when the process dies however it dies, so a
crashed job never leaves a stale claim behind (a marker file would). The
lock file itself is never deleted: unlinking it while another process has
it open would let two jobs each lock a different inode.

Nothing here follows a symbolic link planted in the run directory: the lock
and ``metrics.jsonl`` are opened with ``O_NOFOLLOW``, and ``config.json``
(like every JSON record) is written to a new temporary file (``O_EXCL``, so
never through a link) and renamed over the name, which replaces a link
instead of writing to its target.

Pure file handling, no MPI; :class:`ringtrain.training.runlog.RunLog`
composes these for the trainer.
"""

import errno
import fcntl
import json
import os
import socket
import time

from ..errors import UsageError
from .safeio import file_kind, one_line, os_reason

__all__ = ["RunDirLock", "RunDirInUse", "MetricsFile", "LOCK_NAME", "CONFIG_NAME", "METRICS_NAME",
           "default_run_dir", "write_json_atomic", "create_new"]

LOCK_NAME = ".ringtrain.lock"
CONFIG_NAME = "config.json"
METRICS_NAME = "metrics.jsonl"
_TAIL_BYTES = 1 << 16  # how far back a MetricsFile looks for the end of the last whole line
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


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


def create_new(path, mode=0o644):
    """Open a new file for writing, never through a symbolic link (raises OSError, FileExistsError).

    ``O_EXCL`` fails on any existing name, a link included, so a temporary
    name an attacker planted cannot redirect the write.
    """
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC, mode)


def write_json_atomic(path, obj):
    """Write JSON through a new temporary file and rename, so a reader never sees half of it.

    A symbolic link at ``path`` is replaced, never written through.
    """
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        try:
            os.unlink(tmp)  # a leftover of a dead process that had our pid (or a planted link): never written through
        except FileNotFoundError:
            pass
        with os.fdopen(create_new(tmp), "w") as fh:
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


class RunDirLock:
    """The exclusive lock on ``run_dir/.ringtrain.lock`` that says which job owns the directory."""

    def __init__(self, run_dir):
        self.run_dir = run_dir
        self.fd = None

    @property
    def held(self):
        return self.fd is not None

    def claim(self):
        """Take the lock if the directory already has a lock file; None, or a one-line problem.

        A directory without a lock file is new (or from a job that never
        ran): nothing is created here, so a job refused later has written
        nothing; :meth:`take` (with ``create``) makes the file.
        """
        if self.fd is not None or not os.path.lexists(os.path.join(self.run_dir, LOCK_NAME)):
            return None
        try:
            self.take(create=False)
        except UsageError as exc:
            return str(exc)
        except FileNotFoundError:
            return None  # removed since we looked: take(create=True) will create it
        except OSError as exc:
            return f"--run-dir {self.run_dir}: cannot lock {LOCK_NAME} ({os_reason(exc)})"
        return None

    def take(self, create):
        """Open and lock the lock file (raises RunDirInUse, UsageError, OSError)."""
        path = os.path.join(self.run_dir, LOCK_NAME)
        flags = os.O_RDWR | os.O_NONBLOCK | os.O_NOFOLLOW | _CLOEXEC
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
        self.release()
        self.fd = fd

    def release(self):
        if self.fd is not None:
            os.close(self.fd)  # closing the last descriptor releases the flock
            self.fd = None


class MetricsFile:
    """``metrics.jsonl``: one JSON record per line, each line whole or absent.

    Args:
        path: the file (appended to, so a resumed run's history stays in one file).
        warn: called with a line for each problem (at most once per kind of problem in a row).
    """

    def __init__(self, path, warn):
        self.path = path
        self.fd = None
        self.lost = 0  # records not written since the last one that was
        self._warn = warn
        self._warned = False

    def open(self):
        """Open (or reopen) for appending; a failure is one warning and the records are counted as lost."""
        self.close()
        flags = os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | os.O_NOFOLLOW | _CLOEXEC
        try:
            fd = os.open(self.path, flags, 0o644)
        except OSError as exc:
            reason = "is a symbolic link, which is never followed" if exc.errno == errno.ELOOP else (
                f"cannot open ({os_reason(exc)})")
            self._warn_once(f"{self.path}: {reason}; metrics are not being recorded; training goes on")
            return
        kind = file_kind(os.fstat(fd).st_mode)
        if kind is not None:
            os.close(fd)
            self._warn_once(f"{self.path}: is {kind}, not a regular file; metrics are not being recorded")
            return
        self.fd = fd
        self._drop_torn_tail()

    def _drop_torn_tail(self):
        # A job killed mid-write can leave half a line; the next record
        # appended would be glued onto it and both lost. Cut it off first.
        fd = self.fd
        try:
            size = os.fstat(fd).st_size
            tail = os.pread(fd, min(size, _TAIL_BYTES), max(0, size - _TAIL_BYTES))
            if not tail or tail.endswith(b"\n"):
                return
            cut = tail.rfind(b"\n") + 1
            keep = size - len(tail) + cut
            os.ftruncate(fd, keep)
            self._warn(f"{self.path}: removed a torn last line ({size - keep} bytes) left by an interrupted run")
        except OSError:
            pass

    def append(self, record):
        """Append one record as a line, in one ``os.write``; cut back off if that fails part-way."""
        line = (json.dumps(record, default=float) + "\n").encode()
        fd = self.fd
        if fd is None:
            self.lost += 1
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
            self.lost += 1
            self._warn_once(f"{self.path}: cannot write ({os_reason(exc)}); metrics are not being "
                            "recorded until it can be; training goes on")
            return
        if self.lost:
            self._warn(f"{self.path}: writing again; {self.lost} record(s) before this one were lost")
            self.lost = 0
            self._warned = False

    def _warn_once(self, line):
        if not self._warned:
            self._warned = True
            self._warn(line)

    def close(self):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

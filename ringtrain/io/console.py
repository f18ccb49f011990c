"""Where rank 0's printed lines go, so that a closed or full output never ends a run.

Under ``mpirun`` a rank's stdout is a pipe to MPI's process manager, which
copies it to ``mpirun``'s own stdout. When that output fails (``| head -1``
has exited, ``>/dev/full``), ``mpirun`` itself gives up and kills every rank,
whatever the rank does about it: training ends without a checkpoint. So
rank 0 writes its lines straight to ``mpirun``'s output instead, where it can
see the failure, warn once and go on (:class:`ringtrain.training.runlog.RunLog`).

That is done only where it is safe: this rank's own stdout is the pipe MPI
gave it (not a rank log of ``ringtrain launch -o``, which stays where it
is), ``mpirun`` is an ancestor of this process (on this host), and its
stdout is a pipe, a terminal or a device, which a second writer shares as it is. A regular file is left to ``mpirun``: a
second open of it would not share its offset, and the two writers would
overwrite each other's lines.
"""

import errno
import fcntl
import os
import stat
import sys

__all__ = ["LAUNCHERS", "launcher_stdout"]

# Process names of the launchers whose stdout the ranks' output goes to.
LAUNCHERS = ("mpiexec", "mpirun", "orterun", "prterun")
_MAX_DEPTH = 6  # rank -> proxy (hydra_pmi_proxy, prted) -> mpiexec, with room for wrappers


def _parent_and_name(pid):
    """``(parent pid, process name)`` from ``/proc/PID/stat``, or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            text = fh.read().decode("utf-8", "replace")
    except OSError:
        return None
    # The name sits in parentheses and may itself hold spaces or ')'.
    name = text[text.find("(") + 1:text.rfind(")")]
    fields = text[text.rfind(")") + 2:].split()
    try:
        return int(fields[1]), name
    except (IndexError, ValueError):
        return None


def _launcher_pid():
    pid = os.getppid()
    for _ in range(_MAX_DEPTH):
        if pid <= 1:
            return None
        found = _parent_and_name(pid)
        if found is None:
            return None
        parent, name = found
        if name.startswith(LAUNCHERS):
            return pid
        pid = parent
    return None


def _forwarded(stream):
    """Whether ``stream`` is a pipe or socket, as MPI's process manager gives a rank to copy its output."""
    try:
        mode = os.fstat(stream.fileno()).st_mode
    except (OSError, ValueError, AttributeError):
        return False
    return stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)


def launcher_stdout():
    """A text stream onto the launcher's own stdout, for rank 0's lines; None to keep ``sys.stdout``.

    Returns None where no launcher is an ancestor, or its stdout is a regular
    file (see the module's docstring); a stream that is already broken where
    the output has no reader left (writing to it fails, and the caller
    warns once).
    """
    if not _forwarded(sys.stdout):
        return None  # our stdout is a file of our own (``launch -o``'s rank log) or a terminal: keep it
    pid = _launcher_pid()
    if pid is None:
        return None
    path = f"/proc/{pid}/fd/1"
    try:
        mode = os.stat(path).st_mode
        if not (stat.S_ISFIFO(mode) or stat.S_ISCHR(mode)):
            return None
        # O_NONBLOCK: opening a pipe whose reader is gone fails (ENXIO) instead of waiting for one.
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        return _Broken() if exc.errno == errno.ENXIO else None
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    return os.fdopen(fd, "w", buffering=1, encoding="utf-8", errors="backslashreplace")


class _Broken:
    """An output with no reader: every write fails as the real one would."""

    def write(self, text):
        raise BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE))

    def flush(self):
        pass

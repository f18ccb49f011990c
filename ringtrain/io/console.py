"""Where rank 0's printed lines go, so that a closed or full output never ends a run.

Under ``mpirun`` a rank's stdout is a pipe to MPI's process manager, which
copies it to ``mpirun``'s own stdout. When that output fails (``| head -1``
has exited, ``>/dev/full``), ``mpirun`` itself gives up and kills every rank,
whatever the rank does about it: training ends without a checkpoint. So
rank 0's stdout and stderr are pointed straight at ``mpirun``'s own, where
rank 0 sees the failure, warns once and goes on
(:class:`ringtrain.training.runlog.RunLog`, the progress lines).

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

__all__ = ["LAUNCHERS", "bypass_forwarding"]

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


def _forwarded(fd):
    """Whether ``fd`` is a pipe or socket, as MPI's process manager gives a rank to copy its output."""
    try:
        mode = os.fstat(fd).st_mode
    except OSError:
        return False
    return stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)


def _open_launchers(pid, fd):
    """A new descriptor onto the launcher's own ``fd``; None to leave ours; a dead pipe where it has no reader."""
    path = f"/proc/{pid}/fd/{fd}"
    try:
        mode = os.stat(path).st_mode
        if not (stat.S_ISFIFO(mode) or stat.S_ISCHR(mode)):
            return None
        # O_NONBLOCK: opening a pipe whose reader is gone fails (ENXIO) instead of waiting for one.
        new = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        if exc.errno != errno.ENXIO:
            return None
        read, new = os.pipe()  # a pipe with no reader: every write fails (EPIPE), as the real one would
        os.close(read)
        return new
    fcntl.fcntl(new, fcntl.F_SETFL, fcntl.fcntl(new, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    return new


def bypass_forwarding(fds=(1, 2)):
    """Point this process's stdout and stderr straight at the launcher's own, where that is safe.

    Call it on rank 0 before it prints. Afterwards a closed or full output
    fails rank 0's own writes (which :class:`ringtrain.training.runlog.RunLog`
    turns into one warning) instead of ``mpirun``'s, which would end the job.
    Returns the descriptors redirected (none where no launcher is an
    ancestor, this process's output is not MPI's forwarding pipe, e.g. a rank
    log of ``launch -o``, or the launcher's output is a regular file).
    """
    pid = None
    done = []
    for fd in fds:
        if not _forwarded(fd):
            continue
        pid = pid or _launcher_pid()
        if pid is None:
            return done
        new = _open_launchers(pid, fd)
        if new is None:
            continue
        for stream in (sys.stdout, sys.stderr):
            try:
                if stream.fileno() == fd:
                    stream.flush()  # what was written so far goes the old way, in order
            except (OSError, ValueError):
                pass
        os.dup2(new, fd)
        os.close(new)
        done.append(fd)
    return done

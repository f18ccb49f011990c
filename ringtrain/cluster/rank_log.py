"""Run a command with its stdout and stderr in ``LOGDIR/rank-R.log``.

``ringtrain launch -o LOGDIR`` puts this in front of the user's command on
every rank::

    python -m ringtrain.cluster.rank_log [--restart N] LOGDIR -- COMMAND...

The rank comes from the variable the MPI launcher sets; the file is opened,
made the process's stdout and stderr, and the command replaces this process
(``exec``), so its exit status and signals reach mpirun unchanged. With
``--restart N`` (the launcher's N-th restart of the job) the log is appended
to after a marker line, so the failed run's output is kept.
"""

import os
import sys

from .jobs import RESTART_MARK
from .launch import RANK_VARIABLES, rank_from_env

__all__ = ["rank_from_env", "open_log", "main"]

USAGE = "usage: python -m ringtrain.cluster.rank_log [--restart N] LOGDIR -- COMMAND..."


def _parse(argv):
    """``(restart, logdir, command)`` from the arguments, or None when they are wrong (pure)."""
    restart = 0
    if argv[:1] == ["--restart"]:
        if len(argv) < 2 or not argv[1].isdigit():
            return None
        restart, argv = int(argv[1]), argv[2:]
    if len(argv) >= 2 and argv[1] == "--":
        argv = argv[:1] + argv[2:]
    if len(argv) < 2:
        return None
    return restart, argv[0], argv[1:]


def open_log(path, restart):
    """Open this rank's log for writing without ever writing through a symbolic link.

    A first run starts the log afresh: a symbolic link (or anything else)
    already at ``path`` is removed, never followed, so its target is left
    alone. A restart appends (the output of the run that failed is the
    evidence), and ``O_NOFOLLOW`` refuses a link put there since.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | (os.O_APPEND if restart else os.O_TRUNC)
    if not restart and os.path.islink(path):
        os.unlink(path)
    return os.open(path, flags, 0o644)


def main(argv=None):
    parsed = _parse(list(sys.argv[1:] if argv is None else argv))
    if parsed is None:
        print(USAGE, file=sys.stderr)
        return 2
    restart, logdir, command = parsed
    rank = rank_from_env(os.environ)
    if rank is None:
        print("ringtrain.cluster.rank_log: no rank in the environment (" + ", ".join(RANK_VARIABLES)
              + "); run it under mpirun", file=sys.stderr)
        return 2
    # Each host makes the directory itself: without a shared file system the
    # launcher's mkdir only happened on the first host.
    os.makedirs(logdir, exist_ok=True)
    path = os.path.join(logdir, f"rank-{rank}.log")
    try:
        fd = open_log(path, restart)
    except OSError as exc:
        print(f"ringtrain.cluster.rank_log: cannot write {path}: {exc.strerror}; choose another -o", file=sys.stderr)
        return 2
    if restart:
        os.write(fd, f"{RESTART_MARK}{restart}\n".encode())
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    try:
        os.execvp(command[0], command)
    except OSError as exc:
        # Like a shell: the reason goes to the log, 127 to mpirun.
        print(f"ringtrain.cluster.rank_log: cannot run {command[0]!r}: {exc.strerror}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main())

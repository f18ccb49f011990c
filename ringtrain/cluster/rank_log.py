"""Run a command with its stdout and stderr in ``LOGDIR/rank-R.log``.

``ringtrain launch -o LOGDIR`` puts this in front of the user's command on
every rank::

    python -m ringtrain.cluster.rank_log [--restart N] LOGDIR -- COMMAND...
    python -m ringtrain.cluster.rank_log --records-only DIR -- COMMAND...

(the second, for an elastic launch without ``-o``, leaves the output where
it was and writes only the exit record, so the launcher knows whose host failed).

The rank comes from the variable the MPI launcher sets; the file is opened,
made the process's stdout and stderr, and the command runs as a child that
dies with this process; its exit status and signals reach mpirun unchanged,
and a failure also leaves ``LOGDIR/rank-R.exit`` (when, and the status), so
the launcher can tell which rank failed first. With
``--restart N`` (the launcher's N-th restart of the job) the log is appended
to after a marker line, so the failed run's output is kept.
"""

import contextlib
import os
import signal
import sys
import time

from ..errors import UsageError
from .jobs import FORWARDED, RESTART_MARK, exit_record_name
from .launch import RANK_VARIABLES, rank_from_env

__all__ = ["rank_from_env", "open_log", "run_recorded", "die_of", "group_signalled", "main"]

USAGE = "usage: python -m ringtrain.cluster.rank_log [--restart N | --records-only] LOGDIR -- COMMAND..."


def _parse(argv):
    """``(restart, logdir, command)`` from the arguments, or None when they are wrong (pure).

    ``restart`` is None for ``--records-only`` (no log file at all).
    """
    restart = 0
    if argv[:1] == ["--records-only"]:
        restart, argv = None, argv[1:]
    elif argv[:1] == ["--restart"]:
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
    try:
        rank = rank_from_env(os.environ)
    except UsageError as exc:
        print(f"ringtrain.cluster.rank_log: {exc}", file=sys.stderr)
        return 2
    if rank is None:
        print("ringtrain.cluster.rank_log: no rank in the environment (" + ", ".join(RANK_VARIABLES)
              + "); run it under mpirun", file=sys.stderr)
        return 2
    # Each host makes the directory itself: without a shared file system the
    # launcher's mkdir only happened on the first host.
    os.makedirs(logdir, exist_ok=True)
    record = os.path.join(logdir, exit_record_name(rank))
    if restart is None:
        return _run_with_record(command, record)
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
    return _run_with_record(command, record)


def _run_with_record(command, record):
    with contextlib.suppress(FileNotFoundError):
        os.unlink(record)  # a record is the latest run's or none
    return run_recorded(command, record)


def run_recorded(command, record):
    """Run ``command`` as a child; if it fails, write when and how to ``record``; end as it ended.

    Not an ``exec``: the launcher's failure report wants the rank whose
    process failed first, and only a parent can see a child die of SIGKILL
    (out of memory) with nothing in its log. The signals mpiexec sends are
    passed on, exactly once (see :func:`group_signalled`), the child dies
    with this wrapper (``PR_SET_PDEATHSIG``), and
    the wrapper ends with the child's status or signal, so mpirun sees what
    it would have seen.
    """
    parent = os.getpid()
    child = os.fork()
    if child == 0:
        _die_with(parent)
        try:
            os.execvp(command[0], command)
        except OSError as exc:
            # Like a shell: the reason goes to the log, 127 to mpirun.
            print(f"ringtrain.cluster.rank_log: cannot run {command[0]!r}: {exc.strerror}", file=sys.stderr)
            sys.stderr.flush()
        os._exit(127)

    def forward(signum, frame):
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signum)

    # Either way the wrapper itself lives on until the child ends.
    for signum in FORWARDED:
        signal.signal(signum, signal.SIG_IGN if group_signalled() else forward)
    _, status = os.waitpid(child, 0)
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        _write_record(record, f"{time.time():.6f} {code}\n")
    if code < 0:
        die_of(-code)
    return 128 - code if code < 0 else code


def die_of(signum):
    """End this process by ``signum``, as the child did, so mpirun sees the same death.

    SIGKILL and SIGSTOP have no handler to reset (``signal.signal`` refuses
    them); any other signal gets its default action back first. Returns
    only if the signal did not end the process (one whose default is to be
    ignored), and then the caller exits with ``128 + signum``.
    """
    if signum not in (signal.SIGKILL, signal.SIGSTOP):
        with contextlib.suppress(OSError, ValueError):
            signal.signal(signum, signal.SIG_DFL)
    with contextlib.suppress(OSError):
        os.kill(os.getpid(), signum)


def group_signalled():
    """True when the launcher signals this process's whole group, the child included.

    MPICH's proxy and Open MPI's daemon make each process they start the
    leader of a process group of its own, and send it signals as a group:
    the child already gets every signal, and a second copy from the wrapper
    would read as "again" (a trainer's abort without a checkpoint). A
    wrapper started any other way passes the signals on itself.
    """
    return os.getpgrp() == os.getpid()


def _die_with(parent):
    """In the child: SIGKILL when the wrapper dies (mpiexec kills the wrapper, not its child)."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG, Linux only
    if os.getppid() != parent:  # the wrapper died before the line above
        os._exit(137)


def _write_record(path, text):
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        try:
            os.write(fd, text.encode())
        finally:
            os.close(fd)


if __name__ == "__main__":
    sys.exit(main())

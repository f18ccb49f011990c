"""Ending what the launcher started, however stuck it is: from a polite signal to SIGKILL of its session.

``ringtrain launch`` starts mpiexec in a session of its own, so every
process it starts on this host (its proxies, the ranks, whatever they run)
shares that session id, and nothing else does. After a stop signal the job
gets :data:`FORCE_AFTER` seconds to end cleanly (a checkpoint takes time);
then mpiexec is told to abort, and :data:`KILL_AFTER` seconds later every
process of the session is killed. Two cases skip the wait:

* the user sends a second stop signal: they mean it, so the abort comes at
  once and the kill :data:`INSIST_KILL_AFTER` seconds later;
* mpiexec has started nothing (no other process in its session): there is
  no job to give time to. An mpiexec stuck before it starts any process
  (one that spins on a hostfile's absurd slot count) ignores SIGTERM.

:func:`next_step` is the pure decision; the rest reads ``/proc``.
"""

import contextlib
import glob
import os
import signal

__all__ = ["FORCE_AFTER", "KILL_AFTER", "INSIST_KILL_AFTER", "NOTHING_STARTED_AFTER", "next_step",
           "session_members", "kill_session"]

# How long ranks may take to end after a stop signal before mpiexec is told
# to abort (a second SIGINT is "force abort" to Hydra and Open MPI alike),
# and how long after that before the whole session is killed.
FORCE_AFTER = 30.0
KILL_AFTER = 10.0
# After a second stop signal: long enough for MPI's own abort to end the ranks.
INSIST_KILL_AFTER = 3.0
# An mpiexec with nothing started this long after a stop signal is stuck.
NOTHING_STARTED_AFTER = 2.0


def next_step(since_first, since_second, forced, started_anything):
    """What to do now with a job that was asked to stop (pure).

    Args:
        since_first: seconds since the first stop signal.
        since_second: seconds since the second one, or None.
        forced: whether the abort has been sent already.
        started_anything: whether mpiexec has any process in its session besides itself.

    Returns:
        ``"kill"`` (SIGKILL to the session), ``"force"`` (tell mpiexec to
        abort) or ``"wait"``.
    """
    if not started_anything and since_first >= NOTHING_STARTED_AFTER:
        return "kill"
    if since_second is not None and since_second >= INSIST_KILL_AFTER:
        return "kill"
    if since_first >= FORCE_AFTER + KILL_AFTER:
        return "kill"
    if not forced and (since_second is not None or since_first >= FORCE_AFTER):
        return "force"
    return "wait"


def _session_of(stat_text):
    # /proc/PID/stat: "pid (comm) state ppid pgrp session ..."; comm may hold spaces and parentheses.
    return int(stat_text.rsplit(")", 1)[1].split()[3])


def session_members(sid):
    """The pids of the live processes in session ``sid``, the leader excluded."""
    members = []
    for path in glob.glob("/proc/[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError), open(path) as fh:
            text = fh.read()
            pid = int(path.split("/")[2])
            if pid != sid and _session_of(text) == sid and text.rsplit(")", 1)[1].split()[0] != "Z":
                members.append(pid)
    return members


def kill_session(sid):
    """SIGKILL the leader ``sid`` and every process of its session on this host."""
    for pid in [sid] + session_members(sid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)

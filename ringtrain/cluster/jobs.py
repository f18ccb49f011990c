"""Running a launched job: passing signals on, waiting, restarting, and saying why it failed.

The decisions (which exit statuses are worth a restart, the restart line,
which rank log explains a failure) are pure functions; :func:`run_with_restarts`
is the part that starts processes. Imports only the standard library and
its neighbours in :mod:`ringtrain.cluster` (signals, reaper, leftovers).
"""

import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import time

from ..errors import UsageError
from . import leftovers, reaper
from .commits import check_ancestors, check_private_directory
from .signals import swapped_handlers

__all__ = ["NO_RESTART_STATUSES", "SIGUSR1_STOP", "exit_status", "should_restart", "restart_line", "gave_up_line",
           "not_restarted_line", "failure_report", "last_error_line", "format_failure_report", "failed_rank",
           "first_failed",
           "exit_record_name", "parse_exit_record", "read_rank_logs", "read_exit_records", "read_tail", "start_logs",
           "report_failure", "report_success", "Forwarder", "run_job", "run_with_restarts", "STOP_SIGNALS",
           "FORWARDED", "format_command", "MIN_LOG_SPACE", "free_bytes", "make_logdir"]


# --- restarts and failure reports (pure) --------------------------------------

# Statuses a restart cannot fix: 2 is a usage error (a bad flag or file, the
# same on the next run); 4 is a diverged training run (restarted with the same
# --lr it diverges again); 75 is a run that stopped before its Slurm job's
# time limit (a restart has no time left; the job's requeue goes on); 126 and
# 127 are a command that cannot be run; 138 is a run that stopped with a
# checkpoint on SIGUSR1, "checkpoint and stop", whoever sent it to the ranks
# (Slurm's --signal or a preemption reach them, not the launcher): a restart
# would undo the stop.
SIGUSR1_STOP = 128 + signal.SIGUSR1
NO_RESTART_STATUSES = (2, 4, 75, 126, 127, SIGUSR1_STOP)


def exit_status(returncode):
    """A Popen return code as a shell reports it: ``128 + signal`` when killed (pure)."""
    return 128 - returncode if returncode < 0 else returncode


def should_restart(status, restarts_done, max_restarts, stopped=False):
    """Whether a job that ended with ``status`` is started again (pure).

    Not after success, a usage error or a command that cannot run, not when
    the user stopped the launcher (``stopped``), and at most ``max_restarts`` times.
    """
    return (status != 0 and status not in NO_RESTART_STATUSES and not stopped
            and restarts_done < max_restarts)


def restart_line(status, restart, max_restarts, delay, rank=None):
    """The one line printed before restart number ``restart`` (pure)."""
    why = f" (rank {rank} failed)" if rank is not None else ""
    return (f"ringtrain launch: job exited with status {status}{why}; "
            f"restart {restart} of {max_restarts} in {delay:g}s")


def gave_up_line(status, restarts):
    """The line printed when a job failed again after its last allowed restart (pure)."""
    return (f"ringtrain launch: gave up: the job failed again (status {status}) after {restarts} restart(s), "
            "as many as --restarts allows; fix the failure above, or give a larger --restarts")


def not_restarted_line(status, sent_to_launcher=True):
    """The line printed when a job ended after a SIGUSR1, the user's to the launcher or one its ranks got (pure)."""
    if sent_to_launcher:
        return f"ringtrain launch: the job ended (status {status}) after the SIGUSR1 you sent; not restarting it"
    return (f"ringtrain launch: the job stopped with a checkpoint (status {status}) after a SIGUSR1 reached its "
            "ranks (Slurm's --signal, a preemption or a kill); not restarting it")


RESTART_MARK = "ringtrain launch: restart "
# What a rank that really failed leaves at the start of a line of its log:
# ringtrain's failure record ('rank R: <error>', from abort_on_error), the
# command line's own error line, or a Python traceback. Anywhere else in a
# line ("validation error: 0.3", a file named abort.py) it is just output.
_FAILED = re.compile(r"^(?:rank [0-9]+: (?!.*did not finish within)|ringtrain: error: |"
                     r"Traceback \(most recent call last\):)", re.MULTILINE)
# A watchdog's line names the rank it waited on; the stalled rank is the one
# named whose own log has no such line (it was not waiting: it was stuck).
_WAITED_ON = re.compile(r"^rank [0-9]+: .*did not finish within.*; waiting on rank ([0-9]+)", re.MULTILINE)
_TIMED_OUT = re.compile(r"^rank [0-9]+: .*did not finish within", re.MULTILINE)
# How much of the end of each rank log the report reads: the last lines are
# all it shows, and a long run's log may be gigabytes.
TAIL_BYTES = 64 * 1024


def last_run(text):
    """The part of a rank log written by the latest run; restarts append after a mark (pure)."""
    at = text.rfind(RESTART_MARK)
    if at < 0:
        return text
    end = text.find("\n", at)
    return "" if end < 0 else text[end + 1:]


def exit_record_name(rank):
    """The file in the log directory that says when and how rank ``rank``'s command failed (rank_log writes it)."""
    return f"rank-{rank}.exit"


def parse_exit_record(text):
    """``(time, status)`` from an exit record's text, or None when it is not one (pure)."""
    parts = text.split()
    try:
        return (float(parts[0]), int(parts[1])) if len(parts) == 2 else None
    except ValueError:
        return None


def last_error_line(text):
    """The line that names the error of the last traceback (or ringtrain failure record) in a log, or None (pure).

    ``ValueError: bad shape`` from a traceback; ``rank 1: ValueError: ...``
    from ringtrain's own record. What tells one failure from another.
    """
    found = None
    lines = text.splitlines()
    for number, line in enumerate(lines):
        if line.startswith("Traceback (most recent call last):"):
            after = [rest for rest in lines[number + 1:] if rest and not rest[:1].isspace()]
            found = after[0] if after else found
        elif re.match(r"rank [0-9]+: ", line) and not _TIMED_OUT.match(line):
            found = line
    return None if found is None else _cut(found)


def first_failed(exits):
    """The rank whose process failed first, from ``{rank: (time, status)}``, or None (pure)."""
    return min(exits, key=lambda rank: (exits[rank][0], rank)) if exits else None


def failed_rank(logs):
    """The rank whose log shows it failed, or None when no log does (pure).

    The lowest rank that left a failure record or a traceback; failing that,
    a rank that other ranks' watchdogs waited on and that was not waiting
    itself. Output that merely contains "error:" blames nobody.
    """
    failed = [rank for rank in sorted(logs) if _FAILED.search(logs[rank])]
    if failed:
        return failed[0]
    named = sorted({int(m) for text in logs.values() for m in _WAITED_ON.findall(text)})
    stalled = [rank for rank in named if not _TIMED_OUT.search(logs.get(rank, ""))]
    return stalled[0] if stalled else None


def failure_report(logs, lines=10, max_ranks=4, exits=None):
    """Which rank failed and the log lines that show why (pure).

    Args:
        logs: ``{rank: text of the latest run}`` for the rank logs this host can read.
        lines: how many lines to show from each log.
        max_ranks: how many logs to show when none shows a failure.
        exits: ``{rank: (time, status)}`` of the ranks whose process failed
            (their exit records), for when no log shows who failed.

    Returns:
        ``(rank, [(rank, last lines), ...])``: the rank :func:`failed_rank`
        blames (else the one whose process failed first) and its last
        lines; or, when none is, ``None`` and the last lines of the first
        ``max_ranks`` non-empty logs.
    """
    def tail(text):
        return text.splitlines()[-lines:]
    rank = failed_rank(logs)
    rank = rank if rank is not None else first_failed(exits or {})
    if rank is not None:
        return rank, [(rank, tail(logs.get(rank, "")))]
    shown = [(rank, tail(logs[rank])) for rank in sorted(logs) if logs[rank].strip()]
    return None, shown[:max_ranks]


def format_failure_report(logdir, shown):
    """The report's lines: a header per log, then its lines indented (pure)."""
    out = []
    for rank, tail in shown:
        path = os.path.join(logdir, f"rank-{rank}.log")
        if not tail:  # a rank killed (SIGKILL, the OOM killer) before it printed anything
            out.append(f"ringtrain launch: {path} is empty: rank {rank} printed nothing before it ended")
            continue
        out.append(f"ringtrain launch: last {len(tail)} line(s) of {path}:")
        out += ["    " + _cut(line) for line in tail]
    return out


# A log's last "line" may be megabytes without a newline (a progress bar, a
# dump cut short by a full disk); the report shows its start.
MAX_LINE = 500


def _cut(line):
    return line if len(line) <= MAX_LINE else f"{line[:MAX_LINE]}... ({len(line):,} characters)"


def read_rank_logs(logdir, ranks=None):
    """``{rank: text of the latest run}`` for every ``rank-R.log`` in ``logdir`` (with ``ranks``: R < ranks).

    A log of a rank the job does not have is an earlier, larger job's: never
    this job's failure.
    """
    logs = {}
    try:
        names = os.listdir(logdir)
    except OSError:
        return logs
    for name in names:
        match = re.fullmatch(r"rank-([0-9]+)\.log", name)
        if match and (ranks is None or int(match.group(1)) < ranks):
            try:
                logs[int(match.group(1))] = last_run(read_tail(os.path.join(logdir, name)))
            except OSError:
                continue
    return logs


def read_exit_records(logdir, ranks=None):
    """``{rank: (time, status)}`` from the exit records in ``logdir`` (the latest run's only; R < ``ranks``)."""
    records = {}
    with contextlib.suppress(OSError):
        for name in os.listdir(logdir):
            match = re.fullmatch(r"rank-([0-9]+)\.exit", name)
            if match and (ranks is None or int(match.group(1)) < ranks):
                with contextlib.suppress(OSError):
                    record = parse_exit_record(read_tail(os.path.join(logdir, name), 256))
                    if record is not None:
                        records[int(match.group(1))] = record
    return records


def start_logs(logdir, ranks, restart):
    """Before start ``restart`` (0 first) of a job of ``ranks`` ranks: no earlier run's output may pass for its own.

    Removes every exit record, and at a first start empties the logs of
    ranks ``0..ranks-1``, as each rank's wrapper does when it starts: a rank
    that mpiexec ends before its wrapper runs (another rank died at once)
    would otherwise leave an earlier launch's log, traceback and exit record
    in the directory, and the report would blame that.
    """
    with contextlib.suppress(OSError):
        for name in os.listdir(logdir):
            if re.fullmatch(r"rank-[0-9]+\.exit", name):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(logdir, name))
    if restart:
        return
    for rank in range(ranks):
        path = os.path.join(logdir, f"rank-{rank}.log")
        with contextlib.suppress(OSError):
            if os.path.islink(path):  # never written through: the link goes, its target stays
                os.unlink(path)
            elif os.path.exists(path):
                os.close(os.open(path, os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW))


def read_tail(path, limit=TAIL_BYTES):
    """The last ``limit`` bytes of a file as text, from its first whole line."""
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(max(0, size - limit))
        data = f.read(limit)
    if size > limit:
        data = data[data.find(b"\n") + 1:]
    return data.decode("utf-8", errors="replace")


# --- running it -------------------------------------------------------------

# Signals the user sends to stop a job, and the one passed on as it is
# (SIGUSR1: programs use it for "checkpoint now"). mpiexec forwards each to
# every rank, on every host.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
FORWARDED = STOP_SIGNALS + (signal.SIGUSR1,)


class Forwarder:
    """While installed, passes the launcher's signals on to the running job.

    mpiexec runs in its own session, so a Ctrl-C at the terminal reaches only
    the launcher and is passed on once: Hydra takes a second SIGINT as "force
    abort", so a job that saw the terminal's signal and ours would be killed
    without its chance to end cleanly.
    """

    def __init__(self):
        self.proc = None
        self.stopped = None  # the first stop signal received, if any
        self.stopped_at = None
        self.insisted_at = None  # when a second stop signal came
        self.asked_to_checkpoint = False  # the user sent SIGUSR1: a job that ends after it is not restarted
        self._handlers = None

    def __enter__(self):
        # Only in the main thread; elsewhere (launch() called from a
        # library's thread) signals keep their old meaning.
        self._handlers = swapped_handlers(FORWARDED, self._handle)
        self._handlers.__enter__()
        return self

    def __exit__(self, *exc):
        self._handlers.__exit__(None, None, None)

    def _handle(self, signum, frame):
        if signum == signal.SIGUSR1:
            self.asked_to_checkpoint = True
        if signum in STOP_SIGNALS and self.stopped is not None and self.insisted_at is None:
            self.insisted_at = time.monotonic()
        if signum in STOP_SIGNALS and self.stopped is None:
            self.stopped, self.stopped_at = signum, time.monotonic()
        # SIGHUP becomes SIGTERM: in its own session mpiexec has no terminal to lose.
        self.send(signal.SIGTERM if signum == signal.SIGHUP else signum)

    def send(self, signum):
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signum)
            except ProcessLookupError:
                pass


def _die_with_launcher():
    """In the child before exec: SIGTERM mpiexec if the launcher dies (SIGKILL, OOM) first."""
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG, Linux only
    except (OSError, AttributeError):
        pass


def _wait(proc, forwarder, tick=None):
    """Wait for mpiexec to end; after a stop signal, escalate as :func:`reaper.next_step` says.

    ``tick``, if given, is called about five times a second while the job
    runs and nobody asked it to stop (the elastic launcher watches its hosts).
    """
    forced = False
    while True:
        try:
            return proc.wait(timeout=0.2)
        except subprocess.TimeoutExpired:
            pass
        if forwarder.stopped is None:
            if tick is not None:
                tick()
            continue
        now = time.monotonic()
        insisted = None if forwarder.insisted_at is None else now - forwarder.insisted_at
        step = reaper.next_step(now - forwarder.stopped_at, insisted, forced,
                                started_anything=bool(reaper.session_members(proc.pid)))
        if step == "kill":
            reaper.kill_session(proc.pid)
        elif step == "force":
            forced = True
            forwarder.send(signal.SIGINT)
            forwarder.send(signal.SIGINT)


def run_job(args, env, forwarder, tick=None):
    """Start mpiexec, pass signals on while it runs, and return its exit status.

    After a failure, the shared-memory segments the job left on this host
    are removed (:mod:`ringtrain.cluster.leftovers`). ``tick``: see :func:`_wait`.
    """
    if forwarder.stopped is not None:
        return 128 + forwarder.stopped
    use_pdeathsig = sys.platform.startswith("linux")
    before, since = leftovers.segments(), time.time()
    forwarder.proc = subprocess.Popen(args, env=env, start_new_session=True,
                                      preexec_fn=_die_with_launcher if use_pdeathsig else None)
    try:
        if forwarder.stopped is not None:  # a signal came while it was starting
            forwarder.send(forwarder.stopped)
        status = exit_status(_wait(forwarder.proc, forwarder, tick))
    finally:
        forwarder.proc = None
    if status != 0:
        leftovers.sweep(before, since)
    return status


def _sleep_unless_stopped(seconds, forwarder):
    """Sleep, but wake within 0.1 s of a stop signal; True when stopped."""
    end = time.monotonic() + seconds
    while forwarder.stopped is None and time.monotonic() < end:
        time.sleep(min(0.1, max(0.0, end - time.monotonic())))
    return forwarder.stopped is not None


def report_failure(logdir, stderr, ranks=None):
    """Print the failing rank's last lines from the logs of ranks below ``ranks``; returns the rank, if known."""
    if logdir is None:
        return None
    rank, shown = failure_report(read_rank_logs(logdir, ranks), exits=read_exit_records(logdir, ranks))
    for line in format_failure_report(logdir, shown):
        print(line, file=stderr)
    full = _full_disk_line(logdir)
    if full:
        print(full, file=stderr)
    stderr.flush()
    return rank


def report_success(logdir, stderr, lines=5):
    """After ``-o``: say the job finished, and show the end of rank 0's log (where the output went).

    When the logs' file system is full, say that they are cut short.
    """
    path = os.path.join(logdir, "rank-0.log")
    try:
        tail = last_run(read_tail(path)).splitlines()[-lines:]
    except OSError:
        tail = []
    print(f"ringtrain launch: the job finished (exit status 0); each rank's output is in "
          f"{os.path.join(logdir, 'rank-R.log')}" + (f"; the last {len(tail)} line(s) of {path}:" if tail else ""),
          file=stderr)
    for line in tail:
        print("    " + _cut(line), file=stderr)
    full = _full_disk_line(logdir)  # else the lines above pass for the job's last ones
    if full:
        print(full, file=stderr)
    stderr.flush()


def _full_disk_line(logdir):
    """The line that says the rank logs are cut short because their file system is full, or None."""

    free = free_bytes(logdir)
    if free is None or free >= MIN_LOG_SPACE:
        return None
    return (f"ringtrain launch: the file system of {logdir} is full ({free:,} bytes free): the ranks' output "
            "there is cut short, and a rank that cannot write its output may fail for that alone; free some "
            "space or choose another -o")


def run_with_restarts(args_for, env, logdir, max_restarts, delay, stderr, ranks=None):
    """Run the job, and again after each failure a restart may fix, up to ``max_restarts`` times.

    Args:
        args_for: ``args_for(restart)`` is the job's command line for attempt ``restart`` (0 first).
        env: the job's environment.
        logdir: the per-rank log directory (``-o``), or None.
        max_restarts: how many times a failed job may be started again.
        delay: seconds to wait before each restart.
        stderr: where the launcher's own lines go.
        ranks: the job's rank count: only those ranks' logs are read.

    Returns:
        The last attempt's exit status.
    """
    with Forwarder() as forwarder:
        restart = 0
        while True:
            forwarder.asked_to_checkpoint = False
            if logdir is not None and ranks is not None:
                start_logs(logdir, ranks, restart)
            status = run_job(args_for(restart), env, forwarder)
            stopped = forwarder.stopped is not None
            if status == 0 or stopped:
                return status
            if forwarder.asked_to_checkpoint or status == SIGUSR1_STOP:
                print(not_restarted_line(status, forwarder.asked_to_checkpoint), file=stderr, flush=True)
                return status
            rank = report_failure(logdir, stderr, ranks)
            if not should_restart(status, restart, max_restarts, stopped):
                if max_restarts and status not in NO_RESTART_STATUSES:
                    print(gave_up_line(status, restart), file=stderr, flush=True)
                return status
            restart += 1
            print(restart_line(status, restart, max_restarts, delay, rank), file=stderr, flush=True)
            if _sleep_unless_stopped(delay, forwarder):
                return status


# --- the -o log directory and the command line, shared by the plain and the elastic launch ----

def format_command(args, env=None):
    """One shell line for ``args``, with ``env`` as ``NAME=value`` prefixes (pure)."""
    prefix = [f"{k}={shlex.quote(v)}" for k, v in sorted((env or {}).items())]
    return " ".join(prefix + [shlex.quote(a) for a in args])


# Below this much free space, not even the ranks' first lines fit in their logs.
MIN_LOG_SPACE = 64 * 1024


def free_bytes(path):
    """Bytes an ordinary user may still write on ``path``'s file system, or None when it will not say.

    None too for a file system with no blocks at all (/proc, /sys): it has
    no space to run out of, and says 0.
    """
    try:
        fs = os.statvfs(path)
    except (OSError, AttributeError):
        return None
    return fs.f_bavail * fs.f_frsize if fs.f_blocks else None


def make_logdir(logdir):
    """Create ``-o``'s directory (mode 0700), or say in one line why it cannot be, or is not the user's own.

    Another user's directory, or one others may write, could hold logs and
    exit records planted to blame the wrong rank, or an elastic commit that
    runs their code: it is refused (:func:`ringtrain.cluster.commits.check_private_directory`), and so is
    one under a directory they may write, where they could swap it; nothing is made under such a directory.
    """
    check_ancestors(logdir, "-o")
    try:
        os.makedirs(logdir, mode=0o700, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"-o {logdir}: cannot create it ({exc.strerror}); choose another log directory") from None
    check_private_directory(logdir, "-o")  # after too: another user may have made it first

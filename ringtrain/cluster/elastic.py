"""Elastic launch: the MPI job restarted on the hosts there are, between ``--min-np`` and ``--max-np`` ranks.

MPI cannot shrink or grow a running job's world, so ``ringtrain launch``
does what torchrun does rather than what horovodrun does: when a rank fails,
or the discovery script's hosts change, the whole job is started again at
the size the hosts allow, and the program resumes from its last commit
(``hvd.elastic.run``) or checkpoint (``ringtrain train``)::

    ringtrain launch -np 4 --min-np 2 --max-np 8 --host-discovery-script ./hosts.sh -- python train.py

The launcher's side of the contract with the job (the job's side is
:mod:`ringtrain.torch.elastic`):

* ``RINGTRAIN_ELASTIC_DIR``: a directory on the launcher's file system (it
  must be shared with the host of rank 0) where rank 0 writes its commits,
  under ``commits/``, and the launcher its host notices (``hosts.json``).
  It must be the user's own, writable by nobody else; the launcher makes
  its key (``commit.key``), and rank 0 restores only commits signed with
  it (:mod:`ringtrain.cluster.commits` has the trust model);
* ``RINGTRAIN_ELASTIC_JOB``: which start of the job this is (0 first);
* ``RINGTRAIN_ELASTIC_GENERATION``: the host notices' generation the job
  started at. A higher one in ``hosts.json`` asks the job to stop at its next
  commit with :data:`RESTART_STATUS`, to be started again on the new hosts.
  A job that has not said it listens (``listening.json``, written by
  ``hvd.elastic.run``) is sent SIGUSR1 instead, which ``ringtrain train``
  takes as "checkpoint and stop".

The pure decisions are :mod:`ringtrain.cluster.discovery`'s; this module
runs them. Imports only the standard library and its neighbours.
"""

import contextlib
import os
import shutil
import signal
import tempfile
import time

from ..errors import UsageError
from ..io.safeio import printable
from .commits import (COMMITS, ENV_DIR, ENV_GENERATION, ENV_JOB, CommitStore, check_ancestors,
                      check_private_directory, elastic_env, elastic_start, is_listening, make_key,
                      make_private_directory, read_notice, under_elastic_launch, write_listening, write_notice)
from .discovery import (DiscoveryError, DiscoveryPoller, HostBook, assign, check_elastic_numbers, discovery_command,
                        format_hosts, host_of_rank, run_discovery)
from .hostfiles import Host, check_hosts, check_np, parse_host_list, read_hostfile
from .jobs import (NO_RESTART_STATUSES, SIGUSR1_STOP, Forwarder, first_failed, format_command, last_error_line,
                   make_logdir, not_restarted_line, read_exit_records, read_rank_logs, report_failure, report_success,
                   run_job, start_logs)
from .signals import swapped_handlers

__all__ = ["ENV_DIR", "ENV_JOB", "ENV_GENERATION", "RESTART_STATUS", "COMMITS", "ELASTIC_TIMEOUT", "SAME_ERROR_LIMIT",
           "elastic_env",
           "under_elastic_launch", "elastic_start", "write_notice", "read_notice", "write_listening",
           "is_listening", "launch_elastic"]

# sysexits' EX_TEMPFAIL ("try again later"): the job stopped so that it can
# be started again on other hosts; nothing failed.
RESTART_STATUS = 75
# How long the launcher waits for --min-np slots before it gives up. The
# job's processes are gone while it waits and its commit is on disk, so
# giving up loses nothing: launching again resumes.
ELASTIC_TIMEOUT = 30.0
# How many times in a row the job may fail the same way (the same exit
# status, failing rank and last error line) before the launch gives up:
# a restart cannot fix a deterministic error in the program, and with a
# cool-down and no --reset-limit nothing else would end the launch.
SAME_ERROR_LIMIT = 5
# How often the discovery script runs (horovodrun's period).
POLL_SECONDS = 1.0
# The host of a launch given no hosts at all.
LOCAL = "localhost"
# How a rank's exit record reads when it ended as a stop the launcher asked for: of SIGUSR1 (killed,
# or a program's exit as if), or killed by mpiexec once a rank had died of a signal.
_STOPPED = (-signal.SIGUSR1, SIGUSR1_STOP)
_STOP_ENDS = _STOPPED + (-signal.SIGKILL, 128 + signal.SIGKILL)


# --- where commits live ---------------------------------------------------------

def commit_directory(logdir, env):
    """``(directory, owned)``: the user's ``RINGTRAIN_ELASTIC_DIR``, else ``LOGDIR/elastic``, else a new one.

    ``owned`` directories are the launcher's to remove once the job succeeds.
    """
    if env.get(ENV_DIR):
        return os.path.abspath(env[ENV_DIR]), False
    if logdir is not None:
        return os.path.join(logdir, "elastic"), True
    return tempfile.mkdtemp(prefix="ringtrain-elastic-"), True


def _prepare_directory(directory, given):
    """Make the commit directory, its ``commits/`` and its key, all the user's own (0700; no link under it).

    ``given``: the user named it (``RINGTRAIN_ELASTIC_DIR``), so it may be
    their own link; the one under ``-o`` is the launcher's, and may not.
    """
    make_private_directory(directory, ENV_DIR if given else "the commit directory", link_ok=given)
    make_private_directory(os.path.join(directory, COMMITS), ENV_DIR if given else "the commit directory",
                           link_ok=False)
    make_key(directory)


def _has_commit(directory):
    with contextlib.suppress(OSError):
        return any(name.startswith("ckpt-") for name in os.listdir(os.path.join(directory, COMMITS)))
    return False


def _resumable(directory):
    """The sequence of the commit rank 0 will restore, checked as rank 0 checks it (never unpickled); else None.

    A file named like a commit proves nothing: one that another user
    planted, or one signed with another key, is skipped by rank 0, which
    says so itself.
    """
    try:
        found = CommitStore(directory).newest_verified(warn=lambda line: None)
    except (UsageError, OSError):  # rank 0 refuses it in one line of its own
        return None
    return None if found is None else found[1]["step"]


def _clear_records(directory):
    """Remove the exit records of an earlier start: rank numbers change with the size."""
    with contextlib.suppress(OSError):
        for name in os.listdir(directory):
            if name.startswith("rank-") and name.endswith(".exit"):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(directory, name))


# --- the launcher -------------------------------------------------------------

class _Launcher:
    """One elastic launch: its hosts, its starts and what it prints."""

    def __init__(self, plan, numbers, discovery, fixed, slots_per_host, limits, cooldown, delay, directory, stderr):
        self.plan, self.delay, self.stderr = plan, delay, stderr
        self.np, (self.min_np, self.max_np) = plan.np, numbers
        self.discovery, self.fixed, self.slots_per_host = discovery, fixed, slots_per_host
        self.timeout, self.reset_limit, self.same_error_limit = limits
        self.last_failure, self.same_failures = None, 0
        self.directory = directory
        self.records = plan.logdir
        self.book = HostBook(cooldown=cooldown)
        self._warned = None
        self.told_kept = False
        self.poller = None

    def say(self, line):
        print(f"ringtrain launch: {line}", file=self.stderr, flush=True)

    def discover(self, first=False):
        """Update the host book from discovery; the first failure is the user's to fix, later ones are warned of.

        The first run is waited for; later answers come from the poller's
        thread (:meth:`poll`) and are taken without waiting, so a script
        that hangs never holds up the loop that watches the job and the signals.
        """
        if self.discovery is None:
            fixed = self.fixed or (Host(LOCAL, self.max_np or self.np),)
            return self.book.update({h.name: h.slots for h in fixed})
        if first:
            try:
                # Waited for before any Forwarder: a SIGTERM or SIGHUP here would end the launcher at once and
                # leave the script's group (a session of its own) running; raised, it unwinds through
                # run_discovery, which kills the group, as Ctrl-C's KeyboardInterrupt does.
                with swapped_handlers((signal.SIGTERM, signal.SIGHUP), _exit_on_signal):
                    return self.book.update(run_discovery(self.discovery, self.slots_per_host or 1))
            except DiscoveryError as exc:
                raise UsageError(f"{exc}; fix the script, which must print 'host:slots' lines") from None
        found = self.poller.take() if self.poller is not None else None
        if isinstance(found, DiscoveryError):
            if str(found) != self._warned:
                self._warned = str(found)
                self.say(f"warning: {found}; keeping the hosts it gave before")
            return set()
        if found is None:
            return set()
        self._warned = None
        return self.book.update(found)

    def poll(self):
        """A context in which the discovery script runs about every ``POLL_SECONDS`` on its own thread."""
        if self.discovery is None:
            return contextlib.nullcontext()
        self.poller = DiscoveryPoller(self.discovery, self.slots_per_host or 1, POLL_SECONDS)
        return self.poller

    def wait_for_slots(self, need, forwarder):
        """The hosts to start on once they give ``need`` slots; None when stopped or out of time."""
        deadline = time.monotonic() + self.timeout
        told = False
        while True:
            hosts = self.book.available()
            if sum(h.slots for h in hosts) >= need:
                return hosts
            if forwarder.stopped is not None or time.monotonic() >= deadline:
                return None
            if not told:
                self.say(f"waiting up to {self.timeout:g}s (--elastic-timeout) for {need} slot(s); "
                         f"the hosts give {self.describe_hosts()}")
                told = True
            _sleep(min(0.1, max(0.0, deadline - time.monotonic())), forwarder)
            self.discover()

    def describe_hosts(self):
        """``3 slot(s) (h1:2,h2:1; left out after repeated failures: h3)``."""
        hosts = self.book.available()
        text = f"{sum(h.slots for h in hosts)} slot(s) ({format_hosts(hosts)}"
        out = self.book.left_out()
        if out:
            text += f"; left out after repeated failures: {', '.join(out)}"
        return text + ")"

    def blame(self, assignment, failed):
        """Count a failure against the failing rank's host, or every host when none is known."""
        names = [host_of_rank(assignment, failed)] if failed is not None else [h.name for h in assignment]
        for name in names:
            if name is not None and self.book.record_failure(name):
                self.say(f"host {name} is left out after failing {self.book.exclude_after} times")

    def failed_the_same_way(self, status, failed, size):
        """Count a failure; True (after saying so) when it is the ``--same-error-limit``-th alike in a row.

        Alike: the same exit status, failing rank and last error line of
        its log (with ``-o``; without, status and rank only).
        """
        line = None
        if self.plan.logdir is not None and failed is not None:
            line = last_error_line(read_rank_logs(self.plan.logdir, size).get(failed, ""))
        signature = (status, failed, line)
        self.same_failures = self.same_failures + 1 if signature == self.last_failure else 1
        self.last_failure = signature
        if not self.same_error_limit or self.same_failures < self.same_error_limit:
            return False
        what = f"status {status}" + ("" if failed is None else f", rank {failed}") + \
            (f": {printable(line)}" if line else "")  # the program's text: escaped, never sent to the terminal
        self.say(f"gave up: the job failed the same way {self.same_failures} times in a row ({what}); a restart "
                 f"cannot fix that: fix the program, or give a larger --same-error-limit{_kept(self)}")
        return True

    def args(self, assignment, job):
        """The MPI command line and extra environment of start ``job`` on ``assignment``."""
        size = sum(h.slots for h in assignment)
        local = self.discovery is None and self.fixed is None  # no hosts given: mpirun's own placement
        return self.plan.start(size, None if local else assignment, job, None if self.plan.logdir else self.records)


class _Watch:
    """While a start runs: poll discovery, and ask the job to stop when the hosts it should use change."""

    def __init__(self, launcher, assignment, forwarder, job, generation):
        self.launcher, self.target, self.forwarder = launcher, assignment, forwarder
        self.job, self.generation = job, generation
        self.asked = False

    def tick(self):
        launcher = self.launcher
        changes = launcher.discover()  # never waits: the answers come from the poller's thread
        if self.asked:
            # Asked once: the restart already under way starts on the hosts there are then, so a change
            # (or a change back) since is folded into it. A second SIGUSR1 would make `ringtrain train`
            # abort without its checkpoint.
            return
        wanted = assign(launcher.book.available(), launcher.max_np)
        if wanted == self.target or sum(h.slots for h in wanted) < launcher.min_np:
            return
        self.target, self.generation, self.asked = wanted, self.generation + 1, True
        write_notice(launcher.directory, self.generation, changes or {"added", "removed"})
        how = "at its next commit"
        if not is_listening(launcher.directory, self.job):
            self.forwarder.send(signal.SIGUSR1)
            how = "now (SIGUSR1: checkpoint and stop)"
        launcher.say(f"the hosts changed ({format_hosts(wanted)}); asking the job to stop {how} and "
                     f"restarting it at {sum(h.slots for h in wanted)} rank(s)")


def _exit_on_signal(signum, frame):
    raise SystemExit(128 + signum)


def _sleep(seconds, forwarder):
    end = time.monotonic() + seconds
    while forwarder.stopped is None and time.monotonic() < end:
        time.sleep(min(0.1, max(0.0, end - time.monotonic())))


def _run(launcher, np, env):
    """The starts, until one succeeds, the user stops it, or too few hosts are left."""
    job, generation, resets, need, status = 0, 0, 0, np, 1
    with Forwarder() as forwarder, launcher.poll():
        while True:
            hosts = launcher.wait_for_slots(need, forwarder)
            if hosts is None:
                if forwarder.stopped is not None:
                    return status
                flag = "-np" if job == 0 else "--min-np"
                launcher.say(f"gave up: the hosts give {launcher.describe_hosts()}, fewer than {flag} "
                             f"{need}, after waiting {launcher.timeout:g}s (--elastic-timeout){_kept(launcher)}")
                return status if job else 1
            assignment = assign(hosts, launcher.max_np)
            args, extra = launcher.args(assignment, job)
            size = sum(h.slots for h in assignment)
            if launcher.plan.logdir is not None:
                start_logs(launcher.plan.logdir, size, job)
            else:
                _clear_records(launcher.records)
            launcher.say(f"{'starting' if job == 0 else 'restarting'} {sum(h.slots for h in assignment)} rank(s) "
                         f"on {format_hosts(assignment)}: {_format(args, extra)}")
            forwarder.asked_to_checkpoint = False
            watch = _Watch(launcher, assignment, forwarder, job, generation)
            job_env = dict(env, **extra, **elastic_env(launcher.directory, job, generation))
            status = run_job(args, job_env, forwarder, tick=watch.tick)
            generation = watch.generation
            if status == 0 or forwarder.stopped is not None:
                return status
            if forwarder.asked_to_checkpoint:
                launcher.say(not_restarted_line(status).split(": ", 1)[1] + _kept(launcher))
                return status
            # A stop the launcher asked for (the ranks' exit records are where -o put them, or the job's own).
            planned = watch.asked and stopped_as_asked(status, read_exit_records(launcher.records, size))
            if not planned and status == SIGUSR1_STOP:  # a SIGUSR1 that reached the ranks, not from here
                launcher.say(not_restarted_line(status, False).split(": ", 1)[1] + _kept(launcher))
                return status
            if not planned:
                failed = report_failure(launcher.plan.logdir, launcher.stderr, size) if launcher.plan.logdir else \
                    blamed_rank(read_exit_records(launcher.records, size), watch.asked)
                if status in NO_RESTART_STATUSES:
                    return status
                launcher.blame(assignment, failed)
                where = "" if failed is None else f" (rank {failed} on {host_of_rank(assignment, failed)} failed)"
                launcher.say(f"the job exited with status {status}{where}")
                if launcher.failed_the_same_way(status, failed, size):
                    return status
            resets += 1
            if launcher.reset_limit is not None and resets > launcher.reset_limit:
                launcher.say(f"gave up: the job needed restart {resets}, more than --reset-limit "
                             f"{launcher.reset_limit}{_kept(launcher)}")
                return status
            need, job = launcher.min_np, job + 1
            if not planned:
                _sleep(launcher.delay, forwarder)


def stopped_as_asked(status, exits):
    """Whether a job's ``status`` is how the stop the launcher asked for ends it (pure, given the ranks' ``exits``).

    A commit's 75, or SIGUSR1's end: 138 from a program that exits so, or the
    bare 10 that MPICH's mpiexec reports for a rank the signal killed. mpiexec
    ORs its ranks' statuses, and kills the ranks still running once one has
    died of a signal: a rank slower to die of SIGUSR1 (a loaded machine, a
    program that holds the signal) then reads as SIGKILL's 9, and the job as
    10 | 9 = 11, SIGSEGV's number too. The ranks' exit records
    (``{rank: (time, status)}``, written by ``rank_log``) tell the two apart:
    a stop leaves at least one SIGUSR1 end and no end but SIGUSR1's and
    SIGKILL's (no records at all prove nothing: a crash is blamed).
    """
    if status in (RESTART_STATUS, signal.SIGUSR1, SIGUSR1_STOP):
        return True
    if status != signal.SIGUSR1 | signal.SIGKILL:
        return False
    codes = [code for _, code in exits.values()]
    return any(code in _STOPPED for code in codes) and all(code in _STOP_ENDS for code in codes)


def blamed_rank(exits, asked):
    """The rank whose process failed first, from the ranks' exit records, or None (pure).

    Once the launcher has asked the job to stop, a rank that ended of that
    stop did as it was asked: the failure is the first end of another kind
    (a rank that crashed while the others stopped), not the first end.
    """
    if asked:
        exits = {rank: end for rank, end in exits.items() if end[1] not in _STOP_ENDS}
    return first_failed(exits)


def _kept(launcher):
    """``; the last commit is kept in DIR ...`` when there is one (and remember it was said)."""
    if not _has_commit(launcher.directory):
        return ""
    launcher.told_kept = True
    return (f"; the last commit is kept in {launcher.directory}: launch again with "
            f"{ENV_DIR}={launcher.directory} to resume from it")


def _format(args, extra):
    return format_command(args, extra)


def launch_elastic(plan, *, np, host_source, min_np, max_np, discovery_script, slots_per_host, elastic_timeout,
                   reset_limit, cooldown, restart_delay, check, dry_run, stdout, stderr, env=None,
                   same_error_limit=SAME_ERROR_LIMIT):
    """Run ``plan``'s command elastically; returns the last start's exit status.

    Everything is checked before anything starts: the numbers, the hosts,
    and the discovery script's first answer (a failing script is a usage
    error). The commit directory the launcher made is removed once the job
    succeeds, and kept (and named) when it gives up.

    Args:
        plan: the :class:`ringtrain.cluster.launch.Plan` of the command.
        np: ranks of the first start (waited for up to ``elastic_timeout``).
        host_source: ``(hostfile, host_list)``: fixed hosts instead of a script (both None: this host).
        min_np, max_np: the sizes a restart may have (``max_np`` None: as many as there are slots).
        discovery_script: a shell command that prints ``host:slots`` lines, or None.
        slots_per_host: slots of a discovered host printed without ``:slots``.
        elastic_timeout: seconds to wait for enough slots before giving up.
        reset_limit: restarts allowed (None: no limit).
        cooldown: ``(lower, upper)`` seconds a failing host stays out, or None (for good).
        restart_delay: seconds before a restart after a failure.
        same_error_limit: give up when the job fails the same way this many times in a row (0: never).
        check, dry_run: as for :func:`ringtrain.cluster.launch.launch`.
    """
    env = dict(os.environ if env is None else env)
    if env.get(ENV_DIR) and os.path.lexists(env[ENV_DIR]):  # a new one is made private at the start
        check_private_directory(os.path.abspath(env[ENV_DIR]), ENV_DIR)
    elif env.get(ENV_DIR):
        check_ancestors(os.path.abspath(env[ENV_DIR]), ENV_DIR)
    numbers = check_elastic_numbers(np, min_np, max_np, slots_per_host, elastic_timeout, reset_limit, cooldown)
    fixed = _fixed_hosts(np, numbers[1], host_source, discovery_script, slots_per_host, plan.oversubscribe)
    if discovery_script is not None:
        discovery_script = discovery_command(discovery_script)
    if same_error_limit < 0:
        raise UsageError(f"--same-error-limit must be at least 0 (0: no limit), got {same_error_limit}")
    launcher = _Launcher(plan, numbers, discovery_script, fixed, slots_per_host,
                         (elastic_timeout, reset_limit, same_error_limit), cooldown, restart_delay, None, stderr)
    launcher.discover(first=True)
    if check:
        _check_reachable(launcher.book.available(), stderr)
    if dry_run:
        launcher.records = plan.logdir or "ELASTIC_DIR"  # made at the real start
        if sum(h.slots for h in launcher.book.available()) < np:  # no command to show: it would wait first
            launcher.say(f"the hosts give {launcher.describe_hosts()} now, fewer than -np {np}: the launch would "
                         f"wait up to {elastic_timeout:g}s (--elastic-timeout) for them before it starts anything")
            return 0
        args, extra = launcher.args(assign(launcher.book.available(), numbers[1]), 0)
        print(_format(args, extra), file=stdout)
        return 0
    if plan.logdir is not None:
        make_logdir(plan.logdir)
    launcher.directory, owned = commit_directory(plan.logdir, env)
    launcher.records = plan.logdir or launcher.directory
    _prepare_directory(launcher.directory, given=not owned)
    resumable = _resumable(launcher.directory)
    if resumable is not None:
        launcher.say(f"{launcher.directory} holds commit {resumable} of an earlier launch, signed with its key: "
                     "the job resumes from it")
    stdout.flush()
    status = None
    try:
        status = _run(launcher, np, env)
    finally:
        # Kept when anything was committed and the job did not finish: it is the way back.
        if owned and (status == 0 or not _has_commit(launcher.directory)):
            shutil.rmtree(launcher.directory, ignore_errors=True)
        elif status != 0 and not launcher.told_kept and _has_commit(launcher.directory):
            launcher.say(_kept(launcher)[2:])
    if status == 0 and plan.logdir is not None:
        report_success(plan.logdir, stderr)
    return status


def _fixed_hosts(np, max_np, host_source, discovery_script, slots_per_host, oversubscribe):
    """The hosts when there is no discovery script (this host when none are given); checks the flags go together."""
    hostfile, host_list = host_source
    if discovery_script is not None and (hostfile or host_list):
        raise UsageError("give --host-discovery-script or --hostfile/-H, not both")
    if slots_per_host is not None and discovery_script is None:
        raise UsageError("--slots-per-host is for the lines of a --host-discovery-script that give no ':slots'")
    if discovery_script is not None:
        return None
    if not (hostfile or host_list):
        check_np(np, oversubscribe=oversubscribe, cpu_count=os.cpu_count())
        return None
    hosts = read_hostfile(hostfile) if hostfile else parse_host_list(host_list)
    check_np(np, hosts, oversubscribe=oversubscribe)
    return tuple(hosts)


def _check_reachable(hosts, stderr):
    """--check: one line per host MPI cannot reach, then a UsageError if there were any."""
    problems = check_hosts(hosts)
    for line in problems[:-1]:
        print(f"ringtrain: error: {line}", file=stderr)
    if problems:
        raise UsageError(problems[-1])

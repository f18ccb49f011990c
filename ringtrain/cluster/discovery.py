"""Elastic hosts: what a discovery script says, which hosts are left out after failures, where ranks go.

``ringtrain launch --host-discovery-script SCRIPT`` (horovodrun's flag) runs
SCRIPT through the shell about once a second; it prints one host a line,
``host:slots`` or a bare ``host`` (``--slots-per-host`` slots, default 1).
The launcher keeps a :class:`HostBook`: the hosts in the order they first
appeared (so rank 0 stays on the oldest host, where the last commit was
written), how often each one's ranks failed first, and which are excluded
for now (Horovod's blacklist, with its optional cool-down).

Pure but for :func:`run_discovery` (which runs the script, bounded in time
and in what it reads) and :class:`DiscoveryPoller` (which runs it on a
thread of its own); imports only the standard library and its neighbours.
Nothing here talks to MPI.
"""

import contextlib
import dataclasses
import math
import os
import random
import re
import selectors
import shutil
import signal
import subprocess
import threading
import time

from ..errors import UsageError
from .hostfiles import MAX_NP, Host, ipv6_problem, name_problem, shown

__all__ = ["DiscoveryError", "parse_discovery", "run_discovery", "discovery_command", "HostBook", "assign",
           "host_of_rank", "format_hosts", "cooldown_seconds", "check_elastic_numbers", "EXCLUDE_AFTER",
           "DISCOVERY_TIMEOUT", "COOLDOWN_LIMITS", "MAX_OUTPUT", "DiscoveryPoller", "kill_group"]

_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")
# A host whose ranks failed first this many times is left out (Horovod
# leaves one out at its first failure; a single flaky failure, an OOM kill
# of one worker, should not cost a one-host job its only host).
EXCLUDE_AFTER = 3
# A discovery script that has not answered in this long is killed and counts as failing.
DISCOVERY_TIMEOUT = 30.0
# A host list is a line per host: more output than this is no host list, and
# is refused as it arrives rather than read into memory whole.
MAX_OUTPUT = 1 << 20
# Horovod's bounds on --blacklist-cooldown-range, in seconds.
COOLDOWN_LIMITS = (1, 3600)


class DiscoveryError(Exception):
    """The discovery script failed or printed something that is not a host list (one line)."""


def parse_discovery(text, default_slots=1, source="host discovery script"):
    """``{host: slots}`` in the order printed, from a discovery script's output (pure).

    Each non-blank line is ``host:slots`` or ``host``; blank lines are
    skipped, and no output at all means no host is available now (the
    script may print nothing while instances start, as Horovod allows).

    Raises:
        DiscoveryError: naming the line and the expected form.
    """
    hosts = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line:
            continue
        where = f"{source} line {number}"
        v6 = ipv6_problem(line)
        if v6 is not None:
            raise DiscoveryError(f"{where}: {v6}")
        name, _, count = line.partition(":")
        if name_problem(name) is not None:  # a line may be up to MAX_OUTPUT long: it is quoted cut short
            raise DiscoveryError(f"{where}: {name_problem(name)}, got {shown(line)}")
        if not _NAME.fullmatch(name) or (count and not (count.isascii() and count.isdigit() and len(count) <= 9)):
            raise DiscoveryError(f"{where}: expected 'host:slots' or 'host', got {shown(line)}")
        slots = int(count) if count else default_slots
        if not 1 <= slots <= MAX_NP:
            raise DiscoveryError(f"{where}: slots must be between 1 and {MAX_NP}, got {shown(line)}")
        if name in hosts:
            raise DiscoveryError(f"{where}: host {name} is listed twice")
        hosts[name] = slots
    return hosts


def discovery_command(script, path=None):
    """The shell command that runs ``script`` (pure but for looking at files).

    horovodrun's documentation gives ``--host-discovery-script
    discover_hosts.sh``: a bare name that is a file here and no command on
    PATH means that file, as ``./discover_hosts.sh``.

    Raises:
        UsageError: it names a file here that cannot be executed.
    """
    name = script.strip()
    if not name:  # the shell runs blanks as an empty command: no hosts, ever, and a wait for them
        raise UsageError(f"--host-discovery-script {script!r}: an empty command; give the script that prints "
                         "the hosts")
    if any(c.isspace() for c in name) or os.sep in name or shutil.which(name, path=path):
        return script
    if not os.path.isfile(name):
        return script
    if not os.access(name, os.X_OK):
        raise UsageError(f"--host-discovery-script {name}: not executable; chmod +x {name}")
    return f"./{name}"


def run_discovery(script, default_slots=1, timeout=DISCOVERY_TIMEOUT, limit=MAX_OUTPUT, started=None):
    """Run ``script`` through the shell (as horovodrun does) and parse what it prints.

    The script runs in a process group of its own: after ``timeout``
    seconds, or once it printed more than ``limit`` bytes, the group is
    killed (its children too) and the answer is an error, never a hang or a
    MemoryError. ``started``, if given, is called with the process (so a
    caller on another thread can kill it).

    Raises:
        DiscoveryError: it could not run, exited non-zero, took longer than
            ``timeout`` seconds, printed more than ``limit`` bytes, or printed
            something that is not a host list.
    """
    try:
        proc = subprocess.Popen(script, shell=True, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True)
    except OSError as exc:
        raise DiscoveryError(f"host discovery script {script!r} could not run: {exc.strerror}") from None
    if started is not None:
        started(proc)
    why = "interrupted"
    try:
        out, err, why = _collect(proc, time.monotonic() + timeout, limit)
    finally:
        if why is not None or proc.poll() is None:  # its children too: one may hold the output open
            kill_group(proc)
        proc.stdout.close()
        proc.stderr.close()
    if why == "timeout":
        raise DiscoveryError(f"host discovery script {script!r} did not finish within {timeout:g}s; "
                             "it was killed")
    if why == "too much":
        raise DiscoveryError(f"host discovery script {script!r} printed more than {limit:,} bytes; a host "
                             "list is one 'host:slots' line per host")
    if proc.returncode != 0:
        said = (err.decode(errors="replace").strip().splitlines() or [""])[-1][:200]
        why = f": {said}" if said else ""
        raise DiscoveryError(f"host discovery script {script!r} exited with status {proc.returncode}{why}")
    return parse_discovery(out.decode(errors="replace"), default_slots, f"host discovery script {script!r}")


def _collect(proc, deadline, limit):
    """``(stdout, end of stderr, None | "timeout" | "too much")``: read both pipes until the script ends."""
    out, err = bytearray(), bytearray()
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ, out)
        selector.register(proc.stderr, selectors.EVENT_READ, err)
        while selector.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                return out, err, "timeout"
            for key, _ in selector.select(min(left, 0.5)):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    selector.unregister(key.fileobj)
                    continue
                key.data.extend(chunk)
                if key.data is out and len(out) > limit:
                    return out, err, "too much"
                if key.data is err:
                    del err[:-4096]  # only its last line is shown
    try:
        proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:  # it closed its output but goes on
        return out, err, "timeout"
    return out, err, None


def kill_group(proc):
    """SIGKILL ``proc``'s process group (a discovery script and whatever it started) and reap it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)


class DiscoveryPoller:
    """Runs the discovery script again and again on a thread of its own, so nothing waits for it.

    The launcher's loop watches the job and its signals; a script that
    hangs (for up to its ``timeout``) must not hold that up. :meth:`take`
    returns the newest answer without waiting.

    Args:
        script: the shell command.
        default_slots: slots of a host printed without ``:slots``.
        period: seconds between the end of one run and the start of the next.
        timeout: seconds one run may take before it is killed and counts as failed.
    """

    def __init__(self, script, default_slots=1, period=1.0, timeout=DISCOVERY_TIMEOUT):
        self.script, self.default_slots, self.period, self.timeout = script, default_slots, period, timeout
        self._lock = threading.Lock()
        self._answer, self._proc = None, None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="ringtrain-discovery", daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self.close()

    def _loop(self):
        while not self._stop.is_set():
            try:
                answer = run_discovery(self.script, self.default_slots, self.timeout, started=self._started)
            except DiscoveryError as exc:
                answer = exc
            with self._lock:
                self._answer, self._proc = answer, None
            self._stop.wait(self.period)

    def _started(self, proc):
        with self._lock:
            self._proc = proc
        if self._stop.is_set():
            kill_group(proc)

    def take(self):
        """The newest answer not taken yet: ``{host: slots}``, a :class:`DiscoveryError`, or None (none new)."""
        with self._lock:
            answer, self._answer = self._answer, None
        return answer

    def close(self):
        """Stop polling and kill a run under way."""
        self._stop.set()
        with self._lock:
            proc = self._proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        self._thread.join(timeout=10)


def cooldown_seconds(exclusions, limits, draw):
    """How long a host stays out after its ``exclusions``-th exclusion (pure; Horovod's formula).

    ``lower * 2**exclusions + draw * lower``, kept within ``limits``
    ``(lower, upper)``; ``draw`` is a number in [0, 1).
    """
    lower, upper = limits
    return max(lower, min(upper, lower * (1 << min(exclusions, 30)) + draw * lower))


@dataclasses.dataclass
class _HostState:
    failures: int = 0
    exclusions: int = 0
    out_until: float = None  # None: not excluded; math.inf: for good


class HostBook:
    """The launcher's record of the hosts: discovery's latest answer, failures and exclusions.

    Args:
        exclude_after: failures after which a host is left out.
        cooldown: ``(lower, upper)`` seconds, or None to leave a failing host
            out for the rest of the launch.
        clock: seconds, monotonic (a parameter so tests need not sleep).
        draw: a random number in [0, 1) for the cool-down's spread.
    """

    def __init__(self, exclude_after=EXCLUDE_AFTER, cooldown=None, clock=time.monotonic, draw=random.random):
        self.exclude_after, self.cooldown, self.clock, self.draw = exclude_after, cooldown, clock, draw
        self.order = []  # every host ever seen, oldest first
        self.slots = {}  # discovery's latest answer
        self.state = {}

    def update(self, found):
        """Take discovery's latest ``{host: slots}``; returns ``{"added", "removed"}`` for what changed."""
        changes = set()
        for name in self.slots:
            if name not in found or found[name] < self.slots[name]:
                changes.add("removed")
        for name, slots in found.items():
            if name not in self.slots or slots > self.slots[name]:
                changes.add("added")
            if name not in self.state:
                self.order.append(name)
                self.state[name] = _HostState()
        self.slots = dict(found)
        return changes

    def excluded(self, name):
        """True while ``name`` is left out (its cool-down, if any, not yet over)."""
        out = self.state[name].out_until if name in self.state else None
        return out is not None and self.clock() < out

    def record_failure(self, name):
        """Count a failure of ``name``'s ranks; True when that leaves the host out now."""
        state = self.state.setdefault(name, _HostState())
        if name not in self.order:
            self.order.append(name)
        if self.excluded(name):
            return False
        state.failures += 1
        if state.failures < self.exclude_after:
            return False
        state.failures = 0
        state.exclusions += 1
        state.out_until = (math.inf if self.cooldown is None
                           else self.clock() + cooldown_seconds(state.exclusions, self.cooldown, self.draw()))
        return True

    def available(self):
        """The hosts ranks may go to now, oldest first, as :class:`Host` records."""
        return [Host(name, self.slots[name]) for name in self.order
                if name in self.slots and not self.excluded(name)]

    def left_out(self):
        """The hosts discovery lists that are excluded now."""
        return [name for name in self.order if name in self.slots and self.excluded(name)]


def assign(hosts, max_np=None):
    """The hosts and slots a job uses: every slot in order, up to ``max_np`` ranks (pure).

    Ranks fill a host before the next, as MPI places them from a host list,
    so rank 0 is on the first (oldest) host.
    """
    placed, total = [], 0
    for host in hosts:
        take = host.slots if max_np is None else min(host.slots, max_np - total)
        if take <= 0:
            break
        placed.append(Host(host.name, take))
        total += take
    return placed


def host_of_rank(assignment, rank):
    """The host name rank ``rank`` runs on under ``assignment`` (pure), or None past its end."""
    for host in assignment:
        if rank < host.slots:
            return host.name
        rank -= host.slots
    return None


def format_hosts(hosts):
    """``h1:2,h2:1`` (pure); ``no hosts`` for none."""
    return ",".join(f"{h.name}:{h.slots}" for h in hosts) or "no hosts"


def check_elastic_numbers(np, min_np, max_np, slots_per_host, elastic_timeout, reset_limit, cooldown):
    """Refuse elastic settings that cannot work, before anything starts (pure).

    Returns ``(min_np, max_np)`` with their defaults: ``min_np`` is ``np``,
    ``max_np`` is unbounded (None), as in horovodrun.
    """
    min_np = np if min_np is None else min_np
    if min_np < 1:
        raise UsageError(f"--min-np must be at least 1, got {min_np}")
    if np < min_np:
        raise UsageError(f"-np {np} is below --min-np {min_np}; give -np between --min-np and --max-np")
    if max_np is not None and np > max_np:
        raise UsageError(f"-np {np} is above --max-np {max_np}; give -np between --min-np and --max-np")
    if max_np is not None and max_np < min_np:
        raise UsageError(f"--max-np {max_np} is below --min-np {min_np}; give --max-np at least --min-np")
    if slots_per_host is not None and not 1 <= slots_per_host <= MAX_NP:
        raise UsageError(f"--slots-per-host must be between 1 and {MAX_NP}, got {slots_per_host}")
    if not (math.isfinite(elastic_timeout) and elastic_timeout >= 0):
        raise UsageError(f"--elastic-timeout must be a number of seconds, at least 0, got {elastic_timeout}")
    if reset_limit is not None and reset_limit < 0:
        raise UsageError(f"--reset-limit must be at least 0, got {reset_limit}")
    if cooldown is not None:
        lower, upper = cooldown
        low, high = COOLDOWN_LIMITS
        if not (low <= lower <= upper <= high):
            raise UsageError(f"--blacklist-cooldown-range {lower} {upper}: give MIN MAX seconds with "
                             f"{low} <= MIN <= MAX <= {high}")
    return min_np, max_np

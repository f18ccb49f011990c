"""Elastic hosts: what a discovery script says, which hosts are left out after failures, where ranks go.

``ringtrain launch --host-discovery-script SCRIPT`` (horovodrun's flag) runs
SCRIPT through the shell about once a second; it prints one host a line,
``host:slots`` or a bare ``host`` (``--slots-per-host`` slots, default 1).
The launcher keeps a :class:`HostBook`: the hosts in the order they first
appeared (so rank 0 stays on the oldest host, where the last commit was
written), how often each one's ranks failed first, and which are excluded
for now (Horovod's blacklist, with its optional cool-down).

Pure but for :func:`run_discovery` (which runs the script); imports only
the standard library and its neighbours. Nothing here talks to MPI.
"""

import dataclasses
import math
import os
import random
import re
import shutil
import subprocess
import time

from ..errors import UsageError
from .hostfiles import MAX_NP, Host, ipv6_problem

__all__ = ["DiscoveryError", "parse_discovery", "run_discovery", "discovery_command", "HostBook", "assign",
           "host_of_rank", "format_hosts", "cooldown_seconds", "check_elastic_numbers", "EXCLUDE_AFTER",
           "DISCOVERY_TIMEOUT", "COOLDOWN_LIMITS"]

_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")
# A host whose ranks failed first this many times is left out (Horovod
# leaves one out at its first failure; a single flaky failure, an OOM kill
# of one worker, should not cost a one-host job its only host).
EXCLUDE_AFTER = 3
# A discovery script that has not answered in this long is treated as failing.
DISCOVERY_TIMEOUT = 30.0
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
        if not _NAME.fullmatch(name) or (count and not count.isdigit()):
            raise DiscoveryError(f"{where}: expected 'host:slots' or 'host', got {line!r}")
        slots = int(count) if count else default_slots
        if not 1 <= slots <= MAX_NP:
            raise DiscoveryError(f"{where}: slots must be between 1 and {MAX_NP}, got {line!r}")
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
    if not name or any(c.isspace() for c in name) or os.sep in name or shutil.which(name, path=path):
        return script
    if not os.path.isfile(name):
        return script
    if not os.access(name, os.X_OK):
        raise UsageError(f"--host-discovery-script {name}: not executable; chmod +x {name}")
    return f"./{name}"


def run_discovery(script, default_slots=1, timeout=DISCOVERY_TIMEOUT):
    """Run ``script`` through the shell (as horovodrun does) and parse what it prints.

    Raises:
        DiscoveryError: it could not run, exited non-zero, took longer than
            ``timeout`` seconds, or printed something that is not a host list.
    """
    try:
        done = subprocess.run(script, shell=True, capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL, errors="replace")
    except subprocess.TimeoutExpired:
        raise DiscoveryError(f"host discovery script {script!r} did not finish within {timeout:g}s") from None
    except OSError as exc:
        raise DiscoveryError(f"host discovery script {script!r} could not run: {exc.strerror}") from None
    if done.returncode != 0:
        said = (done.stderr.strip().splitlines() or [""])[-1]
        why = f": {said}" if said else ""
        raise DiscoveryError(f"host discovery script {script!r} exited with status {done.returncode}{why}")
    return parse_discovery(done.stdout, default_slots, f"host discovery script {script!r}")


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

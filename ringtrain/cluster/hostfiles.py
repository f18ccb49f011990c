"""Hosts: hostfiles in either MPI's syntax, ``-H`` lists, slot and ``-np`` bounds, and whether MPI can reach them.

Pure parsing and checks (tested without MPI or a network), plus
:func:`check_hosts`, which resolves each host and asks it over ssh, as
``mpiexec`` will. Imports only the standard library and :mod:`ringtrain.errors`.
"""

import concurrent.futures
import dataclasses
import ipaddress
import os
import re
import socket
import subprocess

from ..errors import UsageError
from ..io.safeio import Unreadable, open_regular_fd

__all__ = ["Host", "EXPECTED", "parse_hostfile", "read_hostfile", "parse_host_list", "format_hostfile",
           "check_slots", "check_total_slots", "np_limit", "check_np", "check_hosts", "ipv6_problem", "MAX_NP",
           "RANKS_PER_CORE", "MAX_NAME", "shown", "name_problem"]

EXPECTED = "expected 'host slots=N' or 'host:N'"
# The longest host name DNS allows: a longer "name" is garbage, and would go whole onto mpirun's command line.
MAX_NAME = 253
# How much of a bad entry an error quotes: the entry may be a whole file (or a discovery script's output) long.
SHOWN = 80
_HOST = r"[A-Za-z0-9_][A-Za-z0-9_.\-]*"
_MPICH_LINE = re.compile(rf"({_HOST})(?::([^:\s]*))?")
_OPENMPI_KEY = re.compile(r"(slots|max_slots|max-slots)=(\S*)")


@dataclasses.dataclass(frozen=True)
class Host:
    """One hostfile entry: a host and how many ranks it may run."""

    name: str
    slots: int = 1


# --- hostfiles (pure) -------------------------------------------------------

def shown(text):
    """``text`` quoted for a one-line error, cut to about :data:`SHOWN` characters (pure)."""
    return repr(text) if len(text) <= SHOWN else f"{text[:SHOWN - 3]!r}..."


def name_problem(name):
    """Why ``name`` is too long to be a host's, in words; None when it is not (pure)."""
    if len(name) > MAX_NAME:
        return f"a host name of {len(name):,} characters (at most {MAX_NAME})"
    return None


def _count(text, where, line, what="slots"):
    if not re.fullmatch(r"[0-9]+", text or ""):
        raise UsageError(f"{where}: {EXPECTED}, got {shown(line)}")
    value = int(text)
    if value < 1:
        raise UsageError(f"{where}: {what} must be at least 1, got {shown(line)}")
    if value > MAX_NP:
        raise UsageError(f"{where}: {what} {value:,} is above ringtrain launch's limit of {MAX_NP:,} per host, "
                         f"got {shown(line)}; give the host's real number of slots")
    return value


def check_total_slots(hosts, source):
    """Refuse hosts whose slots add up past :data:`MAX_NP` (pure).

    Hydra adds the slots up in a C int: two hosts of 2**30 slots overflow it,
    and mpiexec then spins at full CPU, deaf to SIGTERM, before starting
    anything. No job can use more than MAX_NP slots anyway.
    """
    total = sum(h.slots for h in hosts)
    if total > MAX_NP:
        raise UsageError(f"{source} gives {total:,} slots in all, above ringtrain launch's limit of {MAX_NP:,}; "
                         "give each host its real number of slots")
    return hosts


def ipv6_problem(entry):
    """The one line that refuses an IPv6 address as a host, or None when ``entry`` has none (pure).

    ``entry`` is a hostfile line, a ``-H`` item or a discovery line. MPI's
    host lists separate a host from its slots with a colon, and MPICH's
    mpiexec, given an IPv6 literal in a hostfile or ``-hosts``, hangs or
    tries to ssh to ``[``; a host name that resolves to the address works.
    """
    word = entry.split()[0] if entry.split() else ""
    candidates = [word, word.rsplit(":", 1)[0]]
    if word.startswith("["):
        candidates.append(word[1:].split("]", 1)[0])
    for text in candidates:
        try:
            address = ipaddress.IPv6Address(text.split("%", 1)[0])
        except ValueError:
            continue
        return (f"{shown(text)} is an IPv6 address, which MPI's host lists cannot carry; give the host by name "
                f"(an /etc/hosts line such as '{address} node1' makes one) or by its IPv4 address")
    return None


def _check_name(name, where, entry):
    problem = name_problem(name)
    if problem is not None:
        raise UsageError(f"{where}: {problem}, got {shown(entry)}; give the host's name")


def _parse_line(line, where):
    """One non-blank hostfile line (comment removed) -> Host, in either syntax."""
    v6 = ipv6_problem(line)
    if v6 is not None:
        raise UsageError(f"{where}: {v6}")
    words = line.split()
    if len(words) == 1:
        match = _MPICH_LINE.fullmatch(words[0])
        if not match:
            raise UsageError(f"{where}: {EXPECTED}, got {shown(line)}")
        name, count = match.groups()
        _check_name(name, where, line)
        return Host(name, 1 if count is None else _count(count, where, line))
    if not re.fullmatch(_HOST, words[0]):
        raise UsageError(f"{where}: {EXPECTED}, got {shown(line)}")
    _check_name(words[0], where, line)
    keys = {}
    for word in words[1:]:
        match = _OPENMPI_KEY.fullmatch(word)
        if not match:
            raise UsageError(f"{where}: {EXPECTED}, got {shown(line)}")
        key = match.group(1).replace("-", "_")
        if key in keys:
            raise UsageError(f"{where}: {key} given twice in {shown(line)}")
        keys[key] = _count(match.group(2), where, line, what=key)
    slots = keys.get("slots", 1)
    if keys.get("max_slots", slots) < slots:
        raise UsageError(f"{where}: max_slots is less than slots in {shown(line)}")
    return Host(words[0], slots)


def parse_hostfile(text, source="hostfile"):
    """Parse a hostfile in Open MPI or MPICH syntax (pure).

    Each line is ``host``, ``host:N`` (MPICH) or ``host slots=N [max_slots=M]``
    (Open MPI); a plain ``host`` has one slot. ``#`` starts a comment; blank
    lines are skipped. The two syntaxes may be mixed.

    Args:
        text: the file's contents.
        source: how errors name the file.

    Returns:
        A list of :class:`Host`, in file order (a host listed twice appears twice).

    Raises:
        UsageError: naming the line: ``hostfile line 3: expected 'host slots=N'
            or 'host:N', got 'node1 slots=x'``; also for a file with no hosts.
    """
    hosts = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if line:
            hosts.append(_parse_line(line, f"{source} line {number}"))
    if not hosts:
        raise UsageError(f"{source} lists no hosts; {EXPECTED} on each line")
    return check_total_slots(hosts, source)


# A cluster's hostfile is a few kilobytes; anything this big is the wrong file.
MAX_HOSTFILE_BYTES = 1 << 20


def read_hostfile(path):
    """Read and parse the hostfile at ``path``.

    A missing file, a directory, a FIFO, a device or a file over
    :data:`MAX_HOSTFILE_BYTES` is a one-line UsageError.
    """
    def fail(why):
        return UsageError(f"cannot read hostfile {path!r}: {why}; give a text file of 'host slots=N' lines")
    try:
        fd = open_regular_fd(path, MAX_HOSTFILE_BYTES)  # the safe open: never blocks on a FIFO, bounded
    except Unreadable as exc:
        if exc.oserror is not None:
            raise fail(exc.oserror.strerror) from None
        if exc.kind is not None:
            raise fail(f"it is {_PIPE_WORDS.get(exc.kind, exc.kind)}") from None
        raise fail(f"{exc.size:,} bytes is more than a hostfile's limit of {MAX_HOSTFILE_BYTES:,}") from None
    try:
        data = os.read(fd, MAX_HOSTFILE_BYTES + 1)
    except OSError as exc:
        raise fail(exc.strerror) from None
    finally:
        os.close(fd)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise fail("it is not UTF-8 text") from None
    return parse_hostfile(text)


# A hostfile's reader may not know the word FIFO.
_PIPE_WORDS = {"a FIFO": "a FIFO (named pipe)"}


def parse_host_list(text):
    """Parse ``-H host1:2,host2:2`` (pure); a host without ``:N`` has one slot."""
    hosts = []
    for number, item in enumerate(text.split(","), start=1):
        item = item.strip()
        v6 = ipv6_problem(item)
        if v6 is not None:
            raise UsageError(f"-H entry {number}: {v6}")
        match = _MPICH_LINE.fullmatch(item)
        if not match:
            raise UsageError(f"-H entry {number}: expected 'host:N', got {shown(item)} (e.g. -H node1:2,node2:2)")
        name, count = match.groups()
        _check_name(name, f"-H entry {number}", item)
        hosts.append(Host(name, 1 if count is None else _count(count, f"-H entry {number}", item)))
    return check_total_slots(hosts, "-H")


def format_hostfile(hosts, flavour):
    """The hostfile text that ``flavour``'s mpirun reads, slots always explicit (pure).

    Open MPI gives a host without ``slots=`` as many slots as it has cores, so
    the count is always written out, in either syntax.
    """
    if flavour == "openmpi":
        lines = [f"{h.name} slots={h.slots}" for h in hosts]
    else:
        lines = [f"{h.name}:{h.slots}" for h in hosts]
    return "".join(line + "\n" for line in lines)


def check_slots(hosts, np):
    """Refuse to start more ranks than the hosts have slots for (pure)."""
    total = sum(h.slots for h in hosts)
    if np > total:
        listed = ", ".join(f"{h.name}:{h.slots}" for h in hosts)
        raise UsageError(f"-np {np} needs {np} slots but the hosts give {total} ({listed}); "
                         "add slots or lower -np")


# mpiexec sizes its tables by -np before starting anything: a typo such as
# -np 99999999999999 made Hydra's proxy grow to 5.5 GB. No flag lifts this.
MAX_NP = 65536
# On one host, more ranks than this per core is a typo, not a plan.
RANKS_PER_CORE = 64


def np_limit(cpu_count):
    """The most ranks ``ringtrain launch`` starts on this host without --oversubscribe (pure)."""
    return RANKS_PER_CORE * max(1, cpu_count or 1)


def check_np(np, hosts=None, *, cpu_count=None, oversubscribe=False):
    """Refuse an -np below 1, above the slots of ``hosts``, or absurd for one host (pure).

    Args:
        np: the requested number of ranks.
        hosts: the :class:`Host` list from --hostfile or -H, or None for this host only.
        cpu_count: this host's cores (for the one-host limit).
        oversubscribe: the user asked for more ranks than slots or cores on purpose.
    """
    if np < 1:
        raise UsageError(f"number of processes must be at least 1, got {np}")
    if np > MAX_NP:
        raise UsageError(f"-np {np} is above ringtrain launch's limit of {MAX_NP} ranks (mpiexec allocates "
                         "for every rank before starting any); check -np for a typo")
    if oversubscribe:
        return
    if hosts is not None:
        check_slots(hosts, np)
        return
    limit = np_limit(cpu_count)
    if np > limit:
        raise UsageError(f"-np {np} is more than {limit} ranks ({RANKS_PER_CORE} per core on this host's "
                         f"{max(1, cpu_count or 1)} cores), most likely a typo; give --hostfile or -H to "
                         "use more hosts, or --oversubscribe to run them here anyway")


# --- --check: can MPI reach every host? ---------------------------------------

SSH_CHECK = ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5"]


def _addresses(name):
    """The addresses ``name`` resolves to, or None when it does not resolve."""
    try:
        return {info[4][0] for info in socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)}
    except (socket.gaierror, UnicodeError):
        return None


def _is_this_machine(addresses):
    """True when one of ``addresses`` belongs to this machine: it can be bound here."""
    for address in addresses:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((address, 0))
            return True
        except OSError:
            continue
    return False


def _ssh_problem(name, timeout=15):
    """None when ``ssh name true`` works without a password, else why not (one line)."""
    try:
        out = subprocess.run([*SSH_CHECK, name, "true"], capture_output=True, text=True,
                             stdin=subprocess.DEVNULL, timeout=timeout)
    except FileNotFoundError:
        return "ssh not found; MPI starts remote ranks over ssh: install an ssh client"
    except subprocess.TimeoutExpired:
        return f"ssh {name} did not answer within {timeout}s (check the network and that sshd runs there)"
    if out.returncode == 0:
        return None
    said = (out.stderr.strip().splitlines() or [f"exit status {out.returncode}"])[-1]
    return f"ssh {name} failed ({said}); MPI needs password-less ssh to every host (set up keys)"


def check_host(name):
    """None when MPI can reach ``name``, else the one line that says why not."""
    addresses = _addresses(name)
    if not addresses:
        return f"host {name}: does not resolve (check the hostfile or /etc/hosts)"
    if _is_this_machine(addresses):
        return None
    problem = _ssh_problem(name)
    return None if problem is None else f"host {name}: {problem}"


def check_hosts(hosts):
    """One line per host of ``hosts`` that MPI cannot reach; every host checked at once."""
    names = list(dict.fromkeys(h.name for h in hosts))
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(32, len(names))) as pool:
        return [line for line in pool.map(check_host, names) if line is not None]

"""Hostfiles and the ``mpirun`` command line, for whichever MPI is installed.

Open MPI and MPICH's Hydra take different flags and different hostfile
syntaxes for the same things; this module hides that. The pieces that decide
anything (hostfile parsing, ``-H`` lists, slot checks, the argument list) are
pure functions tested without MPI; :func:`launch` is the thin part that writes
files, starts the job, passes signals on to it and restarts it.

This module imports only the standard library and :mod:`ringtrain.errors`:
``ringtrain.cli`` and the per-rank log wrapper read the rank with
:func:`rank_from_env` from it, before anything heavy (MPI) is needed.

Plain ``mpirun -np N ringtrain ...`` stays the first-class way to run;
``ringtrain launch`` is a convenience on top::

    ringtrain launch -np 4 --hostfile hostfiles/cluster.mpich -o logs -- ringtrain train --dataset digits
"""

import concurrent.futures
import dataclasses
import functools
import math
import os
import re
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time

from .errors import UsageError

__all__ = [
    "RANK_VARIABLES",
    "rank_from_env",
    "Host",
    "find_mpirun",
    "detect_flavour",
    "flavour_from_version",
    "mpirun_command",
    "mpi_env",
    "parse_hostfile",
    "read_hostfile",
    "parse_host_list",
    "format_hostfile",
    "check_slots",
    "np_limit",
    "check_np",
    "launch_command",
    "format_command",
    "should_restart",
    "restart_line",
    "failure_report",
    "check_hosts",
    "launch",
]

# The variables MPI launchers set to each process's rank: MPICH's Hydra,
# Open MPI, PMIx launchers and Slurm's srun. The one list for the whole
# package (the CLI, the per-rank log wrapper and the launcher read it).
RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID")

EXPECTED = "expected 'host slots=N' or 'host:N'"

# Host names and IPv4 addresses; a leading '-' would be read as an mpirun flag.
_HOST = r"[A-Za-z0-9_][A-Za-z0-9_.\-]*"
_MPICH_LINE = re.compile(rf"({_HOST})(?::([^:\s]*))?")
_OPENMPI_KEY = re.compile(r"(slots|max_slots|max-slots)=(\S*)")


def rank_from_env(env):
    """This process's rank from the launcher's variables, or None (pure)."""
    for name in RANK_VARIABLES:
        value = env.get(name, "")
        if value.isdigit():
            return int(value)
    return None


@dataclasses.dataclass(frozen=True)
class Host:
    """One hostfile entry: a host and how many ranks it may run."""

    name: str
    slots: int = 1


def find_mpirun():
    """Path of ``mpirun``: the one beside this Python first (a venv's MPI wheel), then PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "mpirun")
    if os.access(here, os.X_OK):
        return here
    return shutil.which("mpirun") or shutil.which("mpiexec")


def flavour_from_version(text):
    """``"openmpi"``, ``"mpich"`` or ``"unknown"`` from ``mpirun --version`` output (pure)."""
    low = text.lower()
    if "open mpi" in low or "open-mpi" in low or "openrte" in low:
        return "openmpi"
    if "hydra" in low or "mpich" in low or "intel(r) mpi" in low:
        return "mpich"
    return "unknown"


@functools.lru_cache(maxsize=None)
def detect_flavour(mpirun):
    """Ask ``mpirun --version`` which MPI it belongs to."""
    try:
        out = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return flavour_from_version(out.stdout + out.stderr)


def mpi_env(flavour, env=None):
    """The environment a job needs: Open MPI refuses to run as root without two variables."""
    env = dict(os.environ if env is None else env)
    env.update(_root_env(flavour))
    return env


def _root_env(flavour):
    if flavour == "openmpi" and hasattr(os, "geteuid") and os.geteuid() == 0:
        return {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    return {}


def mpirun_command(np, command, mpirun=None, flavour=None, extra=()):
    """The argument list that runs ``command`` on ``np`` ranks on this host.

    Open MPI needs ``--oversubscribe`` to start more ranks than cores; MPICH
    oversubscribes without asking.
    """
    mpirun = mpirun or find_mpirun()
    if mpirun is None:
        raise FileNotFoundError("mpirun not found; install ringtrain[mpich] or an MPI runtime")
    flavour = flavour or detect_flavour(mpirun)
    args = [mpirun, "-np", str(np)]
    if flavour == "openmpi":
        args += ["--oversubscribe"]
    return args + list(extra) + list(command)


# --- hostfiles (pure) -------------------------------------------------------

def _count(text, where, line, what="slots"):
    if not re.fullmatch(r"[0-9]+", text or ""):
        raise UsageError(f"{where}: {EXPECTED}, got {line!r}")
    value = int(text)
    if value < 1:
        raise UsageError(f"{where}: {what} must be at least 1, got {line!r}")
    return value


def _parse_line(line, where):
    """One non-blank hostfile line (comment removed) -> Host, in either syntax."""
    words = line.split()
    if len(words) == 1:
        match = _MPICH_LINE.fullmatch(words[0])
        if not match:
            raise UsageError(f"{where}: {EXPECTED}, got {line!r}")
        name, count = match.groups()
        return Host(name, 1 if count is None else _count(count, where, line))
    if not re.fullmatch(_HOST, words[0]):
        raise UsageError(f"{where}: {EXPECTED}, got {line!r}")
    keys = {}
    for word in words[1:]:
        match = _OPENMPI_KEY.fullmatch(word)
        if not match:
            raise UsageError(f"{where}: {EXPECTED}, got {line!r}")
        key = match.group(1).replace("-", "_")
        if key in keys:
            raise UsageError(f"{where}: {key} given twice in {line!r}")
        keys[key] = _count(match.group(2), where, line, what=key)
    slots = keys.get("slots", 1)
    if keys.get("max_slots", slots) < slots:
        raise UsageError(f"{where}: max_slots is less than slots in {line!r}")
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
    return hosts


# A cluster's hostfile is a few kilobytes; anything this big is the wrong file.
MAX_HOSTFILE_BYTES = 1 << 20


def _file_kind(mode):
    """What a non-regular file is, in words, for an error message (pure)."""
    for test, kind in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return kind
    return None if stat.S_ISREG(mode) else "not a regular file"


def read_hostfile(path):
    """Read and parse the hostfile at ``path``.

    A missing file, a directory, a FIFO, a device or a file over
    :data:`MAX_HOSTFILE_BYTES` is a one-line UsageError.
    """
    def fail(why):
        return UsageError(f"cannot read hostfile {path!r}: {why}; give a text file of 'host slots=N' lines")
    try:
        # O_NONBLOCK: opening a FIFO with no writer would otherwise wait forever.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise fail(exc.strerror) from None
    try:
        info = os.fstat(fd)
        kind = _file_kind(info.st_mode)
        if kind is not None:
            raise fail(f"it is {kind}")
        if info.st_size > MAX_HOSTFILE_BYTES:
            raise fail(f"{info.st_size:,} bytes is more than a hostfile's limit of {MAX_HOSTFILE_BYTES:,}")
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


def parse_host_list(text):
    """Parse ``-H host1:2,host2:2`` (pure); a host without ``:N`` has one slot."""
    hosts = []
    for number, item in enumerate(text.split(","), start=1):
        item = item.strip()
        match = _MPICH_LINE.fullmatch(item)
        if not match:
            raise UsageError(f"-H entry {number}: expected 'host:N', got {item!r} (e.g. -H node1:2,node2:2)")
        name, count = match.groups()
        hosts.append(Host(name, 1 if count is None else _count(count, f"-H entry {number}", item)))
    return hosts


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


# --- the command line (pure) ------------------------------------------------

def launch_command(np, command, *, mpirun, flavour, hostfile=None, hosts=None, logdir=None,
                   python=sys.executable, oversubscribe=False, restart=0):
    """The exact argument list and extra environment for a job (pure).

    Args:
        np: number of ranks.
        command: the program and its arguments, run on every rank.
        mpirun: path of mpirun.
        flavour: ``"openmpi"``, ``"mpich"`` or ``"unknown"``.
        hostfile: a hostfile path, already in ``flavour``'s syntax.
        hosts: a list of :class:`Host` passed inline (``-H``); not with ``hostfile``.
        logdir: when given, each rank's output goes to ``logdir/rank-R.log``.
        python: the interpreter that runs the per-rank log wrapper.
        oversubscribe: more ranks than the hosts' slots, on purpose.
        restart: which restart this is (0: the first run); a restart appends
            to the rank logs instead of replacing the failed run's output.

    Returns:
        ``(args, env)``: the argument list and the variables to add to the
        environment (Open MPI's run-as-root pair when running as root).
    """
    if (hostfile or hosts) and flavour not in ("openmpi", "mpich"):
        raise UsageError(f"cannot tell whether {mpirun} is Open MPI or MPICH from '--version', so "
                         "ringtrain cannot hand it a hostfile; run mpirun yourself")
    args = [mpirun]
    if flavour == "openmpi":
        if hostfile:
            args += ["--hostfile", hostfile]
        elif hosts:
            args += ["--host", ",".join(f"{h.name}:{h.slots}" for h in hosts)]
        if hostfile or hosts:
            # Open MPI binds each rank to a core by default; ranks on hosts it
            # cannot see the load of should not be pinned.
            args += ["--bind-to", "none"]
            if oversubscribe:
                args += ["--oversubscribe"]
        else:
            # On one machine the user asked for N ranks and means it, even if
            # Open MPI counts fewer cores; with hosts, slots were checked instead.
            args += ["--oversubscribe"]
    elif flavour == "mpich":
        if hostfile:
            args += ["-f", hostfile]
        elif hosts:
            args += ["-hosts", ",".join(f"{h.name}:{h.slots}" for h in hosts)]
    args += ["-np", str(np)]
    if logdir is not None:
        # Open MPI's --output-filename and Hydra's -outfile-pattern name their
        # files differently and split stdout from stderr; one small wrapper
        # that redirects and then execs gives rank-R.log under every MPI.
        args += [python, "-m", "ringtrain.rank_log"]
        args += ["--restart", str(restart)] if restart else []
        args += [logdir, "--"]
    return args + list(command), _root_env(flavour)


def format_command(args, env=None):
    """One shell line for ``args``, with ``env`` as ``NAME=value`` prefixes (pure)."""
    prefix = [f"{k}={shlex.quote(v)}" for k, v in sorted((env or {}).items())]
    return " ".join(prefix + [shlex.quote(a) for a in args])




# --- restarts and failure reports (pure) --------------------------------------

# Statuses a restart cannot fix: 2 is a usage error (a bad flag or file, the
# same on the next run); 126 and 127 are a command that cannot be run.
NO_RESTART_STATUSES = (2, 126, 127)


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


RESTART_MARK = "ringtrain launch: restart "
# What a rank that failed writes: a traceback, ringtrain's 'rank R: SomeError: ...'
# and 'error: ...' lines, a watchdog's 'did not finish within', MPI's aborts.
_ERROR = re.compile(r"Traceback|\w(Error|Exception)\b|\berror:|did not finish within|\bKilled\b|\babort",
                    re.IGNORECASE)


def last_run(text):
    """The part of a rank log written by the latest run; restarts append after a mark (pure)."""
    at = text.rfind(RESTART_MARK)
    if at < 0:
        return text
    end = text.find("\n", at)
    return "" if end < 0 else text[end + 1:]


def failure_report(logs, lines=10, max_ranks=4):
    """Which rank failed and the log lines that show why (pure).

    Args:
        logs: ``{rank: text of the latest run}`` for the rank logs this host can read.
        lines: how many lines to show from each log.
        max_ranks: how many logs to show when none names an error.

    Returns:
        ``(rank, [(rank, last lines), ...])``: the lowest rank whose log
        names an error and its last lines; or, when none does, ``None`` and
        the last lines of the first ``max_ranks`` non-empty logs.
    """
    def tail(text):
        return text.splitlines()[-lines:]
    for rank in sorted(logs):
        if _ERROR.search(logs[rank]):
            return rank, [(rank, tail(logs[rank]))]
    shown = [(rank, tail(logs[rank])) for rank in sorted(logs) if logs[rank].strip()]
    return None, shown[:max_ranks]


def format_failure_report(logdir, shown):
    """The report's lines: a header per log, then its lines indented (pure)."""
    out = []
    for rank, tail in shown:
        out.append(f"ringtrain launch: last {len(tail)} line(s) of {os.path.join(logdir, f'rank-{rank}.log')}:")
        out += ["    " + line for line in tail]
    return out


def read_rank_logs(logdir):
    """``{rank: text of the latest run}`` for every ``rank-R.log`` in ``logdir``."""
    logs = {}
    try:
        names = os.listdir(logdir)
    except OSError:
        return logs
    for name in names:
        match = re.fullmatch(r"rank-([0-9]+)\.log", name)
        if match:
            try:
                with open(os.path.join(logdir, name), encoding="utf-8", errors="replace") as f:
                    logs[int(match.group(1))] = last_run(f.read())
            except OSError:
                continue
    return logs


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


# --- the plan: everything decided before anything is written or started --------

@dataclasses.dataclass(frozen=True)
class Plan:
    """A checked request: what to run, where, with which MPI."""

    np: int
    command: tuple
    mpirun: str
    flavour: str
    hosts: tuple = None
    hostfile: str = None  # the user's hostfile, when the hosts came from one
    logdir: str = None
    oversubscribe: bool = False

    def args(self, hostfile_path, restart=0):
        """The MPI command line and extra environment, the hostfile at ``hostfile_path``."""
        return launch_command(self.np, self.command, mpirun=self.mpirun, flavour=self.flavour,
                              hostfile=hostfile_path if self.hostfile else None,
                              hosts=None if self.hostfile else self.hosts, logdir=self.logdir,
                              oversubscribe=self.oversubscribe, restart=restart)


def _inside_mpi_job(env):
    # Not SLURM_PROCID: an sbatch script has it too, and launching from one is right.
    return any(name in env for name in RANK_VARIABLES if name != "SLURM_PROCID")


def check_request(np, command, hostfile=None, host_list=None, env=None):
    """The checks that need no file or MPI: a command, one host source, not under mpirun (pure)."""
    if not command:
        raise UsageError("no command given; put it after '--', e.g. ringtrain launch -np 2 -- ringtrain info")
    if hostfile and host_list:
        raise UsageError("give --hostfile or -H, not both")
    if _inside_mpi_job(os.environ if env is None else env):
        raise UsageError("ringtrain launch starts mpirun itself; run it without mpirun")


def _check_restarts(restarts, delay):
    if restarts < 0:
        raise UsageError(f"--restarts must be at least 0, got {restarts}")
    if not (math.isfinite(delay) and delay >= 0):
        raise UsageError(f"--restart-delay must be a number of seconds, at least 0, got {delay}")


def _resolve_mpirun(mpirun):
    if mpirun is not None and not (os.path.isfile(mpirun) and os.access(mpirun, os.X_OK)):
        raise UsageError(f"--mpirun {mpirun}: no such executable file")
    mpirun = mpirun or find_mpirun()
    if mpirun is None or not os.access(mpirun, os.X_OK):
        raise UsageError("mpirun not found; install ringtrain[mpich] or an MPI runtime, or pass --mpirun")
    return mpirun


def check_logdir(logdir):
    """Refuse a log directory that cannot be made, before anything is started."""
    if os.path.exists(logdir) and not os.path.isdir(logdir):
        raise UsageError(f"-o {logdir}: exists and is not a directory; choose another log directory")
    parent = logdir
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise UsageError(f"-o {logdir}: {parent} is not a directory; choose another log directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"-o {logdir}: cannot create it, {parent} is not writable; choose another log directory")


def plan_launch(np, command, *, hostfile=None, host_list=None, logdir=None, mpirun=None,
                oversubscribe=False):
    """Check a request and decide everything about the job; writes and starts nothing."""
    check_request(np, command, hostfile, host_list)
    mpirun = _resolve_mpirun(mpirun)
    hosts = read_hostfile(hostfile) if hostfile else parse_host_list(host_list) if host_list else None
    check_np(np, hosts, cpu_count=os.cpu_count(), oversubscribe=oversubscribe)
    logdir = os.path.abspath(logdir) if logdir is not None else None
    if logdir is not None:
        check_logdir(logdir)
    return Plan(np, tuple(command), mpirun, detect_flavour(mpirun), tuple(hosts) if hosts else None,
                hostfile, logdir, oversubscribe)


# --- running it -------------------------------------------------------------

# Signals the user sends to stop a job, and the one passed on as it is
# (SIGUSR1: programs use it for "checkpoint now"). mpiexec forwards each to
# every rank, on every host.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
FORWARDED = STOP_SIGNALS + (signal.SIGUSR1,)
# After a stop signal, how long ranks may take to end before mpiexec is told
# to abort (a second SIGINT is "force abort" to Hydra and Open MPI alike), and
# how long after that before mpiexec itself is killed.
FORCE_AFTER = 30.0
KILL_AFTER = 10.0


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
        self._saved = {}

    def __enter__(self):
        # Python lets only the main thread set handlers; elsewhere (launch()
        # called from a library's thread) signals keep their old meaning.
        if threading.current_thread() is threading.main_thread():
            for signum in FORWARDED:
                self._saved[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc):
        for signum, handler in self._saved.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)

    def _handle(self, signum, frame):
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


def _wait(proc, forwarder):
    """Wait for mpiexec to end; force it if it outlives a stop signal too long."""
    forced = False
    while True:
        try:
            return proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            pass
        if forwarder.stopped is None:
            continue
        waited = time.monotonic() - forwarder.stopped_at
        if waited > FORCE_AFTER + KILL_AFTER:
            proc.kill()
        elif waited > FORCE_AFTER and not forced:
            forced = True
            forwarder.send(signal.SIGINT)
            forwarder.send(signal.SIGINT)


def run_job(args, env, forwarder):
    """Start mpiexec, pass signals on while it runs, and return its exit status."""
    if forwarder.stopped is not None:
        return 128 + forwarder.stopped
    use_pdeathsig = sys.platform.startswith("linux")
    forwarder.proc = subprocess.Popen(args, env=env, start_new_session=True,
                                      preexec_fn=_die_with_launcher if use_pdeathsig else None)
    try:
        if forwarder.stopped is not None:  # a signal came while it was starting
            forwarder.send(forwarder.stopped)
        return exit_status(_wait(forwarder.proc, forwarder))
    finally:
        forwarder.proc = None


def _sleep_unless_stopped(seconds, forwarder):
    """Sleep, but wake within 0.1 s of a stop signal; True when stopped."""
    end = time.monotonic() + seconds
    while forwarder.stopped is None and time.monotonic() < end:
        time.sleep(min(0.1, max(0.0, end - time.monotonic())))
    return forwarder.stopped is not None


def _report_failure(plan, stderr):
    """Print the failing rank's last lines from the rank logs; returns the rank, if known."""
    if plan.logdir is None:
        return None
    rank, shown = failure_report(read_rank_logs(plan.logdir))
    for line in format_failure_report(plan.logdir, shown):
        print(line, file=stderr)
    stderr.flush()
    return rank


def run_with_restarts(plan, hostfile_path, max_restarts, delay, stderr):
    """Run the job, and again after each failure a restart may fix, up to ``max_restarts`` times."""
    env = dict(os.environ)
    env.update(_root_env(plan.flavour))
    with Forwarder() as forwarder:
        restart = 0
        while True:
            status = run_job(plan.args(hostfile_path, restart)[0], env, forwarder)
            stopped = forwarder.stopped is not None
            if status == 0 or stopped:
                return status
            rank = _report_failure(plan, stderr)
            if not should_restart(status, restart, max_restarts, stopped):
                return status
            restart += 1
            print(restart_line(status, restart, max_restarts, delay, rank), file=stderr, flush=True)
            if _sleep_unless_stopped(delay, forwarder):
                return status


def _print_dry_run(plan, target, stdout):
    args, extra_env = plan.args(target)
    if plan.hostfile:
        print(f"# {target} ({plan.flavour} syntax, from {plan.hostfile}):", file=stdout)
        for entry in format_hostfile(plan.hosts, plan.flavour).splitlines():
            print(f"#   {entry}", file=stdout)
    print(format_command(args, extra_env), file=stdout)


def _run_host_checks(plan, stderr):
    """--check: one line per host MPI cannot reach, then a UsageError if there were any."""
    if not plan.hosts:
        return
    problems = check_hosts(plan.hosts)
    # One line per host: all but the last printed here, the last raised like any usage error.
    for line in problems[:-1]:
        print(f"ringtrain: error: {line}", file=stderr)
    if problems:
        raise UsageError(problems[-1])
    count = len({h.name for h in plan.hosts})
    print(f"ringtrain launch: --check: all {count} host(s) resolve and are reachable", file=stderr, flush=True)


def _write_files(plan):
    """Make the log directory and write the translated hostfile; returns (hostfile path, temp dir)."""
    workdir = None
    if plan.logdir is not None:
        try:
            os.makedirs(plan.logdir, exist_ok=True)
        except OSError as exc:
            raise UsageError(f"-o {plan.logdir}: cannot create it ({exc.strerror}); "
                             "choose another log directory") from None
    if not plan.hostfile:
        return None, None
    if plan.logdir is not None:
        target = os.path.join(plan.logdir, "hostfile")
    else:
        workdir = tempfile.mkdtemp(prefix="ringtrain-launch-")
        target = os.path.join(workdir, "hostfile")
    with open(target, "w", encoding="utf-8") as f:
        f.write(format_hostfile(plan.hosts, plan.flavour))
    return target, workdir


def launch(np, command, *, hostfile=None, host_list=None, logdir=None, dry_run=False, mpirun=None,
           check=False, restarts=0, restart_delay=3.0, oversubscribe=False, stdout=None, stderr=None):
    """Validate, print the exact MPI command, run it, and return its exit status.

    Everything is checked before anything is written or started: a bad
    hostfile line, too few slots, an absurd -np or a missing command is a
    UsageError and no file or directory is created. SIGINT, SIGTERM, SIGHUP
    and SIGUSR1 sent to the launcher are passed on to the job, and the
    launcher waits for it to end.

    Args:
        np: number of ranks (at least 1).
        command: the program and its arguments, run on every rank.
        hostfile: a hostfile in Open MPI or MPICH syntax; it is rewritten in the
            syntax the detected MPI reads.
        host_list: ``"host1:2,host2:2"``, instead of a hostfile.
        logdir: write each rank's output to ``logdir/rank-R.log``; on failure
            the failing rank's last lines are printed.
        dry_run: print the command (and the translated hostfile) and stop.
        mpirun: the mpirun to use (default: :func:`find_mpirun`).
        check: first check that every host resolves and answers ssh.
        restarts: start a failed job again up to this many times.
        restart_delay: seconds to wait before each restart.
        oversubscribe: allow more ranks than slots (or than 64 per core on one host).

    Returns:
        The last job's exit status (``128 + signal`` when mpirun was killed).
    """
    stdout = stdout or sys.stdout
    stderr = stderr or sys.stderr
    _check_restarts(restarts, restart_delay)
    plan = plan_launch(np, command, hostfile=hostfile, host_list=host_list, logdir=logdir,
                       mpirun=mpirun, oversubscribe=oversubscribe)
    if check:
        _run_host_checks(plan, stderr)
    if dry_run:
        placeholder = os.path.join(plan.logdir, "hostfile") if plan.logdir else "HOSTFILE"
        _print_dry_run(plan, placeholder, stdout)
        return 0
    target, workdir = _write_files(plan)
    try:
        args, extra_env = plan.args(target)
        print(f"ringtrain launch: {format_command(args, extra_env)}", file=stderr, flush=True)
        if plan.logdir is not None:
            print(f"ringtrain launch: each rank's output goes to {os.path.join(plan.logdir, 'rank-R.log')}",
                  file=stderr, flush=True)
        stdout.flush()
        return run_with_restarts(plan, target, restarts, restart_delay, stderr)
    finally:
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)

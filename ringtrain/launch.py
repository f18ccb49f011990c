"""Hostfiles and the ``mpirun`` command line, for whichever MPI is installed.

Open MPI and MPICH's Hydra take different flags and different hostfile
syntaxes for the same things; this module hides that. The pieces that decide
anything (hostfile parsing, ``-H`` lists, slot checks, the argument list) are
pure functions tested without MPI; :func:`launch` is the thin part that writes
files and starts the job.

Plain ``mpirun -np N ringtrain ...`` stays the first-class way to run;
``ringtrain launch`` is a convenience on top::

    ringtrain launch -np 4 --hostfile hostfiles/cluster.mpich -o logs -- ringtrain train --dataset digits
"""

import dataclasses
import functools
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile

from .errors import UsageError

__all__ = [
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
    "launch_command",
    "format_command",
    "launch",
]

EXPECTED = "expected 'host slots=N' or 'host:N'"

# Host names and IPv4 addresses; a leading '-' would be read as an mpirun flag.
_HOST = r"[A-Za-z0-9_][A-Za-z0-9_.\-]*"
_MPICH_LINE = re.compile(rf"({_HOST})(?::([^:\s]*))?")
_OPENMPI_KEY = re.compile(r"(slots|max_slots|max-slots)=(\S*)")


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


def read_hostfile(path):
    """Read and parse the hostfile at ``path``; a missing file is a UsageError."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read hostfile {path!r}: {getattr(exc, 'strerror', None) or exc}") from None
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


# --- the command line (pure) ------------------------------------------------

def launch_command(np, command, *, mpirun, flavour, hostfile=None, hosts=None, logdir=None,
                   python=sys.executable):
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
        args += [python, "-m", "ringtrain.rank_log", logdir, "--"]
    return args + list(command), _root_env(flavour)


def format_command(args, env=None):
    """One shell line for ``args``, with ``env`` as ``NAME=value`` prefixes (pure)."""
    prefix = [f"{k}={shlex.quote(v)}" for k, v in sorted((env or {}).items())]
    return " ".join(prefix + [shlex.quote(a) for a in args])


# --- running it -------------------------------------------------------------

def _inside_mpi_job(env):
    return any(v in env for v in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"))


def launch(np, command, *, hostfile=None, host_list=None, logdir=None, dry_run=False, mpirun=None,
           stdout=None, stderr=None):
    """Validate, print the exact MPI command, run it, and return its exit status.

    Everything is checked before anything is written or started: a bad
    hostfile line, too few slots or a missing command is a UsageError and no
    file or directory is created.

    Args:
        np: number of ranks (at least 1).
        command: the program and its arguments, run on every rank.
        hostfile: a hostfile in Open MPI or MPICH syntax; it is rewritten in the
            syntax the detected MPI reads.
        host_list: ``"host1:2,host2:2"``, instead of a hostfile.
        logdir: write each rank's output to ``logdir/rank-R.log``.
        dry_run: print the command (and the translated hostfile) and stop.
        mpirun: the mpirun to use (default: :func:`find_mpirun`).

    Returns:
        The job's exit status (``128 + signal`` when mpirun was killed).
    """
    stdout = stdout or sys.stdout
    stderr = stderr or sys.stderr
    if np < 1:
        raise UsageError(f"number of processes must be at least 1, got {np}")
    if not command:
        raise UsageError("no command given; put it after '--', e.g. ringtrain launch -np 2 -- ringtrain info")
    if hostfile and host_list:
        raise UsageError("give --hostfile or -H, not both")
    if _inside_mpi_job(os.environ):
        raise UsageError("ringtrain launch starts mpirun itself; run it without mpirun")
    if mpirun is not None and not (os.path.isfile(mpirun) and os.access(mpirun, os.X_OK)):
        raise UsageError(f"--mpirun {mpirun}: no such executable file")
    mpirun = mpirun or find_mpirun()
    if mpirun is None or not os.access(mpirun, os.X_OK):
        raise UsageError("mpirun not found; install ringtrain[mpich] or an MPI runtime, or pass --mpirun")
    hosts = read_hostfile(hostfile) if hostfile else parse_host_list(host_list) if host_list else None
    if hosts is not None:
        check_slots(hosts, np)
    flavour = detect_flavour(mpirun)
    logdir = os.path.abspath(logdir) if logdir is not None else None
    if logdir is not None and os.path.exists(logdir) and not os.path.isdir(logdir):
        raise UsageError(f"-o {logdir}: exists and is not a directory")

    translated = format_hostfile(hosts, flavour) if hostfile else None
    workdir = None
    if translated is not None:
        if dry_run:
            target = os.path.join(logdir, "hostfile") if logdir else "HOSTFILE"
        elif logdir:
            target = os.path.join(logdir, "hostfile")
        else:
            workdir = tempfile.mkdtemp(prefix="ringtrain-launch-")
            target = os.path.join(workdir, "hostfile")
    args, extra_env = launch_command(np, command, mpirun=mpirun, flavour=flavour,
                                     hostfile=target if translated is not None else None,
                                     hosts=hosts if host_list else None, logdir=logdir)
    line = format_command(args, extra_env)
    if dry_run:
        if translated is not None:
            print(f"# {target} ({flavour} syntax, from {hostfile}):", file=stdout)
            for entry in translated.splitlines():
                print(f"#   {entry}", file=stdout)
        print(line, file=stdout)
        return 0

    try:
        if logdir is not None:
            os.makedirs(logdir, exist_ok=True)
        if translated is not None:
            with open(target, "w", encoding="utf-8") as f:
                f.write(translated)
        print(f"ringtrain launch: {line}", file=stderr, flush=True)
        if logdir is not None:
            print(f"ringtrain launch: each rank's output goes to {os.path.join(logdir, 'rank-R.log')}",
                  file=stderr, flush=True)
        stdout.flush()
        env = dict(os.environ)
        env.update(extra_env)
        proc = subprocess.Popen(args, env=env)
        try:
            code = proc.wait()
        except KeyboardInterrupt:
            # mpirun got the same SIGINT (same process group) and is ending the
            # job; wait for it so no rank outlives the launcher.
            code = proc.wait()
        return 128 - code if code < 0 else code
    finally:
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)

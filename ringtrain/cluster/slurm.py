"""What Slurm tells a job through its environment: its hosts, its step's tasks, its time left.

ringtrain learns ranks from MPI, not from Slurm (:mod:`ringtrain.cluster.topology`);
Slurm's variables serve three things MPI cannot say:

* ``ringtrain launch`` inside an allocation takes its hosts and rank count
  from ``SLURM_JOB_NODELIST``, ``SLURM_TASKS_PER_NODE`` and ``SLURM_NTASKS``
  (:func:`allocation_hosts`, :func:`allocation_tasks`);
* ``srun`` that started N tasks MPI did not join is told apart from a batch
  script, which has ``SLURM_NTASKS`` too but is one process (:func:`step_tasks`);
* the trainer stops before the job's time limit (:func:`time_left`).

Everything but :func:`time_left`'s ``squeue`` call is pure and tested without
Slurm. Every number is read with :mod:`ringtrain.environment`: a variable
that is set must hold one (ASCII digits, bounded), or it is refused in one
line naming it (:class:`~ringtrain.environment.EnvironmentValueError`).
Imports only the standard library, :mod:`ringtrain.environment` and
:mod:`ringtrain.cluster.hostfiles`.
"""

import re
import subprocess
import time

from ..environment import env_int
from .hostfiles import Host

__all__ = ["expand_hostlist", "expand_counts", "allocation_hosts", "allocation_tasks", "step_tasks",
           "parse_time_left", "time_left", "job_end_time", "job_id", "SQUEUE_TIMEOUT", "MAX_NODES"]

# More nodes than any allocation has: a host list or task count that expands
# past it is garbage, refused before anything is expanded (not a spin or a
# MemoryError on n[1-99999999999]).
MAX_NODES = 100_000
# A node number or a count longer than this is no number Slurm writes.
_MAX_DIGITS = 12

# squeue asks slurmctld; a controller that does not answer must not hold up a start.
SQUEUE_TIMEOUT = 10.0

_RANGE = re.compile(r"([^\[,]*)\[([^\]]*)\]([^,\[]*)")


def _split_top(text):
    """Split at the commas outside brackets: ``a[1,2],b`` -> ``['a[1,2]', 'b']``."""
    out, depth, word = [], 0, ""
    for ch in text:
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            out.append(word)
            word = ""
        else:
            word += ch
    return out + [word]


def expand_hostlist(text):
    """Slurm's compressed host list as names, in order (pure).

    ``node[01-03,07],gpu5`` -> ``node01 node02 node03 node07 gpu5``; the
    zero padding of a range's first number is kept. One bracket per name
    (Slurm's own output for one-dimensional clusters).

    Raises:
        ValueError: text that is not a host list, quoted.
    """
    names = []
    for word in _split_top(text.strip()):
        if not word:
            raise ValueError(f"host list {text!r}: empty name")
        match = _RANGE.fullmatch(word)
        if "[" not in word and "]" not in word:
            names.append(word)
            continue
        if not match:
            raise ValueError(f"host list {text!r}: expected 'name[1-3,5]', got {word!r}")
        prefix, ranges, suffix = match.groups()
        for item in ranges.split(","):
            low, _, high = item.partition("-")
            if not _number(low) or (high and not _number(high)):
                raise ValueError(f"host list {_shown(text)}: expected numbers in {_shown(word)}")
            width, first, last = len(low), int(low), int(high or low)
            if last < first:  # Slurm never writes one; expanded, it would name no node at all
                raise ValueError(f"host list {_shown(text)}: the range {item!r} runs backwards")
            if len(names) + max(0, last - first + 1) > MAX_NODES:
                raise ValueError(f"host list {_shown(text)} names more than {MAX_NODES:,} nodes")
            for number in range(first, last + 1):
                names.append(f"{prefix}{number:0{width}d}{suffix}")
    if len(names) > MAX_NODES:
        raise ValueError(f"host list {_shown(text)} names more than {MAX_NODES:,} nodes")
    return names


def _number(text):
    """True for ASCII digits of a sane length (``str.isdigit`` takes ``²``, which ``int`` refuses)."""
    return re.fullmatch(r"[0-9]{1,%d}" % _MAX_DIGITS, text) is not None


def _shown(text, limit=60):
    """``text`` quoted, cut to ``limit`` characters: a message quotes the start of a huge value, not all of it."""
    return repr(text if len(text) <= limit else text[:limit - 3] + "...")


def expand_counts(text):
    """Slurm's per-node counts (``SLURM_TASKS_PER_NODE``): ``2(x3),1`` -> ``[2, 2, 2, 1]`` (pure).

    Raises:
        ValueError: text that is not such a list, quoted.
    """
    counts = []
    for word in text.strip().split(","):
        match = re.fullmatch(r"([0-9]{1,%d})(?:\(x([0-9]{1,%d})\))?" % (_MAX_DIGITS, _MAX_DIGITS), word)
        if not match:
            raise ValueError(f"task counts {_shown(text)}: expected 'N' or 'N(xK)', got {_shown(word)}")
        repeat = int(match.group(2) or 1)
        if repeat == 0 or int(match.group(1)) == 0:  # Slurm lists only nodes that run something, once or more
            raise ValueError(f"task counts {_shown(text)}: {_shown(word)} gives a node no tasks, or repeats it "
                             "no times")
        if len(counts) + repeat > MAX_NODES:
            raise ValueError(f"task counts {_shown(text)} are for more than {MAX_NODES:,} nodes")
        counts += [int(match.group(1))] * repeat
    return counts


def allocation_hosts(env):
    """The allocation's hosts with the tasks each may run, or None outside an allocation (pure).

    From ``SLURM_JOB_NODELIST`` and ``SLURM_TASKS_PER_NODE`` (an allocation
    made without ``-n`` has no task counts: then ``SLURM_JOB_CPUS_PER_NODE``).

    Raises:
        ValueError: variables that do not fit together, naming them.
    """
    nodes = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if job_id(env) is None or not nodes:
        return None
    source = "SLURM_TASKS_PER_NODE" if env.get("SLURM_TASKS_PER_NODE") else "SLURM_JOB_CPUS_PER_NODE"
    names, counts = expand_hostlist(nodes), expand_counts(env.get(source, ""))
    if len(names) != len(counts):
        raise ValueError(f"{_nodes_variable(env)}={nodes} names {len(names)} node(s) and {source}="
                         f"{env.get(source)} gives {len(counts)} count(s)")
    return tuple(Host(name, count) for name, count in zip(names, counts))


def _nodes_variable(env):
    return "SLURM_JOB_NODELIST" if env.get("SLURM_JOB_NODELIST") else "SLURM_NODELIST"


def allocation_tasks(env):
    """The allocation's task count (``SLURM_NTASKS``, or ``SLURM_NPROCS``), or None (pure)."""
    return _first_count(env, ("SLURM_NTASKS", "SLURM_NPROCS"))


def step_tasks(env):
    """How many tasks ``srun`` started in this process's job step, or None outside a step (pure).

    Only a task of a step has a step id: a batch script or an ``salloc``
    shell has ``SLURM_NTASKS`` (the allocation's) but is one process, and
    ``srun -n1`` inside a larger allocation is a step of one task.
    ``SLURM_STEP_NUM_TASKS`` is the step's own count (``srun --preserve-env``
    passes the allocation's ``SLURM_NTASKS`` on instead); the older
    variables are read only without it.
    """
    if not (env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID")):
        return None
    return _first_count(env, ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"))


def _first_count(env, names):
    """The count the first of ``names`` that is set holds (at least 1), or None when none is (pure)."""
    for name in names:
        count = env_int(env, name, None, lo=1, fix="Slurm sets it to a task count; unset it outside a Slurm job",
                        everywhere=True)
        if count is not None:
            return count
    return None


def job_end_time(env):
    """``SLURM_JOB_END_TIME`` (a UNIX time, Slurm 23.02 and later), or None when it is unset (pure)."""
    return env_int(env, "SLURM_JOB_END_TIME", None, unit=" (a UNIX time)", everywhere=True,
                   fix="Slurm sets it to the job's end; unset it outside a Slurm job")


def job_id(env):
    """``SLURM_JOB_ID``, or None outside a Slurm job (pure)."""
    return env_int(env, "SLURM_JOB_ID", None, everywhere=True,
                   fix="Slurm sets it to the job's number; unset it outside a Slurm job")


def parse_time_left(text):
    """Seconds from squeue's time left (``%L``): ``1-02:03:04``, ``2:03:04``, ``3:04``; None if unlimited (pure).

    Raises:
        ValueError: text in no such form.
    """
    text = text.strip()
    if text in ("UNLIMITED", "NOT_SET", "INVALID", "N/A", ""):
        return None
    days, _, clock = text.rpartition("-")
    fields = clock.split(":")
    if not (days == "" or _count(days)) or not 1 <= len(fields) <= 3 or not all(_count(f) for f in fields):
        raise ValueError(f"squeue time left {text!r}: expected [days-][hours:]minutes:seconds")
    seconds = 0
    for field in fields:
        seconds = seconds * 60 + int(field)
    return seconds + 86400 * int(days or 0)


def time_left(env, now=None, run=subprocess.run):
    """Seconds until this job's time limit, or None (no Slurm job, no limit, or no answer).

    ``SLURM_JOB_END_TIME`` (Slurm 23.02 and later: the end as a UNIX time)
    when it is set; else ``squeue -j $SLURM_JOB_ID -o %L``, bounded by
    :data:`SQUEUE_TIMEOUT`. Not collective: the trainer asks on rank 0 alone (every
    rank has read the numbers before, so a bad one is refused on all of them).

    Returns:
        ``(seconds, how)``: the time left and where it came from, or ``(None, why not)``.
    """
    now = time.time() if now is None else now
    end = job_end_time(env)
    if end is not None:
        return end - now, "SLURM_JOB_END_TIME"
    job = job_id(env)
    if job is None:
        return None, "not in a Slurm job"
    try:
        out = run(["squeue", "-h", "-j", str(job), "-o", "%L"], capture_output=True, text=True, timeout=SQUEUE_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"squeue did not answer ({exc})"
    if out.returncode != 0:
        return None, f"squeue failed: {out.stderr.strip()[:200]}"
    try:
        seconds = parse_time_left(out.stdout)
    except ValueError as exc:
        return None, str(exc)
    return seconds, "squeue" if seconds is not None else "no time limit"


def _count(text):
    """True for a plain count squeue could print: ASCII digits, not too many ('²' passes isdigit())."""
    return text.isascii() and text.isdigit() and len(text) <= _MAX_DIGITS

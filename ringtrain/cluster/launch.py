"""The ``mpirun`` command line for whichever MPI is installed, and ``ringtrain launch`` on top of it.

Open MPI and MPICH's Hydra take different flags and different hostfile
syntaxes for the same things; this module hides that. The pieces that decide
anything (the argument list, the launch plan) are pure functions tested
without MPI; hosts are :mod:`ringtrain.cluster.hostfiles`' and running the job
(signals, restarts, failure reports) is :mod:`ringtrain.cluster.jobs`'. :func:`launch`
is the thin part that ties them together.

This module imports only the standard library, :mod:`ringtrain.errors` and
those two (which import nothing heavier):
``ringtrain.cli`` and the per-rank log wrapper read the rank with
:func:`rank_from_env` from it, before anything heavy (MPI) is needed.

Plain ``mpirun -np N ringtrain ...`` stays the first-class way to run;
``ringtrain launch`` is a convenience on top::

    ringtrain launch -np 4 --hostfile hostfiles/cluster.mpich -o logs -- ringtrain train --dataset digits
"""

import contextlib
import dataclasses
import functools
import math
import os
import shutil
import subprocess
import sys
import tempfile

from ..environment import env_int
from ..errors import UsageError
from ..io.safeio import printable
from .commits import check_ancestors, check_private_directory
from .hostfiles import check_hosts, check_np, format_hostfile, parse_host_list, read_hostfile
from .jobs import MIN_LOG_SPACE, format_command, free_bytes, make_logdir, report_success, run_with_restarts
from .slurm import allocation_hosts, allocation_tasks, job_id, step_tasks

__all__ = [
    "RANK_VARIABLES",
    "LOCAL_RANK_VARIABLES",
    "SIZE_VARIABLES",
    "rank_from_env",
    "local_rank_from_env",
    "size_from_env",
    "torchrun_size",
    "TORCHRUN_VARIABLES",
    "find_mpirun",
    "detect_flavour",
    "flavour_from_version",
    "mpirun_command",
    "mpi_env",
    "launch_command",
    "format_command",
    "check_request",
    "check_runnable",
    "check_logdir",
    "make_logdir",
    "plan_launch",
    "slurm_request",
    "launch",
]

# The variables MPI launchers set to each process's rank: MPICH's Hydra,
# Open MPI, PMIx launchers and Slurm's srun. The one list for the whole
# package (the CLI, the per-rank log wrapper and the launcher read it).
RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID")
# And to its rank on its host: MPICH's Hydra, Open MPI, Slurm's srun.
LOCAL_RANK_VARIABLES = ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID")
# And the ones they set to the number of ranks.
SIZE_VARIABLES = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS")


# Host names and IPv4 addresses; a leading '-' would be read as an mpirun flag.


def rank_from_env(env):
    """This process's rank from the launcher's variables, or None (pure)."""
    return _first_number(env, RANK_VARIABLES)


def local_rank_from_env(env):
    """This process's rank on its host from the launcher's variables, or None (pure).

    Known before MPI starts, so a GPU can be chosen before ``MPI_Init``
    (which a CUDA-aware MPI may use to set up CUDA on the current device).
    """
    return _first_number(env, LOCAL_RANK_VARIABLES)


def size_from_env(env):
    """The job's number of ranks from the launcher's variables, or None (pure)."""
    return _first_number(env, SIZE_VARIABLES)


def _first_number(env, names):
    """The number the first of ``names`` that is set holds, or None when none is (pure).

    A launcher sets these; one that holds anything but a count (``abc``, ``²``, a 400-digit number)
    was set by hand and is refused in one line naming it, not passed over for the next.
    """
    for name in names:
        value = env_int(env, name, None, fix="MPI launchers set it; unset it, or start the program with mpirun",
                        everywhere=True)
        if value is not None:
            return value
    return None


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


# --- the command line (pure) ------------------------------------------------

def launch_command(np, command, *, mpirun, flavour, hostfile=None, hosts=None, logdir=None,
                   python=sys.executable, oversubscribe=False, restart=0, records=None):
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
        records: without ``logdir``, a directory for the per-rank exit
            records only (the elastic launcher's; the output stays where it was).

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
        args += [python, "-m", "ringtrain.cluster.rank_log"]
        args += ["--restart", str(restart)] if restart else []
        args += [logdir, "--"]
    elif records is not None:
        args += [python, "-m", "ringtrain.cluster.rank_log", "--records-only", records, "--"]
    return args + list(command), _root_env(flavour)


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

    def start(self, np, hosts, restart, records=None):
        """The command line and extra environment of an elastic start: ``np`` ranks on ``hosts`` (inline)."""
        return launch_command(np, self.command, mpirun=self.mpirun, flavour=self.flavour, hosts=hosts,
                              logdir=self.logdir, oversubscribe=self.oversubscribe, restart=restart, records=records)


def _inside_mpi_job(env):
    # Not SLURM_PROCID: an sbatch script has it too, and launching from one is right.
    return any(name in env for name in RANK_VARIABLES if name != "SLURM_PROCID")


def check_request(np, command, hostfile=None, host_list=None, env=None):
    """The checks that need no file or MPI: a command, one host source, one copy of the launcher (pure)."""
    env = os.environ if env is None else env
    if not command:
        raise UsageError("no command given; put it after '--', e.g. ringtrain launch -np 2 -- ringtrain info")
    if not command[0].strip():  # no program has a blank name: mpiexec would fail each rank (or --dry-run show it)
        raise UsageError(f"the command after '--' is {command[0]!r}, an empty program name; give the program to "
                         "run, e.g. ringtrain launch -np 2 -- ringtrain info")
    if hostfile and host_list:
        raise UsageError("give --hostfile or -H, not both")
    _check_one_copy(env)
    if _inside_mpi_job(env):
        name = next(name for name in RANK_VARIABLES if name != "SLURM_PROCID" and name in env)
        raise UsageError(f"ringtrain launch starts mpirun itself, but {name}={printable(env[name])[:40]} says this "
                         f"process is a rank of an MPI job; run it without mpirun (or unset {name}, if it is left "
                         "over from one)")


def _check_one_copy(env):
    """Refuse a launcher that srun or torchrun started several copies of: each would start the whole job."""
    tasks = step_tasks(env)
    if tasks is not None and tasks > 1:
        raise UsageError(f"srun started {tasks} copies of ringtrain launch (SLURM_STEP_NUM_TASKS={tasks}), each of "
                         "which would start the whole job; run it once, in the batch script or under salloc, "
                         "where it takes the allocation's hosts")
    size, name = torchrun_size(env)
    if size is not None:
        raise UsageError(f"torchrun started {size} copies of ringtrain launch ({name}={size}), each of which "
                         "would start the whole job; run it once, without torchrun")


# What torchrun (and torch.distributed.launch) set beside WORLD_SIZE. WORLD_SIZE alone is no sign of it:
# a job script may export it for a program of its own, and a process with nothing else is simply one process.
TORCHRUN_VARIABLES = ("TORCHELASTIC_RUN_ID", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "RANK",
                      "LOCAL_RANK", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")
_TORCHRUN_NUMBERS = ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK", "LOCAL_RANK")


def torchrun_size(env):
    """``(processes, the variable that says so)`` when torchrun started several copies of this one (pure).

    ``(None, None)`` otherwise: no torchrun variable besides ``WORLD_SIZE``, or a size of 1. The
    numbers are read whether or not they decide, so garbage in any of them is refused, naming it.
    """
    fix = "torchrun sets it; unset it, or start the program with mpirun"
    numbers = {name: env_int(env, name, None, lo=0, fix=fix, everywhere=True) for name in _TORCHRUN_NUMBERS}
    if not any(env.get(name, "").strip() for name in TORCHRUN_VARIABLES):
        return None, None
    name = "WORLD_SIZE" if numbers["WORLD_SIZE"] is not None else "LOCAL_WORLD_SIZE"
    size = numbers[name]
    return (size, name) if size is not None and size > 1 else (None, None)


def slurm_request(np, hostfile, host_list, env):
    """``(np, hosts)`` inside a Slurm allocation when no hosts were given: the allocation's (pure).

    Outside an allocation, or with ``--hostfile``/``-H``, ``(np, None)``.
    ``np`` defaults to ``SLURM_NTASKS``; without an allocation it is required.
    """
    hosts = None
    if not (hostfile or host_list):
        try:
            hosts = allocation_hosts(env)
        except ValueError as exc:
            raise UsageError(f"cannot read the Slurm allocation's hosts: {exc}; give --hostfile or -H") from None
    if np is None:
        np = allocation_tasks(env) if hosts else None
        if np is None and hosts:
            raise UsageError(_no_task_count(env, hosts))
        if np is None:
            raise UsageError(_no_np(env, hostfile or host_list))
    return np, hosts


def _no_np(env, hosts_given):
    """Why ``-np`` is needed, true to what the environment holds, and the fix (pure)."""
    job = job_id(env)
    if job is None:
        return "-np N is required outside a Slurm allocation (inside one it defaults to SLURM_NTASKS)"
    if hosts_given:
        return (f"-np N is required with --hostfile or -H, inside Slurm job {job} too: SLURM_NTASKS counts the "
                "ranks only on the allocation's own hosts")
    return (f"SLURM_JOB_ID={job} is set but neither SLURM_JOB_NODELIST nor SLURM_NODELIST is, so the allocation's "
            "hosts and task count are unknown; give -np N (and --hostfile or -H for other hosts), run it inside "
            "the allocation (its batch script or salloc shell, where Slurm sets SLURM_JOB_NODELIST), or unset "
            "SLURM_JOB_ID if it is left over")


def _no_task_count(env, hosts):
    """What launch found in an allocation made without ``-n``, and the fix (pure)."""
    names = ("SLURM_JOB_ID", "SLURM_JOB_NODELIST", "SLURM_NODELIST", "SLURM_TASKS_PER_NODE",
             "SLURM_JOB_CPUS_PER_NODE")
    # A host list of a thousand nodes is shown by its start: the line must stay one readable line.
    found = ", ".join(f"{name}={env[name] if len(env[name]) <= 60 else env[name][:57] + '...'}"
                      for name in names if env.get(name))
    slots = sum(host.slots for host in hosts)
    return (f"inside a Slurm allocation ({found}) without a task count: SLURM_NTASKS is unset, as in an "
            f"allocation made without -n; give -np N (the allocation has {slots} slot(s) on {len(hosts)} "
            "host(s)), or allocate with -n N (sbatch/salloc -n N)")


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
    """Refuse a log directory that cannot be made, or is not the user's own, before anything is started."""
    if os.path.exists(logdir) and not os.path.isdir(logdir):
        raise UsageError(f"-o {logdir}: exists and is not a directory; choose another log directory")
    if os.path.lexists(logdir):
        check_private_directory(logdir, "-o")
    else:
        check_ancestors(logdir, "-o")
    parent = logdir
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise UsageError(f"-o {logdir}: {parent} is not a directory; choose another log directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"-o {logdir}: cannot create it, {parent} is not writable; choose another log directory")
    free = free_bytes(parent)
    if free is not None and free < MIN_LOG_SPACE:
        raise UsageError(f"-o {logdir}: its file system is full ({free:,} bytes free), so the ranks' output "
                         "could not be written; free some space or choose another log directory")


def check_runnable(command, path=None):
    """Refuse a command this host cannot run, before mpiexec is started.

    mpiexec reports a program it cannot execute with status 255, which looks
    like a crash: ``--restarts`` would start it again and again.
    """
    program = command[0]
    if shutil.which(program, path=path) is not None:
        return
    if os.sep in program and os.path.exists(program):
        raise UsageError(f"cannot run {program!r}: not an executable file; check the command after '--'")
    where = "no such file" if os.sep in program else "not found on PATH"
    raise UsageError(f"cannot run {program!r}: {where}; check the command after '--'")


def plan_launch(np, command, *, hostfile=None, host_list=None, logdir=None, mpirun=None,
                oversubscribe=False, env=None):
    """Check a request and decide everything about the job; writes and starts nothing.

    Inside a Slurm allocation without ``hostfile`` or ``host_list``, the
    hosts and (when ``np`` is None) the rank count are the allocation's.
    """
    env = os.environ if env is None else env
    check_request(np, command, hostfile, host_list, env)
    np, hosts = slurm_request(np, hostfile, host_list, env)
    mpirun = _resolve_mpirun(mpirun)
    hosts = read_hostfile(hostfile) if hostfile else parse_host_list(host_list) if host_list else hosts
    check_np(np, hosts, cpu_count=os.cpu_count(), oversubscribe=oversubscribe)
    logdir = os.path.abspath(logdir) if logdir is not None else None
    if logdir is not None:
        check_logdir(logdir)
    return Plan(np, tuple(command), mpirun, detect_flavour(mpirun), tuple(hosts) if hosts else None,
                hostfile, logdir, oversubscribe)


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
        make_logdir(plan.logdir)
    if not plan.hostfile:
        return None, None
    if plan.logdir is not None:
        target = os.path.join(plan.logdir, "hostfile")
    else:
        workdir = tempfile.mkdtemp(prefix="ringtrain-launch-")
        target = os.path.join(workdir, "hostfile")
    write_replacing(target, format_hostfile(plan.hosts, plan.flavour))
    return target, workdir


def write_replacing(path, text):
    """Write ``text`` to a new file and rename it over ``path``.

    A symbolic link at ``path`` (``-o`` is the user's directory, and may be
    shared) is replaced, never followed: its target is left as it was.
    """
    fd, temporary = tempfile.mkstemp(prefix=".hostfile-", dir=os.path.dirname(path))
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(temporary, 0o644)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def launch(np, command, *, hostfile=None, host_list=None, logdir=None, dry_run=False, mpirun=None,
           check=False, restarts=0, restart_delay=3.0, oversubscribe=False, stdout=None, stderr=None,
           elastic=None):
    """Validate, print the exact MPI command, run it, and return its exit status.

    Everything is checked before anything is written or started: a bad
    hostfile line, too few slots, an absurd -np or a missing command is a
    UsageError and no file or directory is created. SIGINT, SIGTERM, SIGHUP
    and SIGUSR1 sent to the launcher are passed on to the job, and the
    launcher waits for it to end.

    Args:
        np: number of ranks (at least 1); None inside a Slurm allocation: its ``SLURM_NTASKS``.
        command: the program and its arguments, run on every rank.
        hostfile: a hostfile in Open MPI or MPICH syntax; it is rewritten in the
            syntax the detected MPI reads.
        host_list: ``"host1:2,host2:2"``, instead of a hostfile. Without
            either, inside a Slurm allocation, the allocation's hosts.
        logdir: write each rank's output to ``logdir/rank-R.log``; on failure
            the failing rank's last lines are printed.
        dry_run: print the command (and the translated hostfile) and stop.
        mpirun: the mpirun to use (default: :func:`find_mpirun`).
        check: first check that every host resolves and answers ssh.
        restarts: start a failed job again up to this many times.
        restart_delay: seconds to wait before each restart.
        oversubscribe: allow more ranks than slots (or than 64 per core on one host).
        elastic: horovodrun's elastic settings, a dict of the keyword
            arguments of :func:`ringtrain.cluster.elastic.launch_elastic`
            (``min_np``, ``max_np``, ``discovery_script``, ``slots_per_host``,
            ``elastic_timeout``, ``reset_limit``, ``cooldown``), or None.

    Returns:
        The last job's exit status (``128 + signal`` when mpirun was killed).
    """
    stdout = stdout or sys.stdout
    stderr = stderr or sys.stderr
    _check_restarts(restarts, restart_delay)
    if elastic is not None:
        return _launch_elastic(np, command, hostfile, host_list, logdir, dry_run, mpirun, check, restarts,
                               restart_delay, oversubscribe, elastic, stdout, stderr)
    plan = plan_launch(np, command, hostfile=hostfile, host_list=host_list, logdir=logdir,
                       mpirun=mpirun, oversubscribe=oversubscribe)
    if plan.hosts and not (hostfile or host_list):
        print(f"ringtrain launch: {plan.np} rank(s) on Slurm job {os.environ.get('SLURM_JOB_ID')}'s hosts: "
              + ",".join(f"{h.name}:{h.slots}" for h in plan.hosts), file=stderr, flush=True)
    if check:
        _run_host_checks(plan, stderr)
    if dry_run:
        placeholder = os.path.join(plan.logdir, "hostfile") if plan.logdir else "HOSTFILE"
        _print_dry_run(plan, placeholder, stdout)
        return 0
    if not plan.hosts:  # other hosts may have programs this one lacks
        check_runnable(plan.command)
    target, workdir = _write_files(plan)
    try:
        args, extra_env = plan.args(target)
        print(f"ringtrain launch: {format_command(args, extra_env)}", file=stderr, flush=True)
        if plan.logdir is not None:
            print(f"ringtrain launch: each rank's output goes to {os.path.join(plan.logdir, 'rank-R.log')}",
                  file=stderr, flush=True)
        stdout.flush()
        env = dict(os.environ)
        env.update(_root_env(plan.flavour))
        status = run_with_restarts(lambda restart: plan.args(target, restart)[0], env, plan.logdir, restarts,
                                   restart_delay, stderr, ranks=plan.np)
        if status == 0 and plan.logdir is not None:
            report_success(plan.logdir, stderr)
        return status
    finally:
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)


def _launch_elastic(np, command, hostfile, host_list, logdir, dry_run, mpirun, check, restarts, restart_delay,
                    oversubscribe, elastic, stdout, stderr):
    """``launch`` with horovodrun's elastic flags: see :mod:`ringtrain.cluster.elastic`."""
    from .elastic import launch_elastic

    if restarts:
        raise UsageError("--restarts is for a job of fixed size; with the elastic flags give --reset-limit")
    if np is None:
        raise UsageError("the elastic flags need -np N, the number of ranks of the first start")
    check_request(np, command, hostfile, host_list)
    mpirun = _resolve_mpirun(mpirun)
    logdir = os.path.abspath(logdir) if logdir is not None else None
    if logdir is not None:
        check_logdir(logdir)
    if not (hostfile or host_list or elastic.get("discovery_script")):
        check_runnable(command)
    plan = Plan(np, tuple(command), mpirun, detect_flavour(mpirun), logdir=logdir, oversubscribe=oversubscribe)
    return launch_elastic(plan, np=np, host_source=(hostfile, host_list), restart_delay=restart_delay, check=check,
                          dry_run=dry_run, stdout=stdout, stderr=stderr, **elastic)

"""``horovod.run(fn, args=(), np=N)``: call a function on N ranks started with mpirun and return their results.

As in Horovod, ``run`` is called from an ordinary process (not one started by
mpirun); it starts ``mpirun -np N python -m ringtrain.horovod --worker DIR``,
and every rank calls ``fn(*args, **kwargs)`` with ``horovod`` served from
ringtrain (so ``hvd.init()`` there joins the N ranks), then writes its return
value. ``run`` returns the values as a list in rank order, or raises
``RuntimeError`` when the job fails.

The function, its arguments and the results travel with :mod:`pickle`, as in
Horovod ("this function must be compatible with pickle"). A function defined
in the script (``__main__``) is found by each rank the way
:mod:`multiprocessing`'s spawn start method finds it: the rank runs the script
under the name ``__mp_main__`` (its ``if __name__ == "__main__":`` block is
skipped, and ``sys.argv`` is the driver's) and stands it in for ``__main__``
while unpickling.
"""

import builtins
import io
import json
import os
import pickle
import subprocess
import sys
import tempfile
import traceback
import types

from ..cluster.hostfiles import parse_host_list, read_hostfile
from ..cluster.launch import RANK_VARIABLES, detect_flavour, find_mpirun, launch_command, mpi_env

__all__ = ["run", "run_worker", "unsupported", "TASK_FILE", "result_file"]

TASK_FILE = "task.pickle"
ARGV_FILE = "argv.json"
# Horovod's elastic and Gloo options; ringtrain's run takes neither.
_REFUSED = {
    "min_num_proc": "elastic horovod.run (min_num_proc, max_num_proc, host_discovery_script)",
    "max_num_proc": "elastic horovod.run (min_num_proc, max_num_proc, host_discovery_script)",
    "host_discovery_script": "elastic horovod.run (min_num_proc, max_num_proc, host_discovery_script)",
    "use_gloo": "Gloo (ringtrain runs over MPI; leave use_gloo unset)",
}


def result_file(rank):
    """The name of rank ``rank``'s result in the job's folder (pure)."""
    return f"result-{rank}.pickle"


def error_file(rank):
    """The name of the line rank ``rank`` leaves in the job's folder when its function raised (pure)."""
    return f"error-{rank}.txt"


def unsupported(options):
    """The message for the first option ringtrain does not serve, or None (pure)."""
    for name, what in _REFUSED.items():
        if options.get(name):
            return f"horovod.run: {what} is not available with ringtrain ({name}={options[name]!r})"
    return None


def _inside_mpi_job(env):
    return any(name in env for name in RANK_VARIABLES if name != "SLURM_PROCID")


def _hosts(hosts, hostfile):
    if hosts is not None and hostfile is not None:
        raise ValueError("Argument hosts and hostfile only allow one provided.")
    if hosts:
        return parse_host_list(hosts)
    if hostfile:
        return read_hostfile(hostfile)
    return None


def run(func, args=(), kwargs=None, num_proc=1, min_num_proc=None, max_num_proc=None, slots=None,
        reset_limit=None, cooldown_range=None, hosts=None, hostfile=None, host_discovery_script=None,
        start_timeout=None, ssh_port=None, ssh_identity_file=None, disable_cache=None, output_filename=None,
        verbose=None, use_gloo=None, use_mpi=None, mpi_args=None, network_interface=None,
        network_interfaces=None, executable=None, np=None, min_np=None, max_np=None):
    """Run ``func(*args, **kwargs)`` on ``num_proc`` (or ``np``) ranks under mpirun; return the results by rank.

    Horovod's signature, so ``horovod.run`` calls work unchanged. Served:
    ``func``, ``args``, ``kwargs``, ``num_proc``/``np``, ``hosts``
    (``"host1:2,host2:2"``), ``hostfile``, ``mpi_args`` (extra mpirun flags,
    a string or a list), ``executable`` (the Python each rank runs) and
    ``use_mpi``. The elastic options and ``use_gloo`` raise ``ValueError``;
    the rest (ssh, timeouts, caching, interfaces, verbosity) are accepted and
    left to mpirun.

    Returns:
        A list with one value per rank, ``[rank 0's, rank 1's, ...]``.

    Raises:
        ValueError: an option ringtrain does not serve, or a bad ``num_proc``.
        RuntimeError: called inside an MPI job, mpirun not found, or the job
            failed (a rank raised, or was killed).
    """
    del slots, reset_limit, cooldown_range, start_timeout, ssh_port, ssh_identity_file, disable_cache
    del output_filename, verbose, use_mpi, network_interface, network_interfaces
    problem = unsupported({"min_num_proc": min_num_proc or min_np, "max_num_proc": max_num_proc or max_np,
                           "host_discovery_script": host_discovery_script, "use_gloo": use_gloo})
    if problem:
        raise ValueError(problem)
    num_proc = np if np is not None else num_proc
    if not isinstance(num_proc, int) or isinstance(num_proc, bool) or num_proc < 1:
        raise ValueError(f"horovod.run: num_proc must be a positive integer, got {num_proc!r}")
    if _inside_mpi_job(os.environ):
        raise RuntimeError("horovod.run starts its own mpirun; run this script without mpirun "
                           "(python -m ringtrain.horovod script.py)")
    mpirun = find_mpirun()
    if mpirun is None:
        raise RuntimeError("horovod.run: mpirun not found; install ringtrain[mpich] or an MPI runtime")
    host_list = _hosts(hosts, hostfile)
    extra = mpi_args.split() if isinstance(mpi_args, str) else list(mpi_args or ())
    with tempfile.TemporaryDirectory(prefix="ringtrain-run-") as folder:
        with open(os.path.join(folder, TASK_FILE), "wb") as fh:
            pickle.dump((func, tuple(args), dict(kwargs or {})), fh)
        with open(os.path.join(folder, ARGV_FILE), "w") as fh:
            json.dump(list(sys.argv), fh)  # the script sees the driver's command line on every rank
        command = [executable or sys.executable, "-m", "ringtrain.horovod", "--worker", folder]
        script = getattr(sys.modules.get("__main__"), "__file__", None)
        if script:
            command.append(os.path.abspath(script))
        flavour = detect_flavour(mpirun)
        argv, extra_env = launch_command(num_proc, command, mpirun=mpirun, flavour=flavour, hosts=host_list)
        argv[1:1] = extra
        env = mpi_env(flavour)
        env.update(extra_env)
        done = subprocess.run(argv, env=env)
        if done.returncode != 0:
            errors = _read_errors(folder, num_proc)
            raise RuntimeError(f"horovod.run: the job on {num_proc} ranks failed: mpirun exited with status "
                               f"{done.returncode}" + (f": {'; '.join(errors)}" if errors else
                                                      " (each failing rank printed its error above)"))
        return [_read_result(folder, rank) for rank in range(num_proc)]


def _read_errors(folder, num_proc):
    """The lines the ranks whose function raised left (MPI_Abort may cut their own output short)."""
    errors = []
    for rank in range(num_proc):
        try:
            with open(os.path.join(folder, error_file(rank)), encoding="utf-8", errors="replace") as fh:
                errors.append(fh.read().strip())
        except FileNotFoundError:
            pass
    return errors


def _read_result(folder, rank):
    try:
        with open(os.path.join(folder, result_file(rank)), "rb") as fh:
            return pickle.load(fh)
    except FileNotFoundError:
        raise RuntimeError(f"horovod.run: rank {rank} returned no result (did the function call sys.exit?)") \
            from None


def _load_script(script):
    """Run ``script`` as ``__mp_main__`` and make it ``__main__`` too, as multiprocessing's spawn does.

    The driver pickled the script's functions and classes as ``__main__.name``.
    """
    module = types.ModuleType("__mp_main__")
    module.__file__ = script
    module.__builtins__ = builtins
    sys.modules["__mp_main__"] = sys.modules["__main__"] = module
    with io.open_code(script) as fh:
        code = compile(fh.read(), script, "exec")
    exec(code, module.__dict__)


def run_worker(folder, script=None, rank=None):
    """One rank of :func:`run`: call the pickled function, write its result; the status to exit with.

    An exception is printed with the rank and the job is aborted, so no
    peer waits for this rank in a collective.
    """
    if rank is None:
        from mpi4py import MPI

        rank = MPI.COMM_WORLD.Get_rank()
    try:
        with open(os.path.join(folder, ARGV_FILE)) as fh:
            sys.argv = json.load(fh)
        if script:
            sys.path.insert(0, os.path.dirname(script))
            _load_script(script)
        with open(os.path.join(folder, TASK_FILE), "rb") as fh:
            func, args, kwargs = pickle.load(fh)
        result = func(*args, **kwargs)
        path = os.path.join(folder, result_file(rank))
        with open(path + ".tmp", "wb") as fh:
            pickle.dump(result, fh)
        os.replace(path + ".tmp", path)  # the driver sees a whole result or none
    except BaseException as exc:  # noqa: BLE001 - a rank that stops alone strands its peers
        if isinstance(exc, SystemExit) and exc.code in (None, 0):
            raise
        traceback.print_exc()
        line = f"rank {rank}: horovod.run's function failed: {type(exc).__name__}: {exc}"
        print(line, file=sys.stderr, flush=True)
        # Also for the driver to quote: when MPI_Abort ends the job, mpirun may drop what the ranks last printed.
        try:
            with open(os.path.join(folder, error_file(rank)), "w", encoding="utf-8") as fh:
                fh.write(line)
        except OSError:  # (a host that does not share the driver's folder: the line above is all there is)
            pass
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(1)
    return 0

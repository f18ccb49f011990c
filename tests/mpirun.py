"""Running real jobs under real mpirun from tests, always with a time bound."""

import os
import signal
import subprocess
import sys

from ringtrain.launch import detect_flavour, find_mpirun, mpi_env, mpirun_command

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_env(**extra):
    """Environment for a job: one BLAS thread per rank (2 cores here), unbuffered output."""
    env = mpi_env(detect_flavour(find_mpirun()))
    env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1",
               PYTHONUNBUFFERED="1", PYTHONDONTWRITEBYTECODE="1")
    env.update(extra)
    return env


def run(args, timeout=120, env=None, cwd=None, input=None):
    """Run ``args`` in its own process group; on timeout kill the group and fail.

    Returns a CompletedProcess with text stdout/stderr. A hang becomes an
    AssertionError that shows what the job printed, never a stuck suite.
    """
    proc = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=env or test_env(), cwd=cwd or ROOT, start_new_session=True,
        stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
    )
    try:
        out, err = proc.communicate(input=input, timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(
            f"timed out after {timeout}s: {' '.join(args)}\n--- stdout\n{out[-4000:]}\n--- stderr\n{err[-4000:]}"
        )
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def mpirun(np, command, timeout=120, env=None, cwd=None):
    """Run ``command`` (a list) on ``np`` ranks under a time bound."""
    return run(mpirun_command(np, command), timeout=timeout, env=env, cwd=cwd)


def ringtrain(*args):
    """The command line that runs ringtrain with this interpreter."""
    return [sys.executable, "-m", "ringtrain", *args]


def show(result):
    """Everything a job printed, for assertion messages."""
    return f"exit {result.returncode}\n--- stdout\n{result.stdout[-6000:]}\n--- stderr\n{result.stderr[-6000:]}"

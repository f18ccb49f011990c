"""Running real jobs under real mpirun from tests, always with a time bound."""

import glob
import os
import signal
import subprocess
import sys
import time

from ringtrain.cluster.launch import detect_flavour, find_mpirun, mpi_env, mpirun_command

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
    started = time.time()
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
        _sweep_shared_memory(started)
        raise AssertionError(
            f"timed out after {timeout}s: {' '.join(args)}\n--- stdout\n{out[-4000:]}\n--- stderr\n{err[-4000:]}"
        ) from None
    if proc.returncode != 0:
        _sweep_shared_memory(started)
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def _sweep_shared_memory(since):
    """Remove the shared-memory files an aborted MPICH job left in /dev/shm.

    A job that ends in ``MPI_Abort`` or SIGKILL never unlinks its segments
    (the fault tests abort on purpose, dozens of times a run), and /dev/shm
    is memory. Only this user's files made since the job started, and only
    those no live process still maps, are removed.
    """
    candidates = []
    for path in glob.glob("/dev/shm/mpich_shm_*"):
        try:
            st = os.stat(path)
        except OSError:
            continue
        if st.st_uid == os.getuid() and st.st_mtime >= since - 1:
            candidates.append(path)
    if not candidates:
        return
    # An aborted job's ranks may still be exiting when mpiexec returns: give
    # them a moment to unmap before deciding a file is someone else's.
    for _ in range(20):
        mapped = _mapped_shared_memory()
        if not any(path in mapped for path in candidates):
            break
        time.sleep(0.05)
    for path in candidates:
        if path not in mapped:
            try:
                os.unlink(path)
            except OSError:
                pass


def _mapped_shared_memory():
    """Every /dev/shm path some live process maps (that we may read)."""
    mapped = set()
    for maps in glob.glob("/proc/[0-9]*/maps"):
        try:
            with open(maps) as fh:
                mapped.update(line.split(None, 5)[5].strip() for line in fh if "/dev/shm/" in line)
        except (OSError, IndexError):
            continue
    return mapped


def mpirun(np, command, timeout=120, env=None, cwd=None):
    """Run ``command`` (a list) on ``np`` ranks under a time bound."""
    return run(mpirun_command(np, command), timeout=timeout, env=env, cwd=cwd)


def ringtrain(*args):
    """The command line that runs ringtrain with this interpreter."""
    return [sys.executable, "-m", "ringtrain", *args]


def show(result):
    """Everything a job printed, for assertion messages."""
    return f"exit {result.returncode}\n--- stdout\n{result.stdout[-6000:]}\n--- stderr\n{result.stderr[-6000:]}"

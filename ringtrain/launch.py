"""Building the ``mpirun`` command line for whichever MPI is installed.

MPICH's Hydra and Open MPI's mpirun take different flags for the same
things; this module hides that. (The ``ringtrain launch`` command and hostfile
parsing build on it.)
"""

import functools
import os
import shutil
import subprocess
import sys

__all__ = ["find_mpirun", "detect_flavour", "flavour_from_version", "mpirun_command", "mpi_env"]


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
    if flavour == "openmpi" and hasattr(os, "geteuid") and os.geteuid() == 0:
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    return env


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

"""Whether MPI can read and write GPU memory itself (CUDA-aware MPI), and how we know.

mpi4py 4.x has no query for it (its maintainers declined one), but MPICH,
Open MPI and MVAPICH each export ``MPIX_Query_cuda_support()`` from their
library: 1 when the library was built with CUDA support and it is enabled
at run time. :func:`cuda_aware` asks it through ctypes after MPI is
initialised; an MPI that does not export it says "no". Some MPIs cannot
tell (a CUDA-aware build behind a wrapper, a site install), so the
environment variable ``RINGTRAIN_CUDA_AWARE=0|1`` overrides the answer.

With a CUDA-aware MPI, CuPy buffers go to MPI directly; without one they are
staged through pinned host memory (:mod:`ringtrain.comm.collectives`).
"""

import ctypes

from ..errors import UsageError

__all__ = ["cuda_aware", "verdict", "ENV"]

ENV = "RINGTRAIN_CUDA_AWARE"


def verdict(override, query):
    """``(cuda_aware, why)`` from the environment's ``override`` and the library's ``query`` (pure).

    Args:
        override: the value of :data:`ENV`, or None when unset.
        query: what ``MPIX_Query_cuda_support()`` returned, or None when the
            library does not export it.

    Raises:
        UsageError: for an override other than 0 or 1.
    """
    if override is not None:
        if override.strip() not in ("0", "1"):
            raise UsageError(f"{ENV}={override!r}: expected 0 or 1 (or unset, to ask MPI)", everywhere=True)
        on = override.strip() == "1"
        return on, f"{ENV}={override.strip()}"
    if query is None:
        return False, "this MPI does not export MPIX_Query_cuda_support"
    return bool(query), f"MPIX_Query_cuda_support() returned {int(query)}"


def _query():
    """What the loaded MPI library's ``MPIX_Query_cuda_support()`` says, or None without one."""
    for path in _mpi_libraries():
        try:
            function = getattr(ctypes.CDLL(path), "MPIX_Query_cuda_support", None)
        except OSError:
            continue
        if function is not None:
            function.restype = ctypes.c_int
            function.argtypes = []
            return function()
    return None


def _mpi_libraries():
    # The library mpi4py linked against is already loaded: find it by its
    # mapping rather than guess a name (libmpi.so.12, libmpi.so.40, ...).
    found = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                parts = line.split()
                if len(parts) >= 6 and "/libmpi" in parts[5] and parts[5] not in found:
                    found.append(parts[5])
    except OSError:
        pass
    return found


def cuda_aware(environ=None):
    """``(cuda_aware, why)`` for this process's MPI; initialises MPI if it is not yet.

    Args:
        environ: the environment to read :data:`ENV` from (default ``os.environ``).
    """
    import os

    from mpi4py import MPI

    if not MPI.Is_initialized():  # mpi4py initialises on import unless told not to; the query needs it
        MPI.Init_thread()
    environ = os.environ if environ is None else environ
    override = environ.get(ENV)
    return verdict(override, None if override is not None else _query())

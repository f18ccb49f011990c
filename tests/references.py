"""What the MPI tests compare against: per-rank inputs, MPI's own Allreduce, bitwise agreement.

Imported by the files in tests/mpi (which run inside mpirun); each helper is
collective where it says so, and every rank must call it at the same point.
"""

import numpy as np
from mpi4py import MPI

from ringtrain import backend

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()


def data(n, dtype, seed=0):
    """This rank's input: small integers for int dtypes, normals for floats; different on every rank."""
    rng = np.random.default_rng(1000 * seed + rank)
    if np.dtype(dtype).kind == "i":
        return rng.integers(-1000, 1000, n).astype(dtype)
    return (rng.standard_normal(n) * 4).astype(dtype)


def reference(x, op="sum", on=None):
    """MPI's own Allreduce of ``x`` (collective): exact for integers, in float64 for floats."""
    on = on if on is not None else comm
    wide = backend.to_numpy(x).astype(np.int64 if x.dtype.kind == "i" else np.float64)
    mpi_op = {"sum": MPI.SUM, "mean": MPI.SUM, "min": MPI.MIN, "max": MPI.MAX}[op]
    on.Allreduce(MPI.IN_PLACE, wide, mpi_op)
    return wide / on.Get_size() if op == "mean" else wide


def close(got, want, dtype):
    """``got`` equals ``want`` exactly for integers, to the dtype's rounding for floats."""
    got = backend.to_numpy(got).astype(np.float64)
    if np.dtype(dtype).kind == "i":
        return np.array_equal(got, want)
    tol = {np.float16: 2e-2, np.float32: 1e-5, np.float64: 1e-12}[np.dtype(dtype).type]
    return np.allclose(got, want, rtol=tol, atol=tol * 4 * size)


def same_everywhere(y, on=None):
    """True on every rank when all ranks hold bitwise the same array (collective)."""
    on = on if on is not None else comm
    mine = backend.to_numpy(y).tobytes()
    return all(other == mine for other in on.allgather(mine))

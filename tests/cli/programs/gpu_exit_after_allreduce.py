"""Allreduce a CuPy array and exit at once: peers' CUDA IPC mappings must be closed before memory is freed.

argv: the number of float32 elements (large enough for CUDA IPC). Prints the
first element of the result on every rank and returns without waiting for
anything, so the interpreter's exit races whatever is still in flight.
"""

import sys

import numpy as np
from mpi4py import MPI

from ringtrain import backend
from ringtrain.cluster.topology import TaskSpec
from ringtrain.comm import allreduce_

comm = MPI.COMM_WORLD
backend.use_device(TaskSpec.from_mpi(comm).device)
cp = backend.xp_for("gpu")
x = cp.full(int(sys.argv[1]), comm.Get_rank() + 1, np.float32)
allreduce_(x, "sum", comm)
print(f"rank {comm.Get_rank()}: {float(x[0])}", flush=True)

"""Allreduce a CuPy array and exit at once: peers' CUDA IPC mappings must be closed before memory is freed.

argv: the number of float32 elements (large enough for CUDA IPC), and how to
reduce: "allreduce" (``allreduce_``) or "reducer" (a threaded Reducer, left
open). Prints the first element of the result on every rank and returns
without closing or freeing anything, so the interpreter's exit races
whatever is still in flight.
"""

import sys

import numpy as np
from mpi4py import MPI

from ringtrain import backend
from ringtrain.cluster.topology import TaskSpec
from ringtrain.comm import Reducer, allreduce_

comm = MPI.COMM_WORLD
backend.use_device(TaskSpec.from_mpi(comm).device)
cp = backend.xp_for("gpu")
x = cp.full(int(sys.argv[1]), comm.Get_rank() + 1, np.float32)
if sys.argv[2] == "allreduce":
    allreduce_(x, "sum", comm)
else:
    reducer = Reducer(comm, [x[: x.size // 2], x[x.size // 2:]], bucket_bytes=x.nbytes // 2, threaded=True)
    reducer.push(1, x[x.size // 2:])
    reducer.push(0, x[: x.size // 2])
    reducer.wait()  # the mean; never closed: its duplicate communicator's mappings close at exit
    x *= comm.Get_size()
print(f"rank {comm.Get_rank()}: {float(x[0])}", flush=True)

"""Sum an array across every rank and print one JSON line per rank.

Uses ringtrain's ring allreduce when ringtrain.collectives exists, else
mpi4py's; the reference is always MPI's own Allreduce of the same data.
"""

import json
import socket
import sys

import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
n = int(sys.argv[1]) if len(sys.argv) > 1 else 1 << 18
x = np.random.default_rng(comm.rank).standard_normal(n)
reference = np.empty_like(x)
comm.Allreduce(x, reference, op=MPI.SUM)
try:
    from ringtrain.collectives import allreduce
except ImportError:
    which, result = "mpi4py", comm.allreduce(x, op=MPI.SUM)
else:
    which, result = "ringtrain", allreduce(x, op="sum", comm=comm)
error = float(np.max(np.abs(np.asarray(result) - reference)))
results = comm.gather({"rank": comm.rank, "host": socket.gethostname(), "error": error, "using": which}, root=0)
if comm.rank == 0:
    print(json.dumps({"ranks": results, "scale": float(np.max(np.abs(reference)))}))

"""Two threads of every rank call collectives on one communicator at once.

Usage: ``python two_threads.py``. Each thread reduces its own array many
times; a refusal is printed as ``refused``, after which the rank aborts (as
abort_on_error would). A wrong sum is printed as ``WRONG`` but does not stop
the run: calls of two threads that never overlap on one rank, yet pair up
differently across ranks, are invisible to any one rank.
"""

import sys
import threading
import time

import numpy as np
from mpi4py import MPI

import ringtrain
import ringtrain.comm
from ringtrain.errors import UsageError

comm = MPI.COMM_WORLD
ringtrain.comm.set_timeout(20)
start = threading.Barrier(2)


def work(value, n):
    x = np.empty(n, np.float64)
    start.wait()
    for _ in range(2000):
        x[...] = value
        try:
            ringtrain.allreduce_(x, op="sum")
        except UsageError as exc:
            sys.stderr.write(f"rank {comm.Get_rank()}: refused: {exc}\n")
            sys.stderr.flush()
            time.sleep(1)  # let mpiexec pass the line on before the abort ends the job
            comm.Abort(3)
        if not np.all(x == value * comm.Get_size()):
            sys.stderr.write(f"rank {comm.Get_rank()}: WRONG result {x[0]} for {value}\n")
            sys.stderr.flush()


threads = [threading.Thread(target=work, args=(v, n)) for v, n in ((1.0, 100), (1000.0, 100))]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(f"rank {comm.Get_rank()}: no conflict seen")

"""Every rank but the last prints a line that merely contains "error:"; the last rank fails for real.

Usage: ``python blame.py raise|kill``. ``raise``: under ``abort_on_error``,
so the failing rank writes ringtrain's failure record and the job is
aborted. ``kill``: the last rank dies of SIGKILL with nothing in its log, as
the kernel's out-of-memory killer leaves it.
"""

import os
import signal
import sys

from mpi4py import MPI

import ringtrain

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
with ringtrain.abort_on_error(comm):
    if rank < size - 1:
        sys.stdout.write("epoch 1 validation error: 0.31; no abort here\n")
        sys.stdout.flush()
    comm.Barrier()
    if rank == size - 1 and sys.argv[1] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == size - 1:
        raise RuntimeError("the real failure")
    comm.Barrier()

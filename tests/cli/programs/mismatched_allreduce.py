"""Rank 1 calls the allreduce with a different length or dtype than its peers.

Usage: ``python mismatched_allreduce.py length|dtype``. Under
``abort_on_error`` like the CLI; the MismatchError that every rank raises is
printed as ``rank R: error: ...`` on every rank, exit status 2.
"""

import sys

import numpy as np
from mpi4py import MPI

import ringtrain
from ringtrain.errors import UsageError


def main(what):
    comm = MPI.COMM_WORLD
    odd = comm.Get_rank() == 1
    n = 1000 + (1 if odd and what == "length" else 0)
    dtype = np.float64 if odd and what == "dtype" else np.float32
    try:
        with ringtrain.abort_on_error(comm):
            ringtrain.allreduce(np.ones(n, dtype), comm=comm)
            comm.Barrier()
    except UsageError as exc:
        # One write per line: ranks share mpirun's stderr, and print() may split
        # the text and its newline into two writes that other ranks interleave.
        sys.stderr.write(f"rank {comm.Get_rank()}: error: {exc}\n")
        sys.stderr.flush()
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

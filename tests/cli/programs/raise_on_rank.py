"""Rank 1 raises while its peers wait in a barrier (the classic MPI hang)."""

import sys

from mpi4py import MPI

import ringtrain

guarded = sys.argv[1] == "guarded"
comm = MPI.COMM_WORLD
if guarded:
    with ringtrain.abort_on_error():
        if comm.Get_rank() == 1:
            raise RuntimeError("boom on purpose")
        comm.Barrier()
else:
    if comm.Get_rank() == 1:
        raise RuntimeError("boom on purpose")
    comm.Barrier()

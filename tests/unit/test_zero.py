"""The sharded step's pure choice of transport (the MPI side is in tests/mpi/test_zero.py)."""

import pytest

from ringtrain.comm.collectives import RING_BYTES
from ringtrain.comm.window import SINGLE_BLOCK_BYTES
from ringtrain.training.sharded import transport_for

SMALL, FITS, BIG = 64 << 10, SINGLE_BLOCK_BYTES - 4096, RING_BYTES + 1


@pytest.mark.parametrize("algorithm, nbytes, one_host, expected", [
    ("auto", SMALL, True, "shm"),
    ("auto", FITS, True, "shm"),
    ("auto", BIG, True, "ring"),      # past one slot of the window
    ("auto", SMALL, False, "mpi"),    # across hosts, latency-bound: MPI's own collectives
    ("auto", BIG, False, "ring"),
    ("ring", SMALL, True, "ring"),
    ("mpi", BIG, True, "mpi"),
    ("shm", FITS, True, "shm"),
    ("shm", BIG, True, None),         # the allreduce's shm path, in blocks
    ("shm", SMALL, False, None),
    ("hierarchical", SMALL, False, None),
    ("bogus", SMALL, True, None),
])
def test_transport_follows_the_allreduce_choice(algorithm, nbytes, one_host, expected):
    assert transport_for(algorithm, nbytes, one_host) == expected

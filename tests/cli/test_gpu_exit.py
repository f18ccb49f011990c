"""Exiting right after a GPU allreduce: every rank ends cleanly, with the right result (needs a GPU)."""

import os
import sys

import pytest
from mpirun import ROOT, mpirun, show

from ringtrain import backend

PROGRAM = os.path.join(ROOT, "tests", "cli", "programs", "gpu_exit_after_allreduce.py")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not backend.gpu_available(), reason="no CUDA GPU visible to CuPy on this machine")]


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_exiting_right_after_an_allreduce_ends_every_rank_cleanly(ranks):
    result = mpirun(ranks, [sys.executable, PROGRAM, str(16 << 20)], timeout=180)
    want = float(sum(range(1, ranks + 1)))
    assert result.returncode == 0, show(result)
    assert sorted(result.stdout.split("\n")[:-1]) == [f"rank {r}: {want}" for r in range(ranks)], show(result)
    assert "CUDA" not in result.stderr and "rror" not in result.stderr, show(result)

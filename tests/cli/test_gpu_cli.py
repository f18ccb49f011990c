"""Whole commands on a GPU: exiting right after an allreduce ends every rank cleanly; info says whether CUDA IPC works.

Needs a GPU; elsewhere every test is collected and skipped with the reason.
"""

import os
import re
import sys

import pytest
from mpirun import ROOT, mpirun, ringtrain, show

from ringtrain import backend

PROGRAM = os.path.join(ROOT, "tests", "cli", "programs", "gpu_exit_after_allreduce.py")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not backend.gpu_available(), reason="no CUDA GPU visible to CuPy on this machine")]


@pytest.mark.parametrize("how", ["allreduce", "reducer"])
@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_exiting_right_after_an_allreduce_ends_every_rank_cleanly(ranks, how):
    result = mpirun(ranks, [sys.executable, PROGRAM, str(16 << 20), how], timeout=180)
    want = float(sum(range(1, ranks + 1)))
    assert result.returncode == 0, show(result)
    # Ranks' lines may interleave on mpirun's output: find them, not split it.
    assert sorted(re.findall(r"rank (\d+): ([\d.]+)", result.stdout)) == [(str(r), str(want)) for r in range(ranks)]
    assert "CUDA" not in result.stderr and "rror" not in result.stderr, show(result)


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_info_says_whether_cuda_ipc_serves_the_ranks(ranks):
    # Where it cannot (containers, MIG, no peer access), GPU allreduces run at host speed: info says why.
    result = mpirun(ranks, ringtrain("info"), timeout=120)
    assert result.returncode == 0, show(result)
    line = [li for li in result.stdout.splitlines() if li.startswith("CUDA IPC among these ranks: ")]
    assert line and line[0].split(": ", 1)[1].startswith("yes"), show(result)


def test_the_gpu_is_chosen_before_mpi_starts():
    # A CUDA-aware MPI may set up CUDA on the current device in MPI_Init: the
    # CLI picks the device from the launcher's local rank before mpi4py is imported.
    program = ("import sys\n"
               "from ringtrain import cli\n"
               "cli._device_before_mpi(['train', '--device', 'gpu'])\n"
               "import cupy\n"
               "before, early = cupy.cuda.runtime.getDevice(), 'mpi4py.MPI' not in sys.modules\n"
               "from mpi4py import MPI\n"
               "from ringtrain.cluster.topology import TaskSpec\n"
               "spec = TaskSpec.from_mpi(MPI.COMM_WORLD)\n"
               "print('device', spec.rank, before == spec.device, early)\n")
    result = mpirun(3, [sys.executable, "-c", program], timeout=120)
    assert result.returncode == 0, show(result)
    assert sorted(re.findall(r"device (\d) (\w+) (\w+)", result.stdout)) == [(str(r), "True", "True") for r in range(3)]

"""A launcher that starts N processes MPI does not join is refused in one line, exit 2, nothing written.

Under a real ``torchrun --nproc_per_node 2`` (each process an MPI world of
one): ``ringtrain train``, a library script calling ``ringtrain.torch.init()``
and one calling ``ringtrain.train``, and ``ringtrain launch``. Another MPI's
``mpirun`` is its variables (no second MPI here); ``srun --mpi=none`` runs on
a real Slurm in tests/cli/test_slurm.py. What must not be refused: a batch
script's single process, which has ``SLURM_NTASKS`` but no step.
"""

import os
import re
import shutil
import subprocess
import sys

import pytest

from mpirun import mpirun, run, ringtrain, show
from mpirun import test_env as job_env

SMALL = ["--dataset", "synthetic", "--samples", "200", "--features", "8", "--classes", "3", "--hidden", "8",
         "--batch-size", "8", "--epochs", "1", "--no-progress"]
HVD_SCRIPT = "import ringtrain.torch as hvd\nhvd.init()\nprint('initialised', flush=True)\n"
TRAIN_SCRIPT = ("import ringtrain\nringtrain.train(ringtrain.TrainConfig(dataset='digits', epochs=1, run_dir='lib'))\n"
                "print('trained', flush=True)\n")
TORCHRUN = ("torchrun started 2 processes (WORLD_SIZE=2) but MPI sees 1 rank in each, so they would train as 2 "
            "separate jobs; ringtrain runs under MPI: use mpirun -np 2 (or srun --mpi=pmi2) instead of torchrun")


def test_under_torchrun_train_library_scripts_and_launch_each_say_one_line_and_exit_2(tmp_path):
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    if torchrun is None:
        pytest.skip("torchrun not installed (pip install torch==2.13.0)")
    (tmp_path / "hvd.py").write_text(HVD_SCRIPT)
    (tmp_path / "lib.py").write_text(TRAIN_SCRIPT)
    train = subprocess.list2cmdline(ringtrain("train", *SMALL, "--run-dir", "cli"))
    launch = subprocess.list2cmdline(ringtrain("launch", "-np", "2", "--", "true"))
    python = sys.executable
    # One torchrun, four programs in turn in each of its two processes.
    script = (f"{train}; echo status=$?; {python} hvd.py; echo status=$?; {python} lib.py; echo status=$?; "
              f"{launch}; echo status=$?")
    result = run([torchrun, "--nproc_per_node", "2", "--no-python", "bash", "-c", script], timeout=180,
                 cwd=str(tmp_path), env=job_env(OMP_NUM_THREADS="1"))
    assert result.stdout.count("status=2") == 8 and "status=0" not in result.stdout, show(result)
    assert "initialised" not in result.stdout and "trained" not in result.stdout, show(result)
    ours = [line for line in result.stderr.splitlines() if line.startswith("ringtrain")]
    expected = [f"ringtrain: error: {TORCHRUN}"] * 6 + [
        "ringtrain: error: torchrun started 2 copies of ringtrain launch (WORLD_SIZE=2), each of which would "
        "start the whole job; run it once, without torchrun"] * 2
    assert sorted(ours) == sorted(expected), show(result)
    assert "Traceback" not in result.stderr, show(result)
    assert sorted(os.listdir(tmp_path)) == ["hvd.py", "lib.py"]  # nothing written


def test_another_mpis_mpirun_is_named(tmp_path):
    env = job_env(OMPI_COMM_WORLD_SIZE="2", OMPI_COMM_WORLD_RANK="1", OMPI_COMM_WORLD_LOCAL_RANK="1")
    result = run(ringtrain("train", *SMALL, "--run-dir", "r"), timeout=60, env=env, cwd=str(tmp_path))
    assert result.returncode == 2, show(result)
    assert result.stderr.splitlines() == [
        "ringtrain: error: Open MPI's mpirun started 2 processes (OMPI_COMM_WORLD_SIZE=2) but MPI sees 1 rank in "
        "each, so they would train as 2 separate jobs: that mpirun belongs to another MPI than the one mpi4py was "
        "built with; use the mpirun of mpi4py's MPI (ringtrain launch finds it)"], show(result)
    assert os.listdir(tmp_path) == []


def test_a_batch_scripts_single_process_trains(tmp_path):
    # What sbatch --ntasks=2 sets in the script itself: the allocation's task count, no step. There is no
    # Slurm for squeue to ask (an empty configuration fails at once), so the job's time limit cannot be
    # read: one warning, and training goes on.
    (tmp_path / "slurm.conf").write_text("")
    env = job_env(SLURM_JOB_ID="2", SLURM_NTASKS="2", SLURM_NPROCS="2", SLURM_PROCID="0", SLURM_LOCALID="0",
                  SLURM_JOB_NODELIST="vm", SLURM_TASKS_PER_NODE="2", SLURM_CONF=str(tmp_path / "slurm.conf"))
    result = run(ringtrain("train", *SMALL, "--run-dir", "r"), timeout=60, env=env, cwd=str(tmp_path))
    assert result.returncode == 0 and "ringtrain: 1 rank(s)" in result.stdout, show(result)
    warned = [line for line in result.stderr.splitlines() if "time limit" in line]
    assert len(warned) == 1 and warned[0].startswith("ringtrain: warning: cannot read the Slurm job's time limit ("), \
        show(result)


@pytest.mark.parametrize("variable", ["OMPI_COMM_WORLD_RANK", "PMI_RANK"])
def test_launch_with_a_rank_variable_says_which_in_one_line_even_as_rank_1(tmp_path, variable):
    # The launcher is no rank: a left-over rank variable of 1 silenced its only error (status 2, no word).
    result = run(ringtrain("launch", "-np", "1", "--dry-run", "--", "true"), timeout=60,
                 env=job_env(**{variable: "1"}), cwd=str(tmp_path))
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, show(result)
    assert f"{variable}=1 says this process is a rank of an MPI job" in lines[0], show(result)
    assert not os.listdir(tmp_path)


def test_launch_under_mpirun_says_its_line_in_every_copy(tmp_path):
    result = mpirun(2, ringtrain("launch", "-np", "1", "--", "true"), timeout=60, cwd=str(tmp_path))
    # One line from each copy; mpiexec may join two ranks' lines (a newline forwarded after the next
    # rank's text), so the errors are counted where each begins, not by splitting lines.
    said = re.findall(r"ringtrain: error: (.*?)(?=ringtrain: error: |\n|$)", result.stderr)
    assert result.returncode == 2 and len(said) == 2, show(result)
    assert sorted(re.search(r"PMI_RANK=(\d)", s).group(1) for s in said) == ["0", "1"], show(result)
    assert all("starts mpirun itself" in s for s in said), show(result)
    assert len(result.stderr.strip().splitlines()) <= 2, show(result)
    assert "Traceback" not in result.stderr and not os.listdir(tmp_path)

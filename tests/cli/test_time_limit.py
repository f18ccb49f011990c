"""Before a Slurm job's time limit, ``ringtrain train`` stops with a checkpoint, and nothing is lost.

The job's end comes from ``SLURM_JOB_END_TIME`` (what Slurm 23.02 and later
set; tests/cli/test_slurm.py covers ``squeue`` on a real Slurm 22.05). It is
set 10 s ahead, within the rule's fixed 15 s slack from the first step on,
so the run stops after its first step whatever the machine's speed: the
test needs no wait and no timing. The margin rule
itself is tested with a clock in tests/unit/test_slurm_variables.py.
"""

import os
import time

import numpy as np

from mpirun import mpirun, ringtrain, show
from mpirun import test_env as job_env
from ringtrain.io.checkpoint import list_checkpoints, read_checkpoint

SMALL = ["--dataset", "synthetic", "--samples", "400", "--features", "8", "--classes", "3", "--hidden", "8",
         "--batch-size", "8", "--epochs", "2", "--no-progress"]


def params(run_dir):
    arrays, meta = read_checkpoint(list_checkpoints(os.path.join(run_dir, "checkpoints"))[0])
    return {k: v for k, v in arrays.items() if k.startswith("params/")}, meta


def test_a_run_stops_with_a_checkpoint_before_the_limit_and_its_resume_matches_a_straight_run(tmp_path):
    straight = mpirun(2, ringtrain("train", *SMALL, "--run-dir", str(tmp_path / "straight")), timeout=90)
    assert straight.returncode == 0, show(straight)
    slurm = job_env(SLURM_JOB_ID="7", SLURM_JOB_END_TIME=str(int(time.time()) + 10))
    command = ringtrain("train", *SMALL, "--run-dir", str(tmp_path / "run"))
    stopped = mpirun(2, command, timeout=90, env=slurm)
    assert stopped.returncode == 75, show(stopped)
    assert "ringtrain: the Slurm job's time limit is at " in stopped.stdout, show(stopped)
    assert "(SLURM_JOB_END_TIME); training stops with a checkpoint before it" in stopped.stdout, show(stopped)
    line = [s for s in stopped.stderr.splitlines() if s.startswith("ringtrain: stopped")]
    assert len(line) == 1 and "(before the job's time limit); checkpoint " in line[0], show(stopped)
    _, meta = params(tmp_path / "run")
    assert meta["step"] == 1 and meta["final"], meta
    resumed = mpirun(2, command, timeout=90)  # the requeued job, with its time
    assert resumed.returncode == 0 and "resumed from" in resumed.stdout, show(resumed)
    got, meta = params(tmp_path / "run")
    want, want_meta = params(tmp_path / "straight")
    assert meta["step"] == want_meta["step"]
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_told_not_to_it_runs_on_whatever_the_limit(tmp_path):
    slurm = job_env(SLURM_JOB_ID="7", SLURM_JOB_END_TIME=str(int(time.time()) + 10))
    result = mpirun(1, ringtrain("train", *SMALL, "--run-dir", str(tmp_path / "run"), "--no-stop-before-time-limit"),
                    timeout=90, env=slurm)
    assert result.returncode == 0 and "time limit" not in result.stdout + result.stderr, show(result)
    assert params(tmp_path / "run")[1]["epoch"] == 2

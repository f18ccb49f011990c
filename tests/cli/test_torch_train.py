"""A torch module through the trainer in real jobs: resume after a killed rank, and scripts/train_torch.py.

Skipped, with the reason, where torch is not installed. Every job runs under
real mpirun with a time bound.
"""

import os
import re
import sys
import time

import numpy as np
import pytest

import ringtrain
from mpirun import ROOT, mpirun, show
from ringtrain.io.checkpoint import list_checkpoints, read_checkpoint

pytest.importorskip("torch", reason="torch is not installed (pip install torch==2.13.0)")

PROGRAM = os.path.join(ROOT, "tests", "cli", "programs", "torch_train.py")
# digits at 2 ranks, batch 16: 45 steps per epoch; a few seconds of training.
FLAGS = ["--dataset", "digits", "--batch-size", "16", "--epochs", "2", "--lr", "0.05", "--eval-every", "0",
         "--checkpoint-every", "5", "--keep", "3", "--no-progress"]


def torch_train(fault, rank, step, run_dir, *flags):
    return [sys.executable, PROGRAM, fault, str(rank), str(step), *FLAGS, "--run-dir", str(run_dir), *flags]


def final_params(run_dir):
    params, meta = ringtrain.load_checkpoint(str(run_dir))
    assert meta["final"], meta
    return params


def test_resume_of_a_torch_run_after_a_killed_rank_is_bitwise_the_straight_run(tmp_path):
    straight = mpirun(2, torch_train("none", 0, 0, tmp_path / "straight"), timeout=120)
    assert straight.returncode == 0, show(straight)
    assert "sharded optimizer step" in straight.stdout, show(straight)  # the fast path, as for built-in models

    run_dir = tmp_path / "run"
    start = time.monotonic()
    killed = mpirun(2, torch_train("kill", 1, 23, run_dir), timeout=120)
    elapsed = time.monotonic() - start
    assert killed.returncode != 0, show(killed)
    assert elapsed < 60, f"the job took {elapsed:.1f}s to end after rank 1 died"
    names = sorted(os.listdir(run_dir / "checkpoints"))
    assert names == ["ckpt-00000010.npz", "ckpt-00000015.npz", "ckpt-00000020.npz"], names
    for path in list_checkpoints(run_dir / "checkpoints"):
        read_checkpoint(path)

    resumed = mpirun(2, torch_train("none", 0, 0, run_dir), timeout=120)
    assert resumed.returncode == 0, show(resumed)
    assert "ckpt-00000020.npz at step 20" in resumed.stdout, show(resumed)
    want, got = final_params(tmp_path / "straight"), final_params(run_dir)
    assert list(want) == list(got) and "0.weight" in want  # the torch module's own names
    for name in want:
        assert want[name].dtype == got[name].dtype and np.array_equal(want[name], got[name]), name
    digests = re.findall(r"^rank (\d+) digest ([0-9a-f]{64})$", resumed.stdout, re.M)
    assert len(digests) == 2 and digests[0][1] == digests[1][1], show(resumed)


def test_train_torch_script_learns_mnist5k(tmp_path):
    result = mpirun(2, [sys.executable, os.path.join(ROOT, "scripts", "train_torch.py"), "--epochs", "2",
                        "--run-dir", str(tmp_path / "run")], timeout=240, cwd=str(tmp_path))
    assert result.returncode == 0, show(result)
    assert "sharded optimizer step (reduce-scatter, update, allgather)" in result.stdout, show(result)
    found = re.search(r"torch cnn: test accuracy ([\d.]+)% after step 64", result.stdout)
    assert found and float(found.group(1)) >= 85.0, show(result)

"""A run's outcome is honest, and a resume takes only what fits, in real ``ringtrain`` processes.

* A run whose final checkpoint is not on disk exits 3, with one line naming
  the newest checkpoint that is.
* Auto-resume refuses a checkpoint whose model, data, data order or
  optimizer state differ (a different rank count is a warning: the
  position is kept in samples) (one line, exit 2, nothing written), lists the
  settings that only change the future, and follows the run directory's
  lineage, not the highest step number in it.

Most cases run one rank (resume is rank 0's affair, agreed in one
collective); the rank count's own rules run two. Every job has a time bound.
"""

import os
import shutil
import sys

import numpy as np
import pytest

from mpirun import ROOT, mpirun, ringtrain, show
from ringtrain import build_model
from ringtrain.io.checkpoint import list_checkpoints, save_checkpoint

FAULTY = os.path.join(ROOT, "tests", "cli", "programs", "faulty_train.py")
# 320 training rows: 40 steps per epoch on one rank, 20 on two.
SMALL = ["--dataset", "synthetic", "--samples", "400", "--features", "8", "--classes", "3", "--hidden", "8",
         "--batch-size", "8", "--epochs", "1", "--no-progress"]


def train(run_dir, *flags, ranks=1):
    return mpirun(ranks, ringtrain("train", *SMALL, "--run-dir", str(run_dir), *flags), timeout=60)


def one_error(result, *needles):
    assert result.returncode == 2, show(result)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ringtrain: error: "), show(result)
    for needle in needles:
        assert needle in lines[0], show(result)
    assert "Traceback" not in result.stderr + result.stdout


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A one-epoch, one-rank run to resume from (copied per test)."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    result = train(run_dir)
    assert result.returncode == 0, show(result)
    return run_dir


def copy_of(finished, tmp_path):
    shutil.copytree(finished, tmp_path / "run")
    return tmp_path / "run"


def snapshot(run_dir):
    return {name: os.stat(run_dir / "checkpoints" / name).st_mtime_ns
            for name in os.listdir(run_dir / "checkpoints")}


# --- the outcome ---------------------------------------------------------------

def test_a_final_checkpoint_that_cannot_be_written_exits_3_naming_the_newest_on_disk(tmp_path):
    run_dir = tmp_path / "run"
    # Something in the way of the final checkpoint's name: the rename onto it fails.
    os.makedirs(run_dir / "checkpoints" / "ckpt-00000060.npz" / "in-the-way")
    result = mpirun(2, ringtrain("train", *SMALL, "--epochs", "3", "--run-dir", str(run_dir)), timeout=60)
    assert result.returncode == 3, show(result)
    newest = run_dir / "checkpoints" / "ckpt-00000040.npz"
    assert (f"ringtrain: error: the final checkpoint (step 60) was not written; the newest checkpoint on disk is "
            f"{newest}") in result.stderr.splitlines(), show(result)


def test_a_full_disk_at_the_final_save_exits_3(tmp_path):
    # Saves at steps 20 and 40 (epoch ends), then the final one (third save) hits ENOSPC.
    run_dir = tmp_path / "run"
    command = [sys.executable, FAULTY, "enospc", "0", "2", *SMALL, "--epochs", "3", "--run-dir", str(run_dir)]
    result = mpirun(2, command, timeout=60)
    assert result.returncode == 3, show(result)
    assert "checkpoint at step 60 not written" in result.stderr, show(result)
    assert [os.path.basename(p) for p in list_checkpoints(run_dir / "checkpoints")] == [
        "ckpt-00000040.npz", "ckpt-00000020.npz"]


# --- what a resume may change ---------------------------------------------------

@pytest.mark.parametrize("flag, value, needle", [
    ("--samples", "4000", "trained with --samples 400 and this run has --samples 4000"),
    ("--optimizer", "adam", "trained with --optimizer sgd and this run has --optimizer adam"),
    ("--momentum", "0", "trained with --momentum 0.9 and this run has --momentum 0.0"),
    ("--hidden", "16", "trained with --hidden 8 and this run has --hidden 16"),
    ("--seed", "1", "trained with --seed 0 and this run has --seed 1"),
    ("--batch-size", "4", "trained with --batch-size 8 and this run has --batch-size 4"),
])
def test_auto_resume_refuses_what_changes_the_state(finished, tmp_path, flag, value, needle):
    run_dir = copy_of(finished, tmp_path)
    before = snapshot(run_dir)
    result = train(run_dir, "--epochs", "2", flag, value)
    one_error(result, "--resume auto: cannot resume from ", needle, "a new --run-dir", "--resume none")
    assert snapshot(run_dir) == before


def test_explicit_resume_refuses_another_optimizer_in_one_line(finished, tmp_path):
    result = train(tmp_path / "other", "--resume", str(finished), "--optimizer", "adam")
    one_error(result, "trained with --optimizer sgd", "give --optimizer sgd, or --resume none")
    assert not (tmp_path / "other").exists()


def test_settings_that_only_change_the_future_are_listed_in_one_notice(finished, tmp_path):
    run_dir = copy_of(finished, tmp_path)
    result = train(run_dir, "--epochs", "2", "--lr", "0.05", "--keep", "5")
    assert result.returncode == 0, show(result)
    notices = [line for line in result.stdout.splitlines() if "changed since the checkpoint" in line]
    assert notices == ["ringtrain: settings changed since the checkpoint: --epochs 2 (was 1), --lr 0.05 (was 0.1), "
                       "--keep 5 (was 3)"], show(result)
    assert "resumed from" in result.stdout and "finished: step 80, 2 epochs done" in result.stdout, show(result)


def test_a_different_rank_count_is_a_warning_for_auto_and_an_explicit_path(finished, tmp_path):
    # The position is kept in samples, so any rank count goes on exactly (tests/cli/test_resume_any_size.py);
    # only the bits differ from a run at the first rank count.
    for resume in ([], ["--resume", str(copy_of(finished, tmp_path / "explicit"))]):
        run_dir = copy_of(finished, tmp_path / ("auto" if not resume else "again"))
        result = train(run_dir, "--epochs", "2", *resume, ranks=2)
        assert result.returncode == 0, show(result)
        assert result.stderr.splitlines() == [
            "ringtrain: warning: resuming a 1-rank run on 2 ranks: the data order differs from here on, so results "
            "will not match a 1-rank run bitwise"], show(result)
        assert "finished: step 60" in result.stdout, show(result)


def test_a_checkpoint_without_ringtrain_metadata_is_one_line(tmp_path):
    # The model's own parameters, saved through the library without the trainer's metadata.
    model = build_model("mlp", 8, 3, hidden=(8,))
    path = save_checkpoint(tmp_path / "lib", 3, {f"params/{k}": np.asarray(v) for k, v in model.params.items()})
    result = train(tmp_path / "run", "--resume", path)
    one_error(result, f"checkpoint {path} has no training metadata", "--resume none")


# --- lineages --------------------------------------------------------------------

def test_auto_resume_follows_a_new_run_started_with_resume_none(tmp_path):
    run_dir = tmp_path / "run"
    old = train(run_dir, "--epochs", "2", "--checkpoint-every", "10")
    assert old.returncode == 0, show(old)  # checkpoints at 60, 70, 80 are left
    new = train(run_dir, "--epochs", "2", "--checkpoint-every", "10", "--resume", "none", "--max-steps", "25")
    assert new.returncode == 0 and "starting a new run in" in new.stdout, show(new)
    # The new run stopped at step 25 (as an interruption would); its 25 is lower than the old run's 80.
    again = train(run_dir, "--epochs", "2", "--checkpoint-every", "10")
    assert again.returncode == 0, show(again)
    assert f"resumed from {run_dir}/checkpoints/ckpt-00000025.npz at step 25" in again.stdout, show(again)


def test_a_new_lineage_interrupted_before_its_first_checkpoint_falls_back_to_where_it_started(finished, tmp_path):
    # A branch from an explicit checkpoint that stops before writing any checkpoint of its own
    # (a kill would do the same; here the run directory is simply left as the branch's start wrote it).
    run_dir = tmp_path / "run"
    start = finished / "checkpoints" / "ckpt-00000040.npz"
    branch = train(run_dir, "--epochs", "2", "--resume", str(start), "--max-steps", "41")
    assert branch.returncode == 0, show(branch)
    for path in list_checkpoints(run_dir / "checkpoints"):
        os.unlink(path)
    again = train(run_dir, "--epochs", "2")
    assert again.returncode == 0, show(again)
    assert f"resumed from {start} at step 40" in again.stdout, show(again)

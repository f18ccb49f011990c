"""Right answers and records: the data a run resumes on, what a run says it trained, odd metrics, empty test sets.

Real jobs under real ``mpirun`` at 2 and 3 ranks, each under a time bound.
"""

import json
import os
import sys

import numpy as np
import pytest

from mpirun import ROOT, mpirun, ringtrain as rt, run, show
from ringtrain.io.checkpoint import list_checkpoints, read_checkpoint

FLAGS = ["--hidden", "8", "--batch-size", "8", "--epochs", "1", "--no-progress"]


def save_data(path, seed, rows=240):
    rng = np.random.default_rng(seed)
    np.savez(path, x=rng.normal(size=(rows, 6)).astype(np.float32), y=rng.integers(0, 3, size=rows))


# --- the data a run resumes on --------------------------------------------------------------

@pytest.mark.parametrize("ranks", [2, 3])
def test_the_same_file_under_another_spelling_resumes(tmp_path, ranks):
    save_data(tmp_path / "d.npz", 0)
    first = mpirun(ranks, rt("train", "--dataset", "d.npz", *FLAGS, "--run-dir", "run"), cwd=str(tmp_path),
                   timeout=60)
    assert first.returncode == 0, show(first)
    again = mpirun(ranks, rt("train", "--dataset", "./d.npz", *FLAGS, "--epochs", "2", "--run-dir", "run"),
                   cwd=str(tmp_path), timeout=60)
    # Before: refused, "it was trained with --dataset d.npz and this run has --dataset ./d.npz".
    assert again.returncode == 0, show(again)
    assert "resumed from" in again.stdout, show(again)


@pytest.mark.parametrize("ranks", [2, 3])
def test_the_same_name_with_other_contents_is_refused(tmp_path, ranks):
    save_data(tmp_path / "d.npz", 0)
    first = mpirun(ranks, rt("train", "--dataset", "d.npz", *FLAGS, "--run-dir", "run"), cwd=str(tmp_path),
                   timeout=60)
    assert first.returncode == 0, show(first)
    save_data(tmp_path / "d.npz", 1)  # same shape, other rows
    before = sorted(os.listdir(tmp_path / "run" / "checkpoints"))
    again = mpirun(ranks, rt("train", "--dataset", "d.npz", *FLAGS, "--epochs", "2", "--run-dir", "run"),
                   cwd=str(tmp_path), timeout=60)
    assert again.returncode == 2, show(again)
    lines = again.stderr.strip().splitlines()
    assert len(lines) == 1 and "--dataset d.npz holds other data than it was trained on" in lines[0], show(again)
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == before


# --- what a run says it trained ----------------------------------------------------------------

def test_a_torch_model_is_recorded_as_what_it_is(tmp_path):
    pytest.importorskip("torch", reason="torch is not installed (pip install torch==2.13.0)")
    program = os.path.join(ROOT, "tests", "cli", "programs", "torch_train.py")
    run_dir = tmp_path / "run"
    result = mpirun(2, [sys.executable, program, "none", "0", "0", "--dataset", "digits", "--batch-size", "16",
                        "--epochs", "1", "--max-steps", "5", "--no-progress", "--run-dir", str(run_dir)], timeout=120)
    assert result.returncode == 0, show(result)
    config = json.loads((run_dir / "config.json").read_text())
    assert config["model_name"] == "torch Sequential", config
    meta = read_checkpoint(list_checkpoints(run_dir / "checkpoints")[0])[1]
    assert meta["model_name"] == "torch Sequential", meta
    # The record is still a config file a later run can take.
    again = run(rt("train", "--config", str(run_dir / "config.json"), "--run-dir", str(tmp_path / "cli"),
                   "--max-steps", "2", "--dataset", "digits"), timeout=60)
    assert again.returncode == 0, show(again)


def test_a_built_in_model_is_recorded_with_its_sizes(tmp_path):
    run_dir = tmp_path / "run"
    result = mpirun(2, rt("train", "--dataset", "synthetic", "--samples", "200", "--features", "4", "--classes", "3",
                          *FLAGS, "--run-dir", str(run_dir)), timeout=60)
    assert result.returncode == 0, show(result)
    assert json.loads((run_dir / "config.json").read_text())["model_name"] == "mlp 8"


# --- an empty test set -----------------------------------------------------------------------------

@pytest.mark.parametrize("ranks", [2, 3])
def test_an_empty_test_set_has_no_accuracy(tmp_path, ranks):
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "d.npz", x=rng.normal(size=(240, 6)).astype(np.float32), y=rng.integers(0, 3, size=240),
             x_test=np.zeros((0, 6), np.float32), y_test=np.zeros(0, np.int64))
    result = mpirun(ranks, rt("train", "--dataset", str(tmp_path / "d.npz"), *FLAGS, "--run-dir",
                              str(tmp_path / "run")), timeout=60)
    assert result.returncode == 0, show(result)
    assert "test accuracy n/a (the test set is empty)" in result.stdout, show(result)
    assert "0.00%" not in result.stdout, show(result)
    # `ringtrain plot` draws what there is: an eval event without an accuracy is no traceback.
    plotted = run(rt("plot", str(tmp_path / "run")), timeout=60)
    assert plotted.returncode == 0 and "Traceback" not in plotted.stderr, show(plotted)


# --- odd metrics -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("records", [
    [{"event": "train", "step": 1}],  # no loss, no accuracy
    [{"event": "train", "step": 1, "loss": "high", "accuracy": None, "samples_per_sec": "fast"}],
    [{"event": "eval", "step": 1, "loss": None, "accuracy": None}, {"event": "train", "step": 2, "loss": -1.0,
                                                                   "accuracy": 0.5}],
])
def test_plot_on_odd_metrics_is_no_traceback(tmp_path, records):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "run" / "config.json").write_text(json.dumps({"model": 3, "hidden": "x"}))
    result = run(rt("plot", str(tmp_path / "run")), timeout=60)
    assert "Traceback" not in result.stderr, show(result)
    assert result.returncode == 0 or (result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1), \
        show(result)


# --- a run that learned nothing, though nothing failed ------------------------------------------------

@pytest.mark.parametrize("ranks", [2, 3])
def test_a_run_at_chance_accuracy_ends_with_a_warning(tmp_path, ranks):
    # Every row the same: no model can tell the classes apart, and the balanced test set pins it at 1/3.
    np.savez(tmp_path / "d.npz", x=np.zeros((240, 6), np.float32), y=np.arange(240) % 3,
             x_test=np.zeros((30, 6), np.float32), y_test=np.arange(30) % 3)
    result = mpirun(ranks, rt("train", "--dataset", str(tmp_path / "d.npz"), *FLAGS, "--run-dir",
                              str(tmp_path / "run")), timeout=60)
    assert result.returncode == 0, show(result)
    warned = [line for line in result.stderr.splitlines() if line.startswith("ringtrain: warning: ")]
    assert len(warned) == 1 and "test accuracy 33.33% is chance for 3 classes" in warned[0], show(result)


@pytest.mark.parametrize("ranks", [2, 3])
def test_a_loss_that_explodes_but_stays_finite_ends_with_a_warning(tmp_path, ranks):
    flags = ["--dataset", "synthetic", "--samples", "400", "--features", "8", "--classes", "3", "--hidden", "8",
             "--batch-size", "8", "--epochs", "3", "--no-progress", "--lr", "5", "--log-every", "5",
             "--max-nonfinite", "1000", "--run-dir", str(tmp_path / "run")]
    result = mpirun(ranks, rt("train", *flags), timeout=60)
    assert result.returncode == 0, show(result)
    assert "ringtrain: warning: the training loss rose from" in result.stderr, show(result)
    assert "training diverged; lower --lr" in result.stderr, show(result)

"""ringtrain.io.tensorboard: which scalars each metrics event gives, the refusals, and a file read back."""

import math
import os

import pytest

from ringtrain.io import tensorboard

pytest.importorskip("tensorboardX", reason="tensorboardX is not installed (pip install tensorboardX)")
from tensorboard_events import read_scalars  # noqa: E402


def test_scalars_of_each_event():
    epoch = {"step": 23, "epoch": 1, "loss": 0.5, "accuracy": 0.75, "samples_per_sec": 1000.0, "samples": 736}
    assert tensorboard.scalars_of("epoch", epoch) == [("train/loss", 0.5, 23), ("train/accuracy", 0.75, 23),
                                                      ("train/samples_per_sec", 1000.0, 23)]
    # A train event (a window cut short at an epoch's end, maybe) gives only its learning rate directly.
    train = {"step": 10, "epoch": 0, "loss": 0.5, "accuracy": 0.75, "samples_per_sec": 1000.0, "lr": 0.1}
    assert tensorboard.scalars_of("train", train) == [("train/learning_rate", 0.1, 10)]
    # An empty test set has no accuracy (None): left out, not written as 0.
    assert tensorboard.scalars_of("eval", {"step": 3, "loss": None, "accuracy": None}) == []
    assert tensorboard.scalars_of("checkpoint", {"step": 3, "path": "x"}) == []


def _train(step, steps, losses, correct, seconds):
    """The train event the trainer writes for ``steps`` steps of 32 samples each (pure)."""
    n = 32 * steps
    return {"step": step, "steps": steps, "samples": n, "loss": sum(losses) / n, "accuracy": correct / n,
            "samples_per_sec": n / seconds, "lr": 0.1}


def test_windows_join_the_pieces_cut_at_epoch_ends_into_windows_of_log_every_steps():
    # Steps of per-step loss sums 1..12; log_every 5; epochs of 3 steps cut windows at 3, 6, 9, 12.
    per_step = [float(i) for i in range(1, 13)]
    windows = tensorboard.Windows(5)
    joined = []
    for start, end in [(0, 3), (3, 5), (5, 6), (6, 9), (9, 10), (10, 12)]:
        out = windows.add(_train(end, end - start, per_step[start:end], correct=8 * (end - start),
                                 seconds=0.5 * (end - start)))
        joined.append(out)
    assert [j is None for j in joined] == [True, False, True, True, False, True]  # at steps 5 and 10 only
    for out, (start, end) in zip([joined[1], joined[4]], [(0, 5), (5, 10)]):
        assert out["step"] == end
        assert out["loss"] == pytest.approx(sum(per_step[start:end]) / (32 * 5), rel=1e-12)
        assert out["accuracy"] == pytest.approx(0.25) and out["samples_per_sec"] == pytest.approx(64.0)


def test_a_window_that_is_not_whole_gives_no_point():
    windows = tensorboard.Windows(5)
    assert windows.add(_train(5, 2, [1.0, 1.0], 1, 1.0)) is None  # resumed at step 3: 2 steps, not 5
    assert windows.add(_train(10, 5, [1.0] * 5, 1, 1.0)) is not None
    assert windows.add({"step": 15, "loss": 1.0}) is None  # an old event without steps and samples


def test_missing_library_is_one_line_with_the_install_line(monkeypatch):
    assert tensorboard.missing_problem() is None
    monkeypatch.setattr(tensorboard, "available", lambda: False)
    assert tensorboard.missing_problem().endswith(": pip install tensorboardX")


def test_folder_problems(tmp_path):
    (tmp_path / "file").write_text("x")
    assert tensorboard.folder_problem(str(tmp_path / "new" / "deeper")) is None
    assert "is not a directory" in tensorboard.folder_problem(str(tmp_path / "file"))
    assert "cannot be made" in tensorboard.folder_problem(str(tmp_path / "file" / "below"))


def test_written_scalars_read_back(tmp_path):
    warnings = []
    board = tensorboard.TensorBoard(str(tmp_path / "tb"), warnings.append, log_every=5)
    board.write("train", {"step": 5, "steps": 5, "samples": 10, "loss": 2.0, "accuracy": 0.25,
                          "samples_per_sec": 10.0, "lr": 0.01})
    board.write("eval", {"step": 5, "loss": 1.5, "accuracy": 0.5})
    board.write("epoch", {"step": 7, "epoch": 1, "loss": float("nan"), "accuracy": 0.5, "samples_per_sec": 12.0})
    board.write("train", {"step": 7, "steps": 2, "samples": 4, "loss": 1.0, "accuracy": 0.5,
                          "samples_per_sec": 12.0, "lr": 0.02})
    board.close()
    scalars, files = read_scalars(str(tmp_path / "tb"))
    assert len(files) == 1 and warnings == []
    assert scalars["train_window/loss"] == [(5, 2.0)] and math.isnan(scalars["train/loss"][0][1])
    assert scalars["eval/accuracy"] == [(5, 0.5)]
    assert [s for s, _ in scalars["train/learning_rate"]] == [5, 7]


def test_a_failed_write_is_one_warning_and_no_more(tmp_path):
    (tmp_path / "file").write_text("x")
    warnings = []
    board = tensorboard.TensorBoard(str(tmp_path / "file" / "tb"), warnings.append)
    for step in (1, 2, 3):
        board.write("epoch", {"step": step, "loss": 1.0})
    board.close()
    assert len(warnings) == 1 and "training goes on without it" in warnings[0], warnings
    assert os.listdir(tmp_path) == ["file"]

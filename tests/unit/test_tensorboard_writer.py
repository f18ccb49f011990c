"""ringtrain.io.tensorboard: which scalars each metrics event gives, the refusals, and a file read back."""

import math
import os

import pytest

from ringtrain.io import tensorboard

pytest.importorskip("tensorboardX", reason="tensorboardX is not installed (pip install tensorboardX)")
from tensorboard_events import read_scalars  # noqa: E402


def test_scalars_of_train_and_eval_events():
    train = {"step": 10, "epoch": 0, "loss": 0.5, "accuracy": 0.75, "samples_per_sec": 1000.0, "lr": 0.1}
    assert tensorboard.scalars_of("train", train) == [("train/loss", 0.5, 10), ("train/accuracy", 0.75, 10),
                                                      ("train/samples_per_sec", 1000.0, 10),
                                                      ("train/learning_rate", 0.1, 10)]
    # An empty test set has no accuracy (None): left out, not written as 0.
    assert tensorboard.scalars_of("eval", {"step": 3, "loss": None, "accuracy": None}) == []
    assert tensorboard.scalars_of("checkpoint", {"step": 3, "path": "x"}) == []


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
    board = tensorboard.TensorBoard(str(tmp_path / "tb"), warnings.append)
    board.write("train", {"step": 5, "loss": 2.0, "accuracy": 0.25, "samples_per_sec": 10.0, "lr": 0.01})
    board.write("eval", {"step": 5, "loss": 1.5, "accuracy": 0.5})
    board.write("train", {"step": 10, "loss": float("nan"), "accuracy": 0.5, "samples_per_sec": 12.0, "lr": 0.02})
    board.close()
    scalars, files = read_scalars(str(tmp_path / "tb"))
    assert len(files) == 1 and warnings == []
    assert scalars["train/loss"][0] == (5, 2.0) and math.isnan(scalars["train/loss"][1][1])
    assert scalars["eval/accuracy"] == [(5, 0.5)]
    assert [s for s, _ in scalars["train/learning_rate"]] == [5, 10]


def test_a_failed_write_is_one_warning_and_no_more(tmp_path):
    (tmp_path / "file").write_text("x")
    warnings = []
    board = tensorboard.TensorBoard(str(tmp_path / "file" / "tb"), warnings.append)
    for step in (1, 2, 3):
        board.write("train", {"step": step, "loss": 1.0})
    board.close()
    assert len(warnings) == 1 and "training goes on without it" in warnings[0], warnings
    assert os.listdir(tmp_path) == ["file"]

"""``ringtrain train --tensorboard DIR`` under real mpirun: rank 0's scalars read back against the console."""

import json
import os
import re
import sys

import pytest

from mpirun import ROOT, mpirun, ringtrain as rt, show

pytest.importorskip("tensorboardX", reason="tensorboardX is not installed (pip install tensorboardX)")
from tensorboard_events import read_scalars  # noqa: E402


def _records(run_dir, event):
    with open(run_dir / "metrics.jsonl") as fh:
        return [r for r in map(json.loads, fh) if r["event"] == event]


def test_train_is_the_consoles_epoch_figure_and_train_window_windows_of_log_every_steps(tmp_path):
    common = ["train", "--dataset", "digits", "--epochs", "2", "--warmup-steps", "20"]
    run_dir, board = tmp_path / "run", tmp_path / "tb"
    result = mpirun(3, rt(*common, "--log-every", "7", "--run-dir", str(run_dir), "--tensorboard", str(board)),
                    timeout=240)
    assert result.returncode == 0, show(result)
    # The reference: the same run (--log-every changes no number) with a train event at every step.
    each_step = mpirun(3, rt(*common, "--log-every", "1", "--run-dir", str(tmp_path / "steps")), timeout=240)
    assert each_step.returncode == 0, show(each_step)
    scalars, files = read_scalars(str(board))
    assert len(files) == 1, files  # rank 0 alone writes

    # train/*: one point per epoch, the console's epoch line (and metrics.jsonl's epoch event).
    console = [(float(loss), float(accuracy)) for loss, accuracy in
               re.findall(r"^epoch \d+/2  loss (\S+)  accuracy (\S+)%", result.stdout, re.M)]
    epochs = _records(run_dir, "epoch")
    assert len(console) == len(epochs) == 2, show(result)
    assert [s for s, _ in scalars["train/loss"]] == [r["step"] for r in epochs]
    for (_, loss), (_, accuracy), record, (printed_loss, printed_accuracy) in zip(
            scalars["train/loss"], scalars["train/accuracy"], epochs, console):
        assert loss == pytest.approx(record["loss"], rel=1e-6)  # TensorBoard keeps float32
        assert round(loss, 4) == pytest.approx(printed_loss, abs=1e-4) and round(100 * accuracy, 2) == printed_accuracy

    # train_window/*: every 7 steps, the mean of exactly those 7 steps, from the per-step reference.
    steps = {r["step"]: r for r in _records(tmp_path / "steps", "train")}
    last = max(steps)
    assert [s for s, _ in scalars["train_window/loss"]] == list(range(7, last + 1, 7))
    for step, loss in scalars["train_window/loss"]:
        window = [steps[s] for s in range(step - 6, step + 1)]
        want = sum(r["loss"] * r["samples"] for r in window) / sum(r["samples"] for r in window)
        assert loss == pytest.approx(want, rel=1e-5), step

    for event, field, tag in [("train", "lr", "train/learning_rate"), ("eval", "loss", "eval/loss"),
                              ("eval", "accuracy", "eval/accuracy")]:
        want = [(r["step"], r[field]) for r in _records(run_dir, event)]
        got = scalars[tag]
        assert [s for s, _ in got] == [s for s, _ in want] and want, (tag, got, want)
        for (_, g), (_, w) in zip(got, want):
            assert g == pytest.approx(w, rel=1e-6), tag
    lrs = [v for _, v in scalars["train/learning_rate"]]
    assert lrs[0] < lrs[-1] == pytest.approx(0.1)  # the warmup shows


def test_a_missing_tensorboardx_is_one_line_exit_2_before_training(tmp_path):
    # tensorboardX hidden from the ranks as if it were not installed.
    program = tmp_path / "no_tensorboardx.py"
    program.write_text("import sys\nsys.modules['tensorboardX'] = None\nfrom ringtrain.cli import console\n"
                       "sys.argv[0] = 'ringtrain'\nconsole()\n")
    run_dir, board = tmp_path / "run", tmp_path / "tb"
    result = mpirun(2, [sys.executable, str(program), "train", "--run-dir", str(run_dir), "--tensorboard", str(board)],
                    timeout=120)
    assert result.returncode == 2, show(result)
    lines = result.stderr.strip().splitlines()
    needle = "needs tensorboardX, which is not installed: pip install tensorboardX"
    assert len(lines) == 1 and lines[0].endswith(needle), show(result)
    with open(os.path.join(ROOT, "docs", "train.md"), encoding="utf-8") as fh:
        assert f"\n{lines[0]}\n" in fh.read(), "docs/train.md must show the line as the program prints it"
    assert not run_dir.exists() and not board.exists()


def test_a_file_in_place_of_the_folder_is_refused(tmp_path):
    (tmp_path / "tb").write_text("not a folder")
    result = mpirun(1, rt("train", "--run-dir", str(tmp_path / "run"), "--tensorboard", str(tmp_path / "tb")),
                    timeout=120)
    assert result.returncode == 2 and "--tensorboard: " in result.stderr, show(result)
    assert len(result.stderr.strip().splitlines()) == 1 and not os.path.exists(tmp_path / "run")

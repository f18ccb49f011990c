"""``ringtrain train --tensorboard DIR`` under real mpirun: rank 0's scalars are metrics.jsonl's, read back."""

import json
import os
import sys

import pytest

from mpirun import mpirun, ringtrain as rt, show

pytest.importorskip("tensorboardX", reason="tensorboardX is not installed (pip install tensorboardX)")
from tensorboard_events import read_scalars  # noqa: E402


def test_rank_0_writes_the_train_and_eval_scalars_of_metrics_jsonl(tmp_path):
    run_dir, board = tmp_path / "run", tmp_path / "tb"
    result = mpirun(3, rt("train", "--dataset", "digits", "--epochs", "2", "--log-every", "7", "--warmup-steps", "20",
                          "--run-dir", str(run_dir), "--tensorboard", str(board)), timeout=240)
    assert result.returncode == 0, show(result)
    with open(run_dir / "metrics.jsonl") as fh:
        records = [json.loads(line) for line in fh]
    scalars, files = read_scalars(str(board))
    assert len(files) == 1, files  # rank 0 alone writes
    for event, field, tag in [("train", "loss", "train/loss"), ("train", "accuracy", "train/accuracy"),
                              ("train", "samples_per_sec", "train/samples_per_sec"),
                              ("train", "lr", "train/learning_rate"), ("eval", "loss", "eval/loss"),
                              ("eval", "accuracy", "eval/accuracy")]:
        want = [(r["step"], r[field]) for r in records if r["event"] == event]
        got = scalars[tag]
        assert [s for s, _ in got] == [s for s, _ in want] and want, (tag, got, want)
        for (_, g), (_, w) in zip(got, want):
            assert g == pytest.approx(w, rel=1e-6), tag  # TensorBoard keeps float32
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
    assert not run_dir.exists() and not board.exists()


def test_a_file_in_place_of_the_folder_is_refused(tmp_path):
    (tmp_path / "tb").write_text("not a folder")
    result = mpirun(1, rt("train", "--run-dir", str(tmp_path / "run"), "--tensorboard", str(tmp_path / "tb")),
                    timeout=120)
    assert result.returncode == 2 and "--tensorboard: " in result.stderr, show(result)
    assert len(result.stderr.strip().splitlines()) == 1 and not os.path.exists(tmp_path / "run")

"""A mid-epoch resume on another rank count trains exactly the rest of the epoch, under real mpirun.

One ``mpirun -np 5`` job (tests/cli/programs/resume_any_size.py) trains the
first part of an epoch on N ranks, stops with a checkpoint, and resumes on M
ranks, for 2 -> 3, 3 -> 2 and 4 -> 1 mid-epoch, and 4 -> 3, 3 -> 5 and 1 -> 4
just before the epoch's last, partial batch, recording the row every sample
came from. The reference is the dataset itself: every training row, once,
and none more than twice with the padding.
"""

import collections
import json
import os
import sys

import numpy as np

from mpirun import ROOT, mpirun, show

PROGRAM = os.path.join(ROOT, "tests", "cli", "programs", "resume_any_size.py")
PAIRS = ("2:3", "3:2", "4:1", "4:3@last", "3:5@last", "1:4@last")
ROWS, BATCH = 203, 5  # odd counts: shards of unequal size at every N, and a last batch that is partial


def test_a_resume_on_more_or_fewer_ranks_skips_and_repeats_no_sample_of_the_epoch(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, 5)).astype(np.float32)
    x[:, 0] = np.arange(ROWS)  # each row carries its own number
    np.savez(tmp_path / "rows.npz", x=x, y=rng.integers(0, 3, ROWS), x_test=x[:10], y_test=rng.integers(0, 3, 10))
    result = mpirun(5, [sys.executable, PROGRAM, str(tmp_path / "rows.npz"), str(tmp_path), str(BATCH), *PAIRS],
                    timeout=240)
    assert result.returncode == 0, show(result)
    assert result.stderr.count("the data order differs from here on") == len(PAIRS), show(result)
    assert "(in epoch 1, step " in result.stdout and "(epoch 0)" not in result.stdout, show(result)
    with open(tmp_path / "records.json") as f:
        records = json.load(f)
    every_row = set(int(v) for v in x[:, 0])
    for pair in PAIRS:
        n, m = map(int, pair.split("@")[0].split(":"))
        before, after, final = records[pair]["before"], records[pair]["after"], records[pair]["final"]
        assert len(before) == records[pair]["cut"] * n * BATCH, pair
        if not pair.endswith("@last"):  # every rank has rows enough left to pad with them
            assert not set(before) & set(after), f"{pair}: rows trained before the resume were trained again"
        skipped = sorted(every_row - set(before) - set(after))
        assert not skipped, f"{pair}: rows never trained in the epoch: {skipped}"
        assert len(set(before)) == len(before), f"{pair}: a row repeated before the cut"
        # After it, repeats are the padding only: full batches on every rank, no row more than twice in the epoch.
        assert max(collections.Counter(before + after).values()) <= 2 and len(after) % (m * BATCH) == 0, pair
        assert len(after) - len(every_row - set(before)) < m * BATCH + 2 * np.sqrt(ROWS), pair
        steps_after = len(after) // (m * BATCH)
        assert final == {"step": records[pair]["cut"] + steps_after, "epoch": 1, "step_in_epoch": 0,
                         "world_size": m, "data_position": {"epoch": 1, "parts": []}}, (pair, final)


def test_a_damaged_position_is_one_line_and_exit_2(tmp_path):
    from mpirun import ringtrain
    from refusals import assert_refused
    from ringtrain.io.checkpoint import list_checkpoints, read_checkpoint, save_checkpoint

    small = ["--dataset", "synthetic", "--samples", "200", "--features", "8", "--classes", "3", "--hidden", "8",
             "--batch-size", "8", "--epochs", "1", "--no-progress"]
    first = mpirun(2, ringtrain("train", *small, "--run-dir", str(tmp_path / "run"), "--max-steps", "3"), timeout=90)
    assert first.returncode == 0, show(first)
    arrays, meta = read_checkpoint(list_checkpoints(tmp_path / "run" / "checkpoints")[0])
    meta = {k: v for k, v in meta.items() if k not in ("format", "format_version", "sha256")}
    meta["data_position"] = {"epoch": 0, "parts": [[2, 41]]}  # not a whole number of 2 x 8 steps

    def crafted(where):
        save_checkpoint(where / "crafted", meta["step"], arrays, meta)

    assert_refused(tmp_path / "case", ["train", *small, "--run-dir", "{tmp}/again", "--resume",
                                       "{tmp}/crafted/ckpt-00000003.npz"],
                   "damaged metadata (data_position: 41 samples is not a whole number of steps of 2 rank(s) x batch "
                   "size 8); give another --resume PATH, or --resume none",
                   lambda command: mpirun(2, command, timeout=90), crafted)

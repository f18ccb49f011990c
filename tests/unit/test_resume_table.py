"""The pure halves of agreement and resume: verdicts, the resume table, timeline paths, lineage filters."""

import dataclasses
import os

import numpy as np
import pytest

from ringtrain.io.checkpoint import latest_valid_checkpoint, save_checkpoint
from ringtrain.errors import UsageError
from ringtrain.failure import verdict_of
from ringtrain.training.config import (FIELDS, RESUME_RULES, TrainConfig, resume_differences, timeline_problem,
                                       to_json, validate)
from ringtrain.watchdog import WatchedComm


def test_every_setting_has_exactly_one_resume_rule_and_a_reason():
    assert set(RESUME_RULES) == set(FIELDS)
    for name, (rule, why) in RESUME_RULES.items():
        assert rule in ("match", "future", "where") and why, name


def test_resume_differences_refuses_the_first_state_setting_and_lists_the_future_ones():
    saved = to_json(TrainConfig())
    cfg = dataclasses.replace(TrainConfig(), samples=4000, momentum=0.5, epochs=5, lr=0.01, run_dir="elsewhere")
    refused, changed = resume_differences(saved, cfg)
    assert refused[:3] == ("samples", 10000, 4000)
    assert changed == [("epochs", 30, 5), ("lr", 0.1, 0.01)]


def test_resume_differences_compares_tuples_with_json_lists_and_skips_unknown_keys():
    saved = to_json(TrainConfig())
    del saved["seed"]  # a checkpoint from a ringtrain without the setting
    assert resume_differences(saved, dataclasses.replace(TrainConfig(), seed=7)) == (None, [])


def test_verdict_names_the_rank_only_when_the_ranks_differ():
    assert verdict_of([None, None]) is None
    assert verdict_of(["bad", "bad"]) == "bad"
    assert verdict_of([None, "bad"]) == "rank 1: bad"
    assert verdict_of(["first", "second"]) == "rank 0: first"


def test_timeline_problem(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    assert timeline_problem(str(tmp_path / "t.json")) is None
    assert timeline_problem(str(tmp_path / "run" / "t.json")) is None  # the write makes the run directory
    (tmp_path / "afile").write_text("")
    assert "is not a directory" in timeline_problem(str(tmp_path / "afile" / "sub" / "t.json"))
    assert "is a directory" in timeline_problem(str(tmp_path))
    assert "is a FIFO" in timeline_problem(str(tmp_path / "fifo"))


def test_paths_only_rank_0_touches_are_checked_only_with_root():
    cfg = dataclasses.replace(TrainConfig(), resume="/no/such/ckpt.npz", timeline="/no/such/dir/t.json")
    validate(cfg, root=False)
    with pytest.raises(UsageError, match="--resume: no checkpoint at"):
        validate(cfg)


def test_latest_valid_checkpoint_takes_only_what_accept_accepts(tmp_path):
    arrays = {"params/w": np.zeros(3, np.float32)}
    save_checkpoint(tmp_path, 10, arrays, {"lineage": "new"})
    save_checkpoint(tmp_path, 80, arrays, {"lineage": "old"})
    path, _, meta = latest_valid_checkpoint(tmp_path, accept=lambda m: m.get("lineage") == "new")
    assert meta["step"] == 10 and path.endswith("ckpt-00000010.npz")
    assert latest_valid_checkpoint(tmp_path, accept=lambda m: False) is None
    assert latest_valid_checkpoint(tmp_path)[2]["step"] == 80


class _Dog:
    def __init__(self):
        self.armed = []

    def watch(self, what, step=None, waiting_on=None):
        dog = self

        class Armed:
            def __enter__(self):
                dog.armed.append(what)

            def __exit__(self, *exc):
                dog.armed.append(None)

        return Armed()


class _Comm:
    def Get_rank(self):
        return 0

    def allgather(self, value):
        return [value]


def test_watched_comm_arms_the_watchdog_around_collectives_only():
    dog = _Dog()
    comm = WatchedComm(_Comm(), dog, "start-up: data loading")
    assert comm.Get_rank() == 0 and dog.armed == []
    assert comm.allgather(5) == [5]
    assert dog.armed == ["start-up: data loading (allgather)", None]

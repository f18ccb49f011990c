"""The run directory's files (ringtrain.io.rundir): never written through a symbolic link, without MPI."""

import json
import os

import numpy as np
import pytest

from ringtrain.io.checkpoint import read_checkpoint, save_checkpoint
from ringtrain.io.rundir import MetricsFile, RunDirLock, create_new, write_json_atomic
from ringtrain.io.safeio import printable
from ringtrain.training.timeline import Timeline


@pytest.fixture
def victim(tmp_path):
    path = tmp_path / "victim"
    path.write_text("precious\n")
    return path


def test_create_new_never_opens_through_a_link(tmp_path, victim):
    os.symlink(victim, tmp_path / "link")
    with pytest.raises(FileExistsError):
        create_new(tmp_path / "link")
    assert victim.read_text() == "precious\n"


def test_json_written_atomically_replaces_a_link_and_a_planted_temporary(tmp_path, victim):
    os.symlink(victim, tmp_path / "config.json")
    os.symlink(victim, tmp_path / f"config.json.tmp-{os.getpid()}")
    write_json_atomic(str(tmp_path / "config.json"), {"epochs": 1})
    assert victim.read_text() == "precious\n"
    assert not os.path.islink(tmp_path / "config.json") and json.loads((tmp_path / "config.json").read_text())


def test_a_checkpoint_save_replaces_links_at_its_name_and_its_temporary(tmp_path, victim):
    os.symlink(victim, tmp_path / "ckpt-00000001.npz")
    os.symlink(victim, tmp_path / f".ckpt-00000001.npz.tmp-{os.getpid()}")
    path = save_checkpoint(tmp_path, 1, {"params/w": np.ones(3, np.float32)}, {})
    assert victim.read_text() == "precious\n" and not os.path.islink(path)
    assert read_checkpoint(path)[1]["step"] == 1


def test_metrics_through_a_link_are_refused_once(tmp_path, victim):
    os.symlink(victim, tmp_path / "metrics.jsonl")
    warned = []
    metrics = MetricsFile(str(tmp_path / "metrics.jsonl"), warned.append)
    metrics.open()
    metrics.append({"event": "train"})
    metrics.append({"event": "train"})
    assert victim.read_text() == "precious\n" and metrics.lost == 2
    assert len(warned) == 1 and "is a symbolic link, which is never followed" in warned[0]


def test_a_lock_file_that_is_a_link_is_refused(tmp_path, victim):
    os.symlink(victim, tmp_path / ".ringtrain.lock")
    assert "is a symbolic link; remove it" in RunDirLock(str(tmp_path)).claim()
    assert victim.read_text() == "precious\n"


def test_a_timeline_replaces_a_link_and_leaves_no_temporary_when_the_write_fails(tmp_path, victim, monkeypatch):
    os.symlink(victim, tmp_path / "t.json")
    Timeline.write(str(tmp_path / "t.json"), [[]])
    assert victim.read_text() == "precious\n" and json.loads((tmp_path / "t.json").read_text())["traceEvents"]

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(json, "dump", full)
    with pytest.raises(OSError):
        Timeline.write(str(tmp_path / "u.json"), [[]])
    assert sorted(os.listdir(tmp_path)) == ["t.json", "victim"]


@pytest.mark.parametrize("text, shown", [
    ("run-\x1b[2J", "run-\\x1b[2J"), ("bell\x07", "bell\\x07"), ("name\udcff", "name\\udcff"),
    ("two\nlines", "two\\x0alines"), ("\u202eevil", "\\u202eevil"), ("plain é 中", "plain é 中"),
])
def test_printable_escapes_what_would_drive_a_terminal(text, shown):
    assert printable(text) == shown


def test_a_timeline_on_a_full_disk_leaves_no_temporary_file(tmp_path):
    from test_runlog import fill, small_tmpfs

    with small_tmpfs(tmp_path / "disk", size="1m") as disk:
        fill(disk, 4096)
        events = [[{"name": "step", "ph": "X", "pid": 0, "tid": 0, "ts": i, "dur": 1, "args": {}}
                   for i in range(20000)]]
        with pytest.raises(OSError):
            Timeline.write(str(disk / "t.json"), events)
        assert sorted(os.listdir(disk)) == ["filler"]

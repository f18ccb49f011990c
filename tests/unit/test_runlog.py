"""The run directory's owner and guarded writes, without MPI; full disks on a real small tmpfs."""

import contextlib
import errno
import json
import os
import shutil
import subprocess
import time

import numpy as np
import pytest

from ringtrain.training import runlog
from ringtrain.io.checkpoint import CheckpointError, list_checkpoints, read_checkpoint, save_checkpoint
from ringtrain.training.runlog import LOCK_NAME, RunDirInUse, RunLog, default_run_dir


def opened(run_dir, capsys=None):
    log = RunLog(str(run_dir), True)
    assert log.claim() is None
    log.open({"epochs": 1})
    return log


def warnings_of(capsys):
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("ringtrain: warning: ")]


# ---------------------------------------------------------------- ownership


def test_a_second_log_on_a_held_directory_is_refused_and_writes_nothing(tmp_path):
    first = opened(tmp_path / "run")
    first.event("train", step=1)
    before = {p: (tmp_path / "run" / p).read_bytes() for p in ("config.json", "metrics.jsonl", LOCK_NAME)}
    second = RunLog(str(tmp_path / "run"), True)
    problem = second.claim()
    assert problem.startswith(f"--run-dir {tmp_path / 'run'}: in use by another ringtrain job (pid {os.getpid()}")
    with pytest.raises(RunDirInUse):  # the race claim() cannot see: both started before either locked
        second.open({"epochs": 2})
    assert {p: (tmp_path / "run" / p).read_bytes() for p in before} == before
    first.close()
    assert second.claim() is None  # the lock goes with its holder


def test_claim_creates_nothing_in_a_new_directory(tmp_path):
    assert RunLog(str(tmp_path / "new"), True).claim() is None
    assert not (tmp_path / "new").exists()
    assert RunLog(str(tmp_path / "x"), False).claim() is None  # only the master looks


def test_a_lock_file_that_is_a_fifo_is_refused(tmp_path):
    (tmp_path / "run").mkdir()
    os.mkfifo(tmp_path / "run" / LOCK_NAME)
    assert "is a FIFO, not a regular file" in RunLog(str(tmp_path / "run"), True).claim()


def test_default_run_dirs_in_the_same_second_differ(tmp_path):
    now = time.time()
    names = [default_run_dir(now, root=str(tmp_path / "runs")) for _ in range(3)]
    assert len(set(names)) == 3 and all(os.path.isdir(n) for n in names)
    assert names[1] == names[0] + "-2"


# ---------------------------------------------------------------- guarded writes


def test_each_metrics_line_is_one_write(tmp_path, monkeypatch):
    log = opened(tmp_path / "run")
    writes = []
    real = os.write
    monkeypatch.setattr(os, "write", lambda fd, data: writes.append(data) or real(fd, data))
    log.event("train", step=1, loss=0.5)
    log.close()
    assert len(writes) == 1 and writes[0].endswith(b"\n") and json.loads(writes[0])["loss"] == 0.5


def test_a_failing_metrics_write_warns_once_keeps_lines_whole_and_recovers(tmp_path, monkeypatch, capsys):
    log = opened(tmp_path / "run")
    log.event("train", step=1)
    real = os.write

    def half_then_enospc(fd, data):
        real(fd, data[: len(data) // 2])  # part of the line reaches the file
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as mp:
        mp.setattr(os, "write", half_then_enospc)
        for step in range(2, 6):
            log.event("train", step=step)
    log.event("train", step=6)
    log.close()
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 6]
    warned = warnings_of(capsys)
    assert len(warned) == 2, warned
    assert "metrics.jsonl: cannot write (no space left on device)" in warned[0] and "training goes on" in warned[0]
    assert "writing again; 4 record(s) before this one were lost" in warned[1]


@pytest.mark.parametrize("code", [errno.EACCES, errno.EPERM, errno.ENOSPC])
def test_config_write_failure_is_a_warning(tmp_path, monkeypatch, capsys, code):
    def fail(path, obj):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(runlog, "write_json_atomic", fail)
    log = opened(tmp_path / "run")
    log.event("train", step=1)
    log.close()
    warned = warnings_of(capsys)
    assert len(warned) == 1 and "config.json: not written" in warned[0], warned
    assert (tmp_path / "run" / "metrics.jsonl").read_text().count("\n") == 1


def test_a_torn_last_line_is_cut_before_appending(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"event": "train", "step": 1}\n{"event": "tra')
    log = opened(run)
    log.event("train", step=2)
    log.close()
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert "removed a torn last line (14 bytes)" in warnings_of(capsys)[0]


def test_a_deleted_run_directory_is_said_and_recreated(tmp_path, capsys):
    run = tmp_path / "run"
    log = opened(run)
    log.event("train", step=1)
    shutil.rmtree(run)
    log.event("train", step=2)
    log.event("train", step=3)
    log.close()
    warned = warnings_of(capsys)
    assert len(warned) == 1 and "was deleted while this job ran" in warned[0], warned
    assert "config.json, metrics.jsonl and earlier checkpoints are lost" in warned[0]
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [2, 3]
    assert (run / "config.json").exists() and (run / LOCK_NAME).exists()


# ---------------------------------------------------------------- a real full disk


@contextlib.contextmanager
def small_tmpfs(path, size="2m"):
    """A tmpfs of ``size`` mounted at ``path``; skip (saying why) where it cannot be mounted."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    path.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {result.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def fill(directory, leave):
    """Fill the file system of ``directory`` until about ``leave`` bytes are free."""
    st = os.statvfs(directory)
    free = st.f_bavail * st.f_frsize
    with open(os.path.join(directory, "filler"), "wb") as fh:
        fh.write(b"\0" * max(0, free - leave))


def test_full_disk_with_keep_checkpoints_prunes_first_and_saves(tmp_path):
    with small_tmpfs(tmp_path / "disk") as disk:
        ckdir = disk / "checkpoints"
        arrays = {"params/w": np.zeros(150_000, np.float32)}  # about 600 KB a checkpoint
        for step in (1, 2, 3):
            save_checkpoint(ckdir, step, arrays, {"epoch": step}, keep=3)
        assert len(list_checkpoints(ckdir)) == 3  # 1.8 MB of 2: the next cannot fit beside them
        path = save_checkpoint(ckdir, 4, arrays, {"epoch": 4}, keep=3)
        assert [os.path.basename(p) for p in list_checkpoints(ckdir)] == [
            "ckpt-00000004.npz", "ckpt-00000003.npz", "ckpt-00000002.npz"]
        assert read_checkpoint(path)[1]["epoch"] == 4


def test_full_disk_that_pruning_cannot_help_keeps_every_checkpoint(tmp_path):
    with small_tmpfs(tmp_path / "disk") as disk:
        ckdir = disk / "checkpoints"
        small = {"params/w": np.zeros(1000, np.float32)}
        for step in (1, 2):
            save_checkpoint(ckdir, step, small, {}, keep=2)
        with pytest.raises(CheckpointError, match="No space left on device.*earlier checkpoints are untouched"):
            save_checkpoint(ckdir, 3, {"params/w": np.zeros(1_000_000, np.float32)}, {}, keep=2)
        assert len(list_checkpoints(ckdir)) == 2 and not [n for n in os.listdir(ckdir) if ".tmp-" in n]


def test_full_disk_metrics_warn_once_and_every_line_is_whole(tmp_path, capsys):
    with small_tmpfs(tmp_path / "disk", size="1m") as disk:
        log = opened(disk / "run")
        fill(disk, 4096)
        for step in range(200):
            log.event("train", step=step, loss=0.25, note="x" * 100)
        log.close()
        lines = (disk / "run" / "metrics.jsonl").read_text().splitlines()
        assert 0 < len(lines) < 200 and [json.loads(line)["step"] for line in lines] == list(range(len(lines)))
        warned = warnings_of(capsys)
        assert sum("cannot write (no space left on device)" in w for w in warned) == 1, warned

"""Faults in real multi-rank jobs: every job ends quickly and loudly, and no checkpoint is lost.

The faults are injected by tests/cli/programs/faulty_train.py, which runs the
library's trainer under ``abort_on_error`` exactly as the CLI does, with a
model wrapper that misbehaves at one step on one rank (no test hooks in
ringtrain itself). Every job runs under a time bound.
"""

import json
import os
import re
import shutil
import struct
import sys
import time
import zipfile

import numpy as np
import pytest

import ringtrain
from mpirun import ROOT, mpirun, ringtrain as rt, run, show
from ringtrain.io.checkpoint import list_checkpoints, read_checkpoint
from ringtrain.cluster.launch import find_mpirun

PROGRAMS = os.path.join(ROOT, "tests", "cli", "programs")
FAULTY = os.path.join(PROGRAMS, "faulty_train.py")
# 320 training rows: 20 steps per epoch at 2 ranks, 14 at 3; about a second of training.
SMALL = ["--dataset", "synthetic", "--samples", "400", "--features", "8", "--classes", "3", "--hidden", "8",
         "--batch-size", "8", "--epochs", "3", "--no-progress"]


def faulty(fault, rank, step, *flags):
    return [sys.executable, FAULTY, fault, str(rank), str(step), *SMALL, *flags]


def timed(function, *args, **kwargs):
    start = time.monotonic()
    result = function(*args, **kwargs)
    return result, time.monotonic() - start


def events(run_dir, kind):
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return [e for e in map(json.loads, fh) if e["event"] == kind]


def final_params(run_dir):
    params, meta = ringtrain.load_checkpoint(str(run_dir))
    assert meta["final"], meta
    return params


def assert_bitwise_equal(a, b):
    assert list(a) == list(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and np.array_equal(a[name], b[name]), name


def digests(result):
    return re.findall(r"^rank (\d+) digest ([0-9a-f]{64})$", result.stdout, re.M)


# --- a rank dies --------------------------------------------------------------

def test_killed_rank_ends_the_job_and_resume_matches_an_uninterrupted_run(tmp_path):
    flags = ["--checkpoint-every", "5", "--keep", "3"]
    straight = mpirun(2, rt("train", *SMALL, *flags, "--run-dir", str(tmp_path / "straight")), timeout=60)
    assert straight.returncode == 0, show(straight)

    run_dir = tmp_path / "run"
    killed, elapsed = timed(mpirun, 2, faulty("kill", 1, 23, *flags, "--run-dir", str(run_dir)), timeout=60)
    assert killed.returncode != 0, show(killed)
    assert elapsed < 30, f"the job took {elapsed:.1f}s to end after rank 1 died"
    # Only whole checkpoints: each verifies, and the newest is the last one
    # started before the kill (step 20; rank 1 died in step 23).
    names = sorted(os.listdir(run_dir / "checkpoints"))
    assert names == ["ckpt-00000010.npz", "ckpt-00000015.npz", "ckpt-00000020.npz"], names
    for path in list_checkpoints(run_dir / "checkpoints"):
        read_checkpoint(path)

    resumed = mpirun(2, rt("train", *SMALL, *flags, "--run-dir", str(run_dir), "--resume", "auto"), timeout=60)
    assert resumed.returncode == 0, show(resumed)
    assert "resumed from " in resumed.stdout and "ckpt-00000020.npz at step 20" in resumed.stdout, show(resumed)
    assert_bitwise_equal(final_params(run_dir), final_params(tmp_path / "straight"))


# --- a rank stalls ------------------------------------------------------------

def test_stalled_rank_is_named_by_the_watchdog_and_the_job_ends(tmp_path):
    # Rank 1 sleeps 120 s in step 7; ranks 0 and 2 wait in the gradient
    # reduce-scatter (the sharded step's first phase). Each names its left
    # neighbour: rank 2 names rank 1, rank 0 names rank 2.
    result, elapsed = timed(mpirun, 3, faulty("sleep", 1, 7, "--timeout", "3",
                                              "--run-dir", str(tmp_path / "run")), timeout=60)
    assert result.returncode != 0, show(result)
    assert elapsed < 20, f"the job took {elapsed:.1f}s to end with --timeout 3"
    lines = [line for line in result.stderr.splitlines() if "did not finish within" in line]
    assert ("rank 2: gradient reduce-scatter at step 7 did not finish within 3s; waiting on rank 1 "
            "(raise --timeout if this is expected)") in lines, show(result)
    # The sleeper itself is not waiting on anyone: it prints no such line.
    assert not any(line.startswith("rank 1:") for line in lines), show(result)


# --- a rank raises ------------------------------------------------------------

def test_raising_rank_ends_every_rank_within_seconds_and_is_named(tmp_path):
    result, elapsed = timed(mpirun, 3, faulty("raise", 1, 7, "--run-dir", str(tmp_path / "run")), timeout=60)
    assert result.returncode != 0, show(result)
    assert elapsed < 15, f"the job took {elapsed:.1f}s to end"
    assert "rank 1: RuntimeError: injected fault at step 7" in result.stderr, show(result)


# --- ranks disagree -----------------------------------------------------------

def mpmd(first, second):
    """Two ranks, each with its own command line (mpirun's ':' syntax)."""
    return [find_mpirun(), "-np", "1", *first, ":", "-np", "1", *second]


@pytest.mark.parametrize("flag, ours, theirs, message", [
    ("--hidden", "8", "16", "ranks disagree on --hidden: rank 0 has (8,), rank 1 has (16,)"),
    ("--samples", "400", "500", "ranks disagree on --samples: rank 0 has 400, rank 1 has 500"),
])
def test_ranks_given_different_settings_all_fail_with_one_line(tmp_path, flag, ours, theirs, message):
    # (--batch-size is tested the same way in test_train.py.)
    run_dir = str(tmp_path / "run")
    base = [*SMALL, "--run-dir", run_dir]
    result = run(mpmd(rt("train", *base, flag, ours), rt("train", *base, flag, theirs)), timeout=60)
    assert result.returncode == 2, show(result)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], show(result)
    assert not os.path.exists(run_dir)


def test_ranks_reading_different_data_under_one_name_fail_cleanly(tmp_path):
    # A data directory that is not shared between hosts: the same relative
    # path names files of different sizes (simulated with per-rank -wdir).
    for sub, rows in (("a", 100), ("b", 140)):
        os.makedirs(tmp_path / sub)
        rng = np.random.default_rng(rows)
        np.savez(tmp_path / sub / "data.npz", x=rng.normal(size=(rows, 3)).astype(np.float32), y=np.arange(rows) % 2)
    run_dir = str(tmp_path / "run")
    command = rt("train", "--dataset", "data.npz", "--hidden", "4", "--epochs", "1", "--run-dir", run_dir)
    mpi = find_mpirun()
    args = [mpi, "-np", "1", "-wdir", str(tmp_path / "a"), *command, ":",
            "-np", "1", "-wdir", str(tmp_path / "b"), *command]
    result = run(args, timeout=60)
    assert result.returncode == 2, show(result)
    assert ("ranks disagree on dataset 'data.npz': rank 0 has 80 training rows, rank 1 has 112; "
            "every rank must read the same data") in result.stderr, show(result)
    assert not os.path.exists(run_dir)


@pytest.mark.parametrize("what, message", [
    ("length", "allreduce: ranks passed different lengths: 1000 elements and 1001 elements"),
    ("dtype", "allreduce: ranks passed different dtypes: float32 and float64"),
])
def test_mismatched_allreduce_is_an_error_on_every_rank(what, message):
    result = mpirun(3, [sys.executable, os.path.join(PROGRAMS, "mismatched_allreduce.py"), what], timeout=60)
    assert result.returncode == 2, show(result)
    for rank in range(3):
        assert re.search(rf"rank {rank}: error: {re.escape(message)}", result.stderr), show(result)
    assert "Traceback" not in result.stderr


# --- non-finite gradients -----------------------------------------------------

def test_nan_on_one_rank_is_skipped_by_every_rank(tmp_path):
    run_dir = tmp_path / "run"
    result = mpirun(2, faulty("nan", 1, 7, "--run-dir", str(run_dir)), timeout=60)
    assert result.returncode == 0, show(result)
    # The decision is taken on the reduced gradients, so both ranks skipped
    # step 7 and still hold bitwise the same (finite) parameters.
    found = digests(result)
    assert len(found) == 2 and found[0][1] == found[1][1], show(result)
    assert [(e["step"], e["streak"]) for e in events(run_dir, "nonfinite")] == [(7, 1)]
    assert result.stderr.count("step 7: non-finite gradients, step skipped (1 in a row)") == 1, show(result)
    assert all(np.isfinite(p).all() for p in final_params(run_dir).values())


def assert_diverged(result, step, why):
    """Divergence: exit 4, one line from rank 0 with the step and the advice, no traceback, no NumPy warnings."""
    assert result.returncode == 4, show(result)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"ringtrain: error: training diverged at step {step} ({why})"), \
        show(result)
    assert "Traceback" not in result.stderr and "RuntimeWarning" not in result.stderr, show(result)
    return lines[0]


def test_nonfinite_steps_end_the_run_after_max_nonfinite_in_a_row(tmp_path):
    result, elapsed = timed(mpirun, 2, faulty("nan-from", 0, 7, "--max-nonfinite", "3",
                                              "--run-dir", str(tmp_path / "run")), timeout=60)
    assert elapsed < 20, show(result)
    line = assert_diverged(result, 9, "non-finite gradients, 3 steps in a row")
    assert "no checkpoint of this run is good; start again with a lower learning rate" in line, line
    assert [e["step"] for e in events(tmp_path / "run", "nonfinite")] == [7, 8]
    assert [e["step"] for e in events(tmp_path / "run", "diverged")] == [9]


def test_nonfinite_abort_stops_at_the_first(tmp_path):
    result = mpirun(2, faulty("nan", 1, 7, "--nonfinite", "abort", "--run-dir", str(tmp_path / "run")), timeout=60)
    assert_diverged(result, 7, "non-finite gradients")


@pytest.mark.parametrize("ranks", [2, 3])
def test_a_diverging_run_keeps_its_last_good_checkpoint_and_says_how_to_resume(tmp_path, ranks):
    # 14 or 20 steps an epoch: the gradients go non-finite from step 30 on,
    # in the middle of the third epoch, with a checkpoint every 4 steps and
    # --keep 1: the checkpoints during the streak must not be written, nor
    # may they prune the last good one.
    run_dir = tmp_path / "run"
    flags = ["--checkpoint-every", "4", "--keep", "1", "--max-nonfinite", "6", "--epochs", "4",
             "--run-dir", str(run_dir)]
    result = mpirun(ranks, faulty("nan-from", ranks - 1, 30, *flags), timeout=60)
    line = assert_diverged(result, 35, "non-finite gradients, 6 steps in a row")
    good = list_checkpoints(run_dir / "checkpoints")
    assert len(good) == 1, good
    arrays, meta = read_checkpoint(good[0])
    assert meta["step"] == 28 and meta["nonfinite_streak"] == 0, meta
    assert all(np.isfinite(a).all() for a in arrays.values() if a.dtype.kind == "f")
    assert f"the last good checkpoint is {good[0]}" in line, line
    assert f"--resume {good[0]} --lr 0.01" in line and f"--config {run_dir}/config.json" in line, line
    assert [e["step"] for e in events(run_dir, "checkpoint_skipped")] == [32]
    # The advice works: that command, a tenth of the learning rate, no fault, trains to the end.
    resumed = mpirun(ranks, rt("train", "--config", str(run_dir / "config.json"), "--resume", good[0],
                               "--lr", "0.01"), timeout=60)
    assert resumed.returncode == 0, show(resumed)
    assert f"resumed from {good[0]} at step {meta['step']}" in resumed.stdout, show(resumed)


# --- damaged checkpoints ------------------------------------------------------

def test_resume_falls_back_past_damaged_checkpoints_and_a_stale_temporary(tmp_path):
    flags = ["--checkpoint-every", "2", "--keep", "5"]
    straight = mpirun(2, rt("train", *SMALL, *flags, "--run-dir", str(tmp_path / "straight")), timeout=60)
    assert straight.returncode == 0, show(straight)
    run_dir = tmp_path / "run"
    stopped = mpirun(2, rt("train", *SMALL, *flags, "--max-steps", "10", "--run-dir", str(run_dir)), timeout=60)
    assert stopped.returncode == 0, show(stopped)
    ckpts = run_dir / "checkpoints"
    assert sorted(os.listdir(ckpts)) == [f"ckpt-{s:08d}.npz" for s in (2, 4, 6, 8, 10)]

    def damage(step, how):
        path = ckpts / f"ckpt-{step:08d}.npz"
        data = bytearray(path.read_bytes())
        if how == "truncate":
            data = data[:-100]
        elif how == "flip":  # one bit in the middle of the last parameter's bytes (not in a zip header)
            data[_middle_of_member(path, "params/")] ^= 0x40
        else:  # half-written: what a non-atomic writer leaves when it dies
            data = data[:len(data) // 2]
        path.write_bytes(bytes(data))

    damage(10, "truncate")
    damage(8, "flip")
    damage(6, "half")
    shutil.copy(ckpts / "ckpt-00000004.npz", ckpts / ".ckpt-00000012.npz.tmp-999999999")  # a dead writer's pid

    resumed = mpirun(2, rt("train", *SMALL, *flags, "--run-dir", str(run_dir), "--resume", "auto"), timeout=60)
    assert resumed.returncode == 0, show(resumed)
    warnings = [line for line in resumed.stderr.splitlines() if line.startswith("ringtrain: warning: ")]
    assert any(".ckpt-00000012.npz.tmp-999999999: a temporary file left by an interrupted save" in w
               for w in warnings), show(resumed)
    for step in (10, 8, 6):
        assert any(f"skipping damaged checkpoint {ckpts}/ckpt-{step:08d}.npz" in w for w in warnings), show(resumed)
    assert f"resumed from {ckpts}/ckpt-00000004.npz at step 4" in resumed.stdout, show(resumed)
    assert_bitwise_equal(final_params(run_dir), final_params(tmp_path / "straight"))


def _middle_of_member(path, prefix):
    """The offset of the middle byte of the last ``prefix`` member's stored data in the zip at ``path``."""
    with zipfile.ZipFile(path) as z:
        info = [i for i in z.infolist() if i.filename.startswith(prefix)][-1]
    with open(path, "rb") as fh:
        fh.seek(info.header_offset + 26)
        name_len, extra_len = struct.unpack("<HH", fh.read(4))
    return info.header_offset + 30 + name_len + extra_len + info.compress_size // 2


def test_failed_save_keeps_earlier_checkpoints_is_reported_and_training_goes_on(tmp_path):
    run_dir = tmp_path / "run"
    # The third save (step 15) on rank 0 hits a full disk after writing a few bytes.
    result = mpirun(2, faulty("enospc", 0, 2, "--checkpoint-every", "5", "--keep", "100",
                              "--run-dir", str(run_dir)), timeout=60)
    assert result.returncode == 0, show(result)
    assert re.search(r"^ringtrain: warning: checkpoint at step 15 not written: could not write checkpoint "
                     r".*ckpt-00000015\.npz: No space left on device", result.stderr, re.M), show(result)
    failed = events(run_dir, "checkpoint_failed")
    assert [e["step"] for e in failed] == [15] and "No space left on device" in failed[0]["error"]
    names = sorted(os.listdir(run_dir / "checkpoints"))
    steps = [int(n[5:13]) for n in names]
    assert steps == [s for s in range(5, 61, 5) if s != 15], names  # no temporary left behind
    for path in list_checkpoints(run_dir / "checkpoints"):
        read_checkpoint(path)
    assert events(run_dir, "done")[0]["step"] == 60


# --- replicas that diverge ----------------------------------------------------

def test_replicas_that_diverge_are_caught_by_the_digest_check(tmp_path):
    # Rank 1 nudges a weight at step 3; the digest allgathered at the next
    # checkpoint (step 5) differs, and the job ends with a message saying so.
    # Unsharded: the sharded step allgathers every parameter from its owner
    # each step, so a nudged replica is overwritten (or, in its own shard,
    # handed to everyone) and replicas cannot drift apart.
    run_dir = tmp_path / "run"
    result, elapsed = timed(mpirun, 2, faulty("diverge", 1, 3, "--checkpoint-every", "5", "--no-shard-optimizer",
                                              "--run-dir", str(run_dir)), timeout=60)
    assert result.returncode != 0 and elapsed < 30, show(result)
    assert "parameters differ across ranks at step 5" in result.stderr, show(result)
    # The diverged state never reached disk as a checkpoint.
    assert not os.path.exists(run_dir / "checkpoints" / "ckpt-00000005.npz")

"""Nothing lost: a broken output, a failed final save after a resume, a finished run resumed.

Real jobs under real ``mpirun`` at 2 and 3 ranks, each under a time bound.
"""

import os
import subprocess
import sys

import numpy as np
import pytest

from mpirun import ROOT, mpirun, ringtrain as rt, run, show
from mpirun import test_env as job_env
from ringtrain.cluster.launch import mpirun_command
from ringtrain.errors import UsageError
from ringtrain.io.checkpoint import list_checkpoints, read_checkpoint

PROGRAMS = os.path.join(ROOT, "tests", "cli", "programs")
FAULTY = os.path.join(PROGRAMS, "faulty_train.py")
SMALL = ["--dataset", "synthetic", "--samples", "400", "--features", "8", "--classes", "3", "--hidden", "8",
         "--batch-size", "8", "--epochs", "3", "--no-progress"]


def shell(command, timeout=90):
    """Run a shell pipeline in its own session under a time bound (``run`` kills the group on timeout)."""
    return run(["bash", "-c", command], timeout=timeout)


# --- a closed or full standard output ----------------------------------------

@pytest.mark.parametrize("ranks", [1, 2, 3])
@pytest.mark.parametrize("output", ["| head -1", ">/dev/full"])
def test_a_closed_or_full_stdout_warns_once_and_training_goes_on(tmp_path, ranks, output):
    run_dir = tmp_path / "run"
    args = rt("train", *SMALL, "--run-dir", str(run_dir))
    command = args if ranks == 1 else mpirun_command(ranks, args)
    quoted = " ".join(subprocess.list2cmdline([a]) for a in command)
    # `head -1` exits after the first line; `status` is the training job's own.
    result = shell(f"{quoted} 2>{tmp_path}/err {output}; echo status=${{PIPESTATUS[0]}} >&2")
    err = (tmp_path / "err").read_text()
    assert "status=0" in result.stderr, show(result) + err
    warned = [line for line in err.splitlines() if "standard output cannot be written" in line]
    assert len(warned) == 1, err
    assert "Traceback" not in err and "Exception ignored" not in err, err
    steps = [read_checkpoint(p)[1]["step"] for p in list_checkpoints(run_dir / "checkpoints")]
    per_epoch = {1: 40, 2: 20, 3: 14}[ranks]  # 320 training rows, 8 a batch, shards padded to equal length
    assert max(steps) == 3 * per_epoch, steps  # trained to the end, final checkpoint written


# --- the newest checkpoint, as far as the run knows ----------------------------

def test_a_resumed_run_whose_final_save_fails_names_the_checkpoint_it_resumed_from(tmp_path):
    run_dir = tmp_path / "run"
    first = mpirun(2, rt("train", *SMALL, "--run-dir", str(run_dir)), timeout=60)
    assert first.returncode == 0, show(first)
    resumed_from = list_checkpoints(run_dir / "checkpoints")[0]
    # One more epoch, whose only save (the final one, the 0th of this run) fails.
    result = mpirun(2, [sys.executable, FAULTY, "enospc", "0", "0", *SMALL, "--epochs", "4",
                        "--run-dir", str(run_dir)], timeout=60)
    assert result.returncode == 3, show(result)
    assert f"resumed from {resumed_from}" in result.stdout, show(result)
    # Before the fix the run forgot it and said there was no checkpoint of it on disk.
    assert f"rank 0 newest {resumed_from}" in result.stdout, show(result)


def test_the_cli_names_the_checkpoint_a_resumed_run_started_from_when_the_final_save_fails(tmp_path):
    run_dir = tmp_path / "run"
    assert mpirun(2, rt("train", *SMALL, "--run-dir", str(run_dir)), timeout=60).returncode == 0
    resumed_from = list_checkpoints(run_dir / "checkpoints")[0]
    # A directory where the final checkpoint must go: the rename onto it fails, as a full disk would.
    os.mkdir(run_dir / "checkpoints" / "ckpt-00000080.npz")
    (run_dir / "checkpoints" / "ckpt-00000080.npz" / "x").write_text("x")
    result = mpirun(2, rt("train", *SMALL, "--epochs", "4", "--run-dir", str(run_dir)), timeout=60)
    assert result.returncode == 3, show(result)
    assert f"the newest checkpoint on disk is {resumed_from}" in result.stderr, show(result)


# --- a finished run, resumed ---------------------------------------------------

@pytest.mark.parametrize("ranks", [2, 3])
def test_max_steps_already_reached_trains_nothing(tmp_path, ranks):
    run_dir = tmp_path / "run"
    flags = [*SMALL, "--max-steps", "10", "--run-dir", str(run_dir)]
    first = mpirun(ranks, rt("train", *flags), timeout=60)
    assert first.returncode == 0, show(first)
    again = mpirun(ranks, rt("train", *flags), timeout=60)
    assert again.returncode == 0, show(again)
    assert "stopped at --max-steps: step 10, in epoch 1 (step 10 of " in again.stdout, show(again)
    assert [read_checkpoint(p)[1]["step"] for p in list_checkpoints(run_dir / "checkpoints")] == [10]


# --- a stopped run without --run-dir ----------------------------------------------

def test_without_run_dir_the_settings_come_back_with_resume_run_dir(tmp_path):
    first = run(rt("train", *SMALL, "--epochs", "2", "--max-steps", "50"), cwd=str(tmp_path), timeout=60)
    assert first.returncode == 0, show(first)
    (run_dir,) = [os.path.join(tmp_path, "runs", d) for d in os.listdir(tmp_path / "runs")]
    # Nothing retyped: --resume RUN_DIR takes the dataset, model and every other setting from config.json.
    again = run(rt("train", "--resume", run_dir, "--max-steps", "100"), cwd=str(tmp_path), timeout=60)
    assert again.returncode == 0, show(again)
    assert "resumed from" in again.stdout and "at step 50" in again.stdout, show(again)
    assert "320 training samples" in again.stdout and "settings changed" in again.stdout, show(again)
    assert "finished: step 80, 2 epochs done" in again.stdout, show(again)  # --epochs 2 came back too
    assert os.listdir(tmp_path / "runs") == [os.path.basename(run_dir)]


def test_stopped_without_run_dir_prints_the_exact_resume_command(tmp_path):
    env = job_env()
    proc = subprocess.Popen(rt("train", *SMALL, "--epochs", "1000", "--samples", "4000"), cwd=str(tmp_path),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        proc.stdout.readline()  # the first line: training has started
        proc.send_signal(subprocess.signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err
    (run_dir,) = [os.path.join("runs", d) for d in os.listdir(tmp_path / "runs")]
    assert err.strip().endswith(f"to resume: ringtrain train --resume {run_dir}"), err


# --- a data file rewritten under a running job ---------------------------------------------

@pytest.mark.parametrize("ranks", [2, 3])
def test_a_data_file_cut_short_under_a_running_job_does_not_end_it(tmp_path, ranks):
    rng = np.random.default_rng(0)
    data = tmp_path / "data"
    data.mkdir()
    np.save(data / "x.npy", rng.normal(size=(6000, 8)).astype(np.float32))
    np.save(data / "y.npy", rng.integers(0, 3, size=6000))
    # With its own test split each rank's training rows are one slice of x.npy: a view of the map, unless copied.
    np.save(data / "x_test.npy", rng.normal(size=(100, 8)).astype(np.float32))
    np.save(data / "y_test.npy", rng.integers(0, 3, size=100))
    args = rt("train", "--dataset", str(data), "--hidden", "8", "--batch-size", "8", "--epochs", "100000",
              "--max-time", "6", "--no-progress", "--run-dir", str(tmp_path / "run"))
    proc = subprocess.Popen(mpirun_command(ranks, args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=job_env(), start_new_session=True)
    try:
        first = proc.stdout.readline()  # training has started, its rows read from the map
        with open(data / "x.npy", "r+b") as fh:
            fh.truncate(128)  # what a writer that rewrites the file in place does first
        out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
    # Before: SIGBUS on the first page of x past the cut, no message, no checkpoint.
    assert proc.returncode == 0, first + out + err
    assert "stopped at --max-time: step" in out, first + out + err


def test_a_data_file_rewritten_while_it_is_read_is_named(tmp_path):
    from ringtrain.data.sources import open_source, read_rows

    np.save(tmp_path / "x.npy", np.ones((100, 4), np.float32))
    np.save(tmp_path / "y.npy", np.arange(100) % 2)
    source = open_source(str(tmp_path), seed=0, test_fraction=0.2, num_classes=None, samples=0, features=0,
                         classes=0, separation=1.0)
    read_rows(source, source.train, (0, 40))
    np.save(tmp_path / "x.npy", np.zeros((10, 4), np.float32))  # between one rank's reads
    with pytest.raises(UsageError, match=rf"^{tmp_path}/x.npy: changed while this job was reading it"):
        read_rows(source, source.train, (40, 80))


def test_a_run_directorys_settings_work_from_another_directory(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = run(rt("train", *SMALL, "--max-steps", "30", "--run-dir", "runs/x"), cwd=str(tmp_path / "a"), timeout=60)
    assert first.returncode == 0, show(first)
    run_dir = tmp_path / "a" / "runs" / "x"
    # The recorded run_dir is relative to a/; from b/ it still means the run's own directory.
    again = run(rt("train", "--resume", str(run_dir), "--max-steps", "40"), cwd=str(tmp_path / "b"), timeout=60)
    assert again.returncode == 0, show(again)
    assert "at step 30" in again.stdout and "stopped at --max-steps: step 40, " in again.stdout, show(again)
    assert not (tmp_path / "b" / "runs").exists()
    assert 40 in [read_checkpoint(p)[1]["step"] for p in list_checkpoints(run_dir / "checkpoints")]


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_a_full_stderr_with_progress_lines_does_not_end_training(tmp_path, ranks):
    run_dir = tmp_path / "run"
    args = rt("train", *SMALL, "--samples", "4000", "--progress", "--progress-every", "0.2", "--run-dir", str(run_dir))
    command = args if ranks == 1 else mpirun_command(ranks, args)
    quoted = " ".join(subprocess.list2cmdline([a]) for a in command)
    result = shell(f"{quoted} >/dev/null 2>/dev/full; echo status=$? >&2")
    # Before: the first progress line raised OSError (ENOSPC) at one rank, and under mpirun
    # mpiexec itself died of the write error: no checkpoint either way.
    assert "status=0" in result.stderr, show(result)
    assert len(list_checkpoints(run_dir / "checkpoints")) == 3

"""Ranks that see different things still end together: one verdict, one line, every rank out.

Each case is a real MPMD job under real ``mpirun`` (``mpirun -np 1 A : -np 1
B``), where the two ranks get different flags or, through MPICH's per-section
``-wdir``, different working directories, so a relative file exists for one
rank only. Every job runs under a time bound; assertions come after it ends.
"""

import os
import sys
import time

from mpirun import ROOT, mpirun, ringtrain, run, show
from ringtrain.cluster.launch import find_mpirun

FAULTY = os.path.join(ROOT, "tests", "cli", "programs", "faulty_train.py")
SMALL = ["--dataset", "synthetic", "--samples", "400", "--features", "8", "--classes", "3", "--hidden", "8",
         "--batch-size", "8", "--epochs", "1", "--no-progress"]


def mpmd(first, second, wdirs=(None, None)):
    """Two ranks, each with its own command line and, if given, its own working directory."""
    sections = []
    for command, wdir in zip((first, second), wdirs):
        sections.append(["-np", "1", *(["-wdir", str(wdir)] if wdir else []), *command])
    return [find_mpirun(), *sections[0], ":", *sections[1]]


def one_error(result, needle):
    assert result.returncode == 2, show(result)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ringtrain: error: ") and needle in lines[0], show(result)
    assert "Traceback" not in result.stderr + result.stdout


def timed_run(args, **kwargs):
    start = time.monotonic()
    result = run(args, **kwargs)
    return result, time.monotonic() - start


def test_a_bad_value_on_rank_1_only_ends_every_rank_with_one_line(tmp_path):
    run_dir = tmp_path / "run"
    base = ringtrain("train", *SMALL, "--run-dir", str(run_dir))
    result, elapsed = timed_run(mpmd(base, [*base, "--lr", "-1"]), timeout=60)
    one_error(result, "rank 1: --lr: must be > 0, got -1")
    assert elapsed < 15 and not run_dir.exists()


def test_a_flag_only_rank_1_cannot_parse_ends_every_rank_with_one_line(tmp_path):
    run_dir = tmp_path / "run"
    base = ringtrain("train", *SMALL, "--run-dir", str(run_dir))
    result = run(mpmd(base, [*base, "--bogus"]), timeout=60)
    one_error(result, "rank 1: unrecognized arguments: --bogus")
    assert not run_dir.exists()


def test_help_on_one_rank_only_ends_every_rank(tmp_path):
    base = ringtrain("train", *SMALL, "--run-dir", str(tmp_path / "run"))
    result = run(mpmd(base, ringtrain("train", "--help")), timeout=60)
    assert result.returncode == 2, show(result)
    assert "rank 1: asked for --help instead of a run" in result.stderr, show(result)


def test_a_config_file_only_rank_1_has_is_named_with_the_rank_that_lacks_it(tmp_path):
    for sub in ("a", "b"):
        (tmp_path / sub).mkdir()
    (tmp_path / "b" / "run.toml").write_text("epochs = 1\n")
    run_dir = tmp_path / "run"
    command = ringtrain("train", *SMALL, "--config", "run.toml", "--run-dir", str(run_dir))
    result = run(mpmd(command, command, wdirs=(tmp_path / "a", tmp_path / "b")), timeout=60)
    one_error(result, "rank 0: --config run.toml: no such file")
    assert not run_dir.exists()


def test_resume_from_a_file_only_rank_0_can_see_works(tmp_path):
    first = mpirun(1, ringtrain("train", *SMALL, "--run-dir", str(tmp_path / "first")), timeout=60)
    assert first.returncode == 0, show(first)
    for sub in ("a", "b"):
        (tmp_path / sub).mkdir()
    os.link(tmp_path / "first" / "checkpoints" / "ckpt-00000040.npz", tmp_path / "a" / "start.npz")
    command = ringtrain("train", *SMALL, "--epochs", "2", "--resume", "start.npz", "--run-dir", str(tmp_path / "run"))
    result = run(mpmd(command, command, wdirs=(tmp_path / "a", tmp_path / "b")), timeout=60)
    assert result.returncode == 0, show(result)
    assert "resumed from start.npz at step 40" in result.stdout, show(result)
    assert "finished: step 60, 2 epochs done" in result.stdout, show(result)


def test_resume_from_a_file_only_rank_1_can_see_is_rank_0s_error(tmp_path):
    for sub in ("a", "b"):
        (tmp_path / sub).mkdir()
    (tmp_path / "b" / "start.npz").write_bytes(b"whatever")
    run_dir = tmp_path / "run"
    command = ringtrain("train", *SMALL, "--resume", "start.npz", "--run-dir", str(run_dir))
    result = run(mpmd(command, command, wdirs=(tmp_path / "a", tmp_path / "b")), timeout=60)
    one_error(result, "rank 0: --resume: no checkpoint at 'start.npz'")
    assert not run_dir.exists()


def test_a_run_dir_that_is_a_file_on_rank_1_only_does_not_matter(tmp_path):
    # Only rank 0 writes the run directory; what the name is elsewhere is no one's business.
    for sub in ("a", "b"):
        (tmp_path / sub).mkdir()
    (tmp_path / "b" / "run").write_text("a file on rank 1's disk\n")
    command = ringtrain("train", *SMALL, "--run-dir", "run")
    result = run(mpmd(command, command, wdirs=(tmp_path / "a", tmp_path / "b")), timeout=60)
    assert result.returncode == 0, show(result)
    assert (tmp_path / "a" / "run" / "checkpoints" / "ckpt-00000020.npz").exists()


def test_a_bad_timeline_path_is_refused_before_training(tmp_path):
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("")
    os.mkfifo(tmp_path / "fifo.json")
    cases = [(tmp_path / "afile" / "sub" / "t.json", "is not a directory"),
             (tmp_path / "adir", "is a directory"),
             (tmp_path / "fifo.json", "is a FIFO")]
    for path, needle in cases:
        run_dir = tmp_path / "run"
        result = mpirun(2, ringtrain("train", *SMALL, "--timeline", str(path), "--run-dir", str(run_dir)), timeout=60)
        one_error(result, f"--timeline: {path}")
        assert needle in result.stderr and not run_dir.exists(), show(result)


def test_a_rank_stalled_at_start_up_ends_the_job_within_the_timeout(tmp_path):
    # Rank 1 sleeps before loading the data; rank 0 waits in data loading's
    # first collective, and its watchdog names it.
    run_dir = tmp_path / "run"
    command = [sys.executable, FAULTY, "sleep-load", "1", "0", *SMALL, "--timeout", "5", "--run-dir", str(run_dir)]
    start = time.monotonic()
    result = mpirun(2, command, timeout=60)
    elapsed = time.monotonic() - start
    assert result.returncode != 0, show(result)
    assert elapsed < 20, f"the job took {elapsed:.1f}s to end with --timeout 5"
    lines = [line for line in result.stderr.splitlines() if "did not finish within" in line]
    assert ("rank 0: start-up: data loading (allgather) did not finish within 5s "
            "(raise --timeout if this is expected)") in lines, show(result)
    assert not any(line.startswith("rank 1:") for line in lines), show(result)
    assert not run_dir.exists()

"""Input safety, the run directory's owner and guarded writes, in real ``ringtrain`` processes.

Bad inputs follow tests/cli/test_bad_input.py: one line on stderr, exit 2,
no traceback, nothing written, quickly; a FIFO must never block and a link
to /dev/zero must never be read. The run-directory and full-disk cases run
real jobs (under ``mpirun -np 2`` where ranks matter), each under a time bound.
"""

import json
import os
import subprocess
import time
import zipfile

import numpy as np
import pytest

from mpirun import ROOT, mpirun, ringtrain, run, show
from mpirun import test_env as job_env
from refusals import assert_refused
from ringtrain.io.checkpoint import list_checkpoints, read_checkpoint, save_checkpoint

SMALL = ["--dataset", "synthetic", "--samples", "400", "--features", "8", "--classes", "3", "--hidden", "8",
         "--batch-size", "8", "--epochs", "1", "--no-progress"]


def make_inputs(tmp):
    os.mkfifo(tmp / "fifo.toml")
    os.mkfifo(tmp / "fifo.npz")
    os.mkfifo(tmp / "fifo-ckpt.npz")
    os.symlink("/dev/zero", tmp / "zero.toml")
    os.symlink("/dev/zero", tmp / "zero.npz")
    os.symlink(tmp / "loop.npz", tmp / "loop.npz")
    lines = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    lines += [f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 9)]
    (tmp / "laughs.yaml").write_text("\n".join(lines) + "\n")
    with zipfile.ZipFile(tmp / "raw.npz", "w") as zf:
        zf.writestr("x", "not an array")
        zf.writestr("y", "nor this")
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(40, 3)).astype(np.float32), np.arange(40) % 2
    np.savez(tmp / "biglabel.npz", x=x, y=np.where(np.arange(40) == 6, 10 ** 9, y))


def train(*flags):
    return ["train", "--run-dir", "{tmp}/run", *flags]


CASES = [
    ("config-fifo", train("--config", "{tmp}/fifo.toml"), "--config {tmp}/fifo.toml: is a FIFO, not a regular file"),
    ("config-dev-zero", train("--config", "{tmp}/zero.toml"), "--config {tmp}/zero.toml: is a character device"),
    ("config-yaml-aliases", train("--config", "{tmp}/laughs.yaml"), "YAML aliases (*name)"),
    ("data-fifo", train("--dataset", "{tmp}/fifo.npz"), "{tmp}/fifo.npz: is a FIFO, not a regular file"),
    ("data-dev-zero", train("--dataset", "{tmp}/zero.npz"), "{tmp}/zero.npz: is a character device"),
    ("data-link-loop", train("--dataset", "{tmp}/loop.npz"), "{tmp}/loop.npz: symbolic link loop"),
    ("data-members-not-npy", train("--dataset", "{tmp}/raw.npz"), "member 'x' is not a .npy array"),
    ("data-label-a-billion", train("--dataset", "{tmp}/biglabel.npz"),
     "y has label 1,000,000,000 in row 6; ringtrain supports at most 100,000 classes"),
    ("resume-fifo", train(*SMALL, "--resume", "{tmp}/fifo-ckpt.npz"), "fifo-ckpt.npz: is a FIFO, not a regular file"),
    ("resume-dev-zero", train(*SMALL, "--resume", "{tmp}/zero.npz"), "is a character device"),
    ("hidden-huge", train(*SMALL, "--hidden", "100000000000"), "--hidden: 100,000,000,000 is too large"),
    ("features-huge", train(*SMALL, "--features", "10000000000"), "--features: 10,000,000,000 is too large"),
    ("samples-huge", train(*SMALL, "--samples", "100000000000000000000"), "--samples: 100,000,000,000,000,000,000"),
    ("bucket-mb-huge", train(*SMALL, "--bucket-mb", "1e303"), "--bucket-mb: 1e+303 is too large"),
    ("model-too-many-parameters", train(*SMALL, "--features", "100000", "--hidden", "1000000,100000"),
     "ringtrain builds models of at most 2^31"),
    ("bench-max-bytes-huge", ["bench", "allreduce", "--max-bytes", "9999G"], "--max-bytes 10,736,344,498,176 is too "
                                                                             "large; ringtrain bench goes up to"),
]

MPI_CASES = ["config-fifo", "data-fifo", "data-label-a-billion", "resume-fifo", "bucket-mb-huge",
             "model-too-many-parameters"]


def check(tmp_path, args, needle, start):
    assert_refused(tmp_path, args, needle, start, make_inputs)


@pytest.mark.parametrize("args, needle", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_unsafe_input_is_one_line_exit_2_nothing_written(tmp_path, args, needle):
    check(tmp_path, args, needle, lambda cmd: run(cmd, timeout=30))


@pytest.mark.parametrize("args, needle", [c[1:] for c in CASES if c[0] in MPI_CASES],
                         ids=[c[0] for c in CASES if c[0] in MPI_CASES])
def test_unsafe_input_under_mpirun_is_one_line_from_rank_0(tmp_path, args, needle):
    check(tmp_path, args, needle, lambda cmd: mpirun(2, cmd, timeout=30))


def warnings(result):
    return [line for line in result.stderr.splitlines() if line.startswith("ringtrain: warning: ")]


def test_a_fifo_named_like_a_checkpoint_is_skipped_on_resume(tmp_path):
    ckpts = tmp_path / "run" / "checkpoints"
    save_checkpoint(ckpts, 2, {"x": np.zeros(1)}, {})  # not this model's: must not be the one chosen either
    os.unlink(ckpts / "ckpt-00000002.npz")
    os.mkfifo(ckpts / "ckpt-00000099.npz")
    result = mpirun(2, ringtrain("train", *SMALL, "--run-dir", str(tmp_path / "run")), timeout=60)
    assert result.returncode == 0, show(result)
    assert any("ckpt-00000099.npz: is a FIFO, not a regular file" in w for w in warnings(result)), show(result)
    assert "resumed from" not in result.stdout and "finished: step" in result.stdout, show(result)


# ---------------------------------------------------------------- the run directory's owner


def start(args, cwd=None):
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=job_env(),
                            cwd=cwd or ROOT, start_new_session=True, stdin=subprocess.DEVNULL)


def finish(proc, timeout):
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, err = proc.communicate()
        raise AssertionError(
            f"timed out after {timeout}s\n--- stdout\n{out[-4000:]}\n--- stderr\n{err[-4000:]}") from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_a_second_job_in_a_held_run_directory_is_refused_and_the_first_finishes(tmp_path):
    from ringtrain.cluster.launch import mpirun_command

    run_dir = tmp_path / "run"
    lock = run_dir / ".ringtrain.lock"
    job_a = start(mpirun_command(2, ringtrain("train", *SMALL, "--epochs", "100000", "--max-time", "20",
                                               "--checkpoint-every", "50", "--keep", "2", "--lr", "0.1",
                                               "--run-dir", str(run_dir))))
    try:
        deadline = time.monotonic() + 60
        while not (lock.exists() and lock.read_text().startswith("pid ")):  # written once A holds the lock
            assert job_a.poll() is None and time.monotonic() < deadline, "job A never took the lock"
            time.sleep(0.2)
        job_b = mpirun(2, ringtrain("train", *SMALL, "--epochs", "2", "--lr", "0.05", "--keep", "1",
                                    "--run-dir", str(run_dir)), timeout=60)
        assert job_a.poll() is None, "job A ended before job B was refused; the test proves nothing"
    finally:
        result_a = finish(job_a, 90)
    assert job_b.returncode == 2, show(job_b)
    lines = job_b.stderr.strip().splitlines()
    assert len(lines) == 1 and "in use by another ringtrain job (pid " in lines[0], show(job_b)
    assert "resumed from" not in job_b.stdout, show(job_b)
    assert result_a.returncode == 0 and "stopped at --max-time: " in result_a.stdout, show(result_a)
    assert json.loads((run_dir / "config.json").read_text())["lr"] == 0.1  # A's, never B's
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["event"] == "done" and sum(r["event"] == "done" for r in records) == 1
    assert len(list_checkpoints(run_dir / "checkpoints")) == 2  # A's --keep 2, not B's --keep 1
    assert read_checkpoint(list_checkpoints(run_dir / "checkpoints")[0])[1]["final"]


def test_default_run_directories_of_jobs_started_together_do_not_collide(tmp_path):
    jobs = [start(ringtrain("train", *SMALL, "--seed", str(k)), cwd=tmp_path) for k in range(3)]
    results = [finish(job, 90) for job in jobs]
    for result in results:
        assert result.returncode == 0, show(result)
    dirs = sorted(os.listdir(tmp_path / "runs"))
    assert len(dirs) == 3, dirs
    seeds = sorted(json.loads((tmp_path / "runs" / d / "config.json").read_text())["seed"] for d in dirs)
    assert seeds == [0, 1, 2]


# ---------------------------------------------------------------- guarded reads and writes


def test_plot_skips_a_torn_last_line_with_one_warning(tmp_path):
    pytest.importorskip("matplotlib")
    lines = [json.dumps({"event": "train", "step": s, "epoch": 0, "loss": 1.0 / s, "accuracy": 0.5,
                         "samples_per_sec": 100.0}) for s in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + '\n{"event": "train", "st')
    result = run(ringtrain("plot", str(tmp_path)), timeout=60)
    assert result.returncode == 0, show(result)
    assert len(warnings(result)) == 1 and "line 4: skipping a torn last line" in warnings(result)[0], show(result)
    assert result.stdout.strip() == str(tmp_path / "metrics.png")


@pytest.mark.parametrize("content, needle", [
    (b'{"event": "train"}\n\xff\xfe\n', "not UTF-8 text (byte 0xff at offset 19)"),
    (None, "is a FIFO, not a regular file"),
])
def test_plot_on_unreadable_metrics_is_one_line(tmp_path, content, needle):
    if content is None:
        os.mkfifo(tmp_path / "metrics.jsonl")
    else:
        (tmp_path / "metrics.jsonl").write_bytes(content)
    result = run(ringtrain("plot", str(tmp_path)), timeout=30)
    assert result.returncode == 2, show(result)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], show(result)


def mounted_tmpfs(path, size):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {done.stderr.strip()}")


def fill(directory, leave):
    st = os.statvfs(directory)
    with open(os.path.join(directory, "filler"), "wb") as fh:
        fh.write(b"\0" * max(0, st.f_bavail * st.f_frsize - leave))


# About 340 KB a checkpoint (parameters and momentum): on 2 MiB, one fits beside --keep 1 only after pruning.
MEDIUM = ["--dataset", "synthetic", "--samples", "400", "--features", "32", "--classes", "3", "--hidden", "256,128",
          "--batch-size", "8", "--epochs", "3", "--no-progress", "--log-every", "1000"]


def test_full_disk_prunes_the_old_checkpoint_to_save_the_new(tmp_path):
    disk = tmp_path / "disk"
    mounted_tmpfs(disk, "2m")
    try:
        fill(disk, 560 * 1024)
        run_dir = disk / "run"
        result = mpirun(2, ringtrain("train", *MEDIUM, "--keep", "1", "--run-dir", str(run_dir)), timeout=90)
        assert result.returncode == 0, show(result)
        assert not any("not written" in w for w in warnings(result)), show(result)
        (path,) = list_checkpoints(run_dir / "checkpoints")
        assert read_checkpoint(path)[1]["final"]
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def test_full_disk_for_metrics_is_one_warning_and_training_goes_on(tmp_path):
    disk = tmp_path / "disk"
    mounted_tmpfs(disk, "1m")
    try:
        run_dir = disk / "run"
        run_dir.mkdir()
        fill(disk, 12 * 1024)
        result = mpirun(2, ringtrain("train", *SMALL, "--epochs", "30", "--log-every", "1", "--run-dir",
                                     str(run_dir)), timeout=90)
        # Training goes on to the end; the disk that refused the metrics refuses the
        # final checkpoint too, and the run says so honestly (exit 3, see test_resume_rules).
        assert result.returncode == 3 and "finished: step 600, 30 epochs done" in result.stdout, show(result)
        assert "ringtrain: error: the final checkpoint (step 600) was not written" in result.stderr, show(result)
        metric_warnings = [w for w in warnings(result) if "metrics.jsonl: cannot write" in w]
        assert len(metric_warnings) == 1 and "no space left on device" in metric_warnings[0], show(result)
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        assert all(json.loads(line)["event"] for line in lines)  # every line that made it is whole
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)

"""Stopping a run with a signal: every rank stops at the same step, rank 0 checkpoints, re-running resumes.

Real jobs under real mpirun, each under a time bound. The runs are slowed
by tests/cli/programs/slow_train.py (a sleep in each step, no change to
any number) so that a signal arrives mid-run.
"""

import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import ringtrain
import mpirun as jobs
from mpirun import ROOT, run, show
from ringtrain.io.checkpoint import read_checkpoint
from ringtrain.cluster.launch import mpirun_command

SLOW = os.path.join(ROOT, "tests", "cli", "programs", "slow_train.py")
# 320 training rows: 20 steps per epoch at 2 ranks; 200 steps of at least 10 ms.
FLAGS = ["--dataset", "synthetic", "--samples", "400", "--features", "8", "--classes", "3", "--hidden", "8",
         "--batch-size", "8", "--epochs", "10", "--checkpoint-every", "5", "--keep", "100"]
LINE = re.compile(r"^ringtrain: stopped at step (\d+) \((SIG\w+)\); checkpoint (\S+); run the same command to resume$")


def slow(run_dir, *extra, seconds=0.01):
    return [sys.executable, SLOW, str(seconds), *FLAGS, "--run-dir", str(run_dir), *extra]


def start(args):
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=jobs.test_env(),
                            cwd=ROOT, start_new_session=True)


def wait_for(path, proc, timeout=60):
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if proc.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def finish(proc, timeout=60):
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"timed out\n--- stdout\n{out[-4000:]}\n--- stderr\n{err[-4000:]}") from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def final_params(run_dir):
    params, meta = ringtrain.load_checkpoint(str(run_dir))
    assert meta["final"], meta
    return params, meta


def assert_bitwise_equal(a, b):
    assert list(a) == list(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and np.array_equal(a[name], b[name]), name


def assert_stopped(result, run_dir, status, name):
    """Exit status, the one line, no traceback, and a final checkpoint at the stop step."""
    assert result.returncode == status, show(result)
    lines = [line for line in result.stderr.splitlines() if line.startswith("ringtrain: stopped")]
    assert len(lines) == 1, show(result)
    step, signame, path = LINE.match(lines[0]).groups()
    assert signame == name, show(result)
    for noise in ("Traceback", "KeyboardInterrupt", "BAD TERMINATION", "MPI_Abort"):
        assert noise not in result.stderr + result.stdout, show(result)
    _, meta = read_checkpoint(path)
    assert meta["step"] == int(step) and meta["final"] and os.path.dirname(path) == str(run_dir / "checkpoints")
    assert 5 <= int(step) < 200, show(result)
    return int(step)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The run that was never stopped (progress lines every 0.5 s, which change nothing)."""
    run_dir = tmp_path_factory.mktemp("stop") / "straight"
    result = run(mpirun_command(2, slow(run_dir, "--progress-every", "0.5", "--progress")), timeout=120)
    assert result.returncode == 0, show(result)
    return run_dir, result


def test_progress_lines_under_mpirun(straight):
    _, result = straight
    lines = [line for line in result.stderr.splitlines() if line.startswith("epoch ")]
    assert lines, show(result)
    pattern = r"^epoch \d+/10  step \d+/\d+  loss \d+\.\d{4}  [\d,]+ samples/s  eta (\d+m)?\d+s$"
    assert all(re.match(pattern, line) for line in lines), lines


@pytest.mark.parametrize("target", ["mpiexec", "one rank"])
def test_sigterm_stops_every_rank_at_one_step_and_resuming_matches_a_straight_run(tmp_path, straight, target):
    run_dir = tmp_path / "run"
    proc = start(mpirun_command(2, slow(run_dir)))
    assert wait_for(run_dir / "checkpoints" / "ckpt-00000005.npz", proc), finish(proc).stderr
    if target == "mpiexec":
        proc.send_signal(signal.SIGTERM)  # as a scheduler does; mpiexec forwards it to every rank
    else:
        # A user's kill of one PID: only rank 1 hears it, yet both stop after the same step.
        pids = dict(re.findall(r"^rank (\d+) pid (\d+)$", proc.stdout.readline() + proc.stdout.readline(), re.M))
        os.kill(int(pids["1"]), signal.SIGTERM)
    stopped = finish(proc)
    step = assert_stopped(stopped, run_dir, 143, "SIGTERM")

    resumed = run(mpirun_command(2, slow(run_dir)), timeout=120)
    assert resumed.returncode == 0, show(resumed)
    assert f"ckpt-{step:08d}.npz at step {step}" in resumed.stdout, show(resumed)
    params, meta = final_params(run_dir)
    reference, ref_meta = final_params(straight[0])
    assert meta["step"] == ref_meta["step"] == 200
    assert_bitwise_equal(params, reference)


def test_ctrl_c_without_mpirun_exits_130_with_a_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    proc = start(slow(run_dir))
    assert wait_for(run_dir / "checkpoints" / "ckpt-00000005.npz", proc), finish(proc).stderr
    proc.send_signal(signal.SIGINT)
    assert_stopped(finish(proc), run_dir, 130, "SIGINT")


def test_train_stops_on_a_signal_and_restores_the_handlers_it_found(tmp_path):
    from mpi4py import MPI

    from ringtrain.training.loop import train

    def mine(signum, frame):
        pass

    cfg = ringtrain.TrainConfig(dataset="synthetic", samples=200, features=4, classes=2, hidden=(4,), epochs=5,
                                batch_size=8, run_dir=str(tmp_path / "run"), progress=False)
    model = ringtrain.build_model("mlp", 4, 2, hidden=(4,), seed=cfg.seed)
    inner, calls = model.loss_and_grad, [0]

    def loss_and_grad(x, y, on_grad=None):
        calls[0] += 1
        if calls[0] == 3:  # a SIGTERM to this process in the middle of step 2
            os.kill(os.getpid(), signal.SIGTERM)
        return inner(x, y, on_grad=on_grad)

    model.loss_and_grad = loss_and_grad
    previous = signal.signal(signal.SIGTERM, mine)
    sigint = signal.getsignal(signal.SIGINT)  # Python's default_int_handler; SIG_IGN when the suite runs with &
    try:
        with open(os.devnull, "w") as quiet:
            result = train(cfg, MPI.COMM_SELF, model=model, stream=quiet)
        assert signal.getsignal(signal.SIGTERM) is mine
        assert signal.getsignal(signal.SIGINT) is sigint
    finally:
        signal.signal(signal.SIGTERM, previous)
    # Caught during the third step's backward: the verdicts are taken after the
    # step's work, so that same step carries it and the run stops after it.
    assert (result.stopped, result.step) == ("sigterm", 3)
    assert result.checkpoint == str(tmp_path / "run" / "checkpoints" / "ckpt-00000003.npz")


def test_progress_bar_on_a_terminal_leaves_epoch_lines_whole(tmp_path):
    # stdout and stderr on one terminal, as a user has them: each epoch line
    # must start a line (after the bar was cleared by a carriage return), never
    # be glued to the bar ('...450.56step/s]epoch 14/40').
    import fcntl
    import pty
    import struct
    import termios

    pid, fd = pty.fork()
    if pid == 0:  # the child: ringtrain train on an 100-column terminal (a new pty has 0 columns)
        fcntl.ioctl(0, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
        os.chdir(ROOT)
        env = jobs.test_env()
        os.execve(sys.executable, [sys.executable, SLOW, "0.002", *FLAGS, "--epochs", "4", "--progress",
                                   "--run-dir", str(tmp_path / "run")], env)
    output, deadline = b"", time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        output += chunk
    os.waitpid(pid, 0)
    text = output.decode("utf-8", "replace")
    assert "step/s]" in text, text  # a bar was drawn
    epochs = [seg for line in text.split("\n") for seg in line.split("\r") if "/4  loss" in seg]
    assert len(epochs) == 4 and all(seg.startswith("epoch ") for seg in epochs), epochs

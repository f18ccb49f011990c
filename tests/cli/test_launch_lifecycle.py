"""``ringtrain launch`` over a job's life: signals, restarts, failure reports, --check.

Every job runs under real mpirun with a time bound; the launcher is always
started in its own session so a test can signal it, and kill what is left.
"""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from mpirun import ROOT, ringtrain, run, show
from mpirun import test_env as job_env
from test_faults import assert_bitwise_equal, final_params

PROGRAMS = os.path.join(ROOT, "tests", "cli", "programs")

# Each rank writes its pid to DIR/pid-R, then sleeps until signalled.
SLEEPER = ("import os, sys, time; from ringtrain.cluster.launch import rank_from_env; "
           "d = sys.argv[1]; r = rank_from_env(os.environ); "
           "open(os.path.join(d, f'pid-{r}.tmp'), 'w').write(str(os.getpid())); "
           "os.rename(os.path.join(d, f'pid-{r}.tmp'), os.path.join(d, f'pid-{r}')); "
           "[time.sleep(0.1) for _ in iter(int, 1)]")


def alive(pid):
    """True while ``pid`` runs (a zombie waiting for its parent counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def wait_until(condition, timeout):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def start_sleepers(tmp_path, np=2):
    """A launcher running SLEEPER on ``np`` ranks; returns it and the ranks' pids."""
    out = open(tmp_path / "launcher.out", "w")
    launcher = subprocess.Popen(ringtrain("launch", "-np", str(np), "--", sys.executable, "-c", SLEEPER,
                                          str(tmp_path)),
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=job_env(), cwd=ROOT, start_new_session=True)
    out.close()
    paths = [tmp_path / f"pid-{r}" for r in range(np)]
    if not wait_until(lambda: all(p.exists() for p in paths), 60):
        stop(launcher, [])
        pytest.fail("the ranks did not start within 60s:\n" + (tmp_path / "launcher.out").read_text())
    return launcher, [int(p.read_text()) for p in paths]


def stop(launcher, pids):
    """Clean up whatever a failed test left running."""
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
    if launcher.poll() is None:
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait(timeout=10)


# --- signals ------------------------------------------------------------------

@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_launcher_ends_every_rank_and_the_launcher_waits(tmp_path, signum):
    launcher, pids = start_sleepers(tmp_path)
    try:
        os.kill(launcher.pid, signum)
        code = launcher.wait(timeout=20)
        output = (tmp_path / "launcher.out").read_text()
        # The launcher returned only after the job ended: no rank outlives it.
        assert not [pid for pid in pids if alive(pid)], output
        assert code != 0, output
    finally:
        stop(launcher, pids)


def test_sigusr1_reaches_every_rank_and_the_job_goes_on(tmp_path):
    launcher, pids = start_sleepers(tmp_path)
    try:
        # SLEEPER leaves SIGUSR1's default action, which ends a process:
        # every rank ending shows the signal reached them all.
        os.kill(launcher.pid, signal.SIGUSR1)
        assert wait_until(lambda: not any(alive(pid) for pid in pids), 20)
        assert launcher.wait(timeout=20) != 0
    finally:
        stop(launcher, pids)


def test_a_launcher_killed_outright_takes_the_job_with_it(tmp_path):
    launcher, pids = start_sleepers(tmp_path)
    try:
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait(timeout=10)
        assert wait_until(lambda: not any(alive(pid) for pid in pids), 20), \
            (tmp_path / "launcher.out").read_text()
    finally:
        stop(launcher, pids)


# --- failures: the reason on the launcher's stderr, and restarts ---------------

def test_a_failing_ranks_last_lines_are_printed(tmp_path):
    logs = tmp_path / "logs"
    result = run(ringtrain("launch", "-np", "2", "-o", str(logs), "--", sys.executable,
                           os.path.join(PROGRAMS, "raise_on_rank.py"), "guarded"), timeout=60)
    assert result.returncode not in (0, 2), show(result)
    lines = result.stderr.splitlines()
    at = [i for i, line in enumerate(lines) if line.startswith("ringtrain launch: last ")]
    # Only the rank that names an error is shown, and at most its last 10 lines.
    assert len(at) == 1 and lines[at[0]].endswith(f" of {logs}/rank-1.log:"), show(result)
    count = int(lines[at[0]].split()[3])
    shown = lines[at[0] + 1:at[0] + 1 + count]
    assert 1 <= count <= 10 and all(line.startswith("    ") for line in shown), show(result)
    assert "    rank 1: RuntimeError: boom on purpose" in shown, show(result)


def test_a_failure_is_restarted_up_to_k_times_and_the_logs_keep_each_run(tmp_path):
    logs = tmp_path / "logs"
    result = run(ringtrain("launch", "-np", "2", "-o", str(logs), "--restarts", "2", "--restart-delay", "0.2",
                           "--", sys.executable, os.path.join(PROGRAMS, "raise_on_rank.py"), "guarded"),
                 timeout=90)
    assert result.returncode not in (0, 2), show(result)
    restarts = [line for line in result.stderr.splitlines() if "; restart " in line]
    status = result.returncode
    assert restarts == [f"ringtrain launch: job exited with status {status} (rank 1 failed); "
                        f"restart {k} of 2 in 0.2s" for k in (1, 2)], show(result)
    log = (logs / "rank-1.log").read_text()
    assert log.count("boom on purpose") >= 3 and "ringtrain launch: restart 2" in log, log


@pytest.mark.parametrize("code", ["2", "0"])
def test_success_and_usage_errors_are_not_restarted(tmp_path, code):
    result = run(ringtrain("launch", "-np", "2", "--restarts", "3", "--restart-delay", "0", "--",
                           sys.executable, "-c", f"import sys; sys.exit({code})"), timeout=60)
    assert result.returncode == int(code), show(result)
    assert "restart" not in result.stderr, show(result)


# 1600 training rows: 100 steps per epoch at 2 ranks, checkpoints every 10.
TRAIN = ["--dataset", "synthetic", "--samples", "2000", "--features", "8", "--classes", "3", "--hidden", "8",
         "--batch-size", "8", "--epochs", "2", "--checkpoint-every", "10", "--no-progress"]


def test_a_restarted_training_run_resumes_and_ends_bitwise_like_a_straight_one(tmp_path):
    straight = run(ringtrain("launch", "-np", "2", "--", *ringtrain("train", *TRAIN, "--run-dir",
                                                                   str(tmp_path / "straight"))), timeout=120)
    assert straight.returncode == 0, show(straight)

    run_dir = tmp_path / "run"
    command = [sys.executable, os.path.join(PROGRAMS, "kill_once.py"), str(tmp_path / "killed-once"), "1", "45",
               *TRAIN, "--run-dir", str(run_dir)]
    restarted = run(ringtrain("launch", "-np", "2", "--restarts", "2", "--restart-delay", "0.5", "--", *command),
                    timeout=180)
    assert restarted.returncode == 0, show(restarted)
    assert (tmp_path / "killed-once").exists()
    lines = [line for line in restarted.stderr.splitlines() if "; restart " in line]
    assert len(lines) == 1 and re.fullmatch(r"ringtrain launch: job exited with status \d+; restart 1 of 2 in 0.5s",
                                            lines[0]), show(restarted)
    # Rank 1 died in step 45, so the newest checkpoint was step 40.
    assert "ckpt-00000040.npz at step 40" in restarted.stdout, show(restarted)
    assert_bitwise_equal(final_params(run_dir), final_params(tmp_path / "straight"))


# --- --check --------------------------------------------------------------------

def test_check_names_each_host_that_does_not_resolve_and_starts_nothing(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("no-such-host.invalid:1\nlocalhost:1\nalso-missing.invalid:1\n")
    marker = tmp_path / "ran"
    result = run(ringtrain("launch", "-np", "2", "--hostfile", str(hostfile), "--check", "--",
                           "touch", str(marker)), timeout=60)
    assert result.returncode == 2, show(result)
    assert result.stderr.splitlines() == [
        f"ringtrain: error: host {name}: does not resolve (check the hostfile or /etc/hosts)"
        for name in ("no-such-host.invalid", "also-missing.invalid")], show(result)
    assert not marker.exists()


def test_check_passes_this_machine_and_goes_on_to_launch(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost:2\n")
    marker = tmp_path / "ran"
    result = run(ringtrain("launch", "-np", "1", "--hostfile", str(hostfile), "--check", "--",
                           "touch", str(marker)), timeout=60)
    assert result.returncode == 0, show(result)
    assert "ringtrain launch: --check: all 1 host(s) resolve and are reachable" in result.stderr, show(result)
    assert marker.exists()

"""What ``ringtrain launch`` says and does at the edges: a rank killed by SIGKILL, a full disk, a user's SIGUSR1,
the last restart, an IPv6 host, a job that succeeds under ``-o``, an earlier job's logs in the same ``-o``.

Every job runs under real mpirun with a time bound.
"""

import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from mpirun import ROOT, ringtrain, run, show
from mpirun import test_env as job_env

# Each rank writes its pid to DIR/pid-R, counts the SIGUSR1s it gets for a
# while, and writes the count to DIR/usr1-R; exits 0.
COUNTER = ("import os, signal, sys, time; from ringtrain.cluster.launch import rank_from_env; "
           "d = sys.argv[1]; r = rank_from_env(os.environ); got = []; "
           "signal.signal(signal.SIGUSR1, lambda s, f: got.append(s)); "
           "open(os.path.join(d, f'pid-{r}.tmp'), 'w').write(str(os.getpid())); "
           "os.rename(os.path.join(d, f'pid-{r}.tmp'), os.path.join(d, f'pid-{r}')); "
           "[time.sleep(0.05) for _ in range(60)]; "
           "open(os.path.join(d, f'usr1-{r}'), 'w').write(str(len(got)))")
# Each rank writes its pid to DIR/pid-R-<pid>, then sleeps until SIGUSR1 (its default action) ends it.
SLEEPER = ("import os, sys, time; from ringtrain.cluster.launch import rank_from_env; "
           "d = sys.argv[1]; r = rank_from_env(os.environ); "
           "open(os.path.join(d, f'pid-{r}-{os.getpid()}'), 'w').close(); "
           "[time.sleep(0.1) for _ in range(600)]")


def wait_until(condition, timeout):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def start(tmp_path, *args):
    out = open(tmp_path / "launcher.out", "w")
    launcher = subprocess.Popen(ringtrain("launch", *args), stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=job_env(), cwd=ROOT, start_new_session=True)
    out.close()
    return launcher


def finish(launcher, tmp_path, timeout=60):
    try:
        code = launcher.wait(timeout=timeout)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    return code, (tmp_path / "launcher.out").read_text()


def test_a_rank_killed_by_sigkill_ends_the_job_as_killed_with_no_wrapper_traceback(tmp_path):
    logs = tmp_path / "logs"
    result = run(ringtrain("launch", "-np", "2", "-o", str(logs), "--", "sh", "-c",
                           'if [ "$PMI_RANK" = 1 ]; then kill -9 $$; fi; sleep 5'), timeout=60)
    assert result.returncode == 9, show(result)  # mpiexec's status for a rank that died of signal 9
    log = (logs / "rank-1.log").read_text()
    assert "Traceback" not in log and "Traceback" not in result.stderr, show(result) + log
    assert (logs / "rank-1.exit").read_text().split()[1] == "-9"
    # Rank 1 printed nothing: its log is said to be empty, not shown as "last 0 line(s)" and nothing.
    assert log == "" and "last 0 line(s)" not in result.stderr, show(result)
    assert f"ringtrain launch: {logs}/rank-1.log is empty: rank 1 printed nothing before it ended" in \
        result.stderr, show(result)


def test_the_log_wrapper_dies_of_the_signal_that_killed_its_command(tmp_path):
    # Run as mpiexec runs it: the leader of its own process group.
    done = subprocess.run([sys.executable, "-m", "ringtrain.cluster.rank_log", str(tmp_path), "--", "sh", "-c",
                           "kill -9 $$"], env=job_env(PMI_RANK="0"), capture_output=True, text=True, timeout=60,
                          start_new_session=True)
    assert done.returncode == -signal.SIGKILL, done.stderr
    assert (tmp_path / "rank-0.log").read_text() == ""


def test_one_sigusr1_to_the_launcher_reaches_each_rank_once_through_the_log_wrapper(tmp_path):
    launcher = start(tmp_path, "-np", "2", "-o", str(tmp_path / "logs"), "--", sys.executable, "-c", COUNTER,
                     str(tmp_path))
    assert wait_until(lambda: all((tmp_path / f"pid-{r}").exists() for r in range(2)), 60)
    os.kill(launcher.pid, signal.SIGUSR1)
    code, out = finish(launcher, tmp_path)
    assert [(tmp_path / f"usr1-{r}").read_text() for r in range(2)] == ["1", "1"], out
    assert code == 0, out


def test_a_job_the_user_stopped_with_sigusr1_is_not_restarted(tmp_path):
    launcher = start(tmp_path, "-np", "2", "--restarts", "3", "--restart-delay", "0", "--", sys.executable, "-c",
                     SLEEPER, str(tmp_path))
    assert wait_until(lambda: len(list(tmp_path.glob("pid-*-*"))) == 2, 60)
    os.kill(launcher.pid, signal.SIGUSR1)
    code, out = finish(launcher, tmp_path)
    assert code != 0 and "restart 1 of 3" not in out, out
    assert out.strip().splitlines()[-1].startswith(
        "ringtrain launch: the job ended (status "), out
    assert out.strip().endswith("after the SIGUSR1 you sent; not restarting it"), out
    assert len(list(tmp_path.glob("pid-*-*"))) == 2, "the job was started again"


def rank_pid(marker, rank):
    """The pid of rank ``rank``'s process whose command line holds ``marker`` (read from /proc), or None."""
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read().split(b"\0")
        except OSError:
            continue
        if marker.encode() in argv and b"ringtrain" in argv and f"PMI_RANK={rank}".encode() in environ:
            return int(entry)
    return None


def test_a_training_job_whose_ranks_got_sigusr1_is_not_restarted(tmp_path):
    # Slurm's --signal and a preemption signal the ranks, not the launcher: "checkpoint and stop" all the same.
    run_dir = str(tmp_path / "run")
    launcher = start(tmp_path, "-np", "2", "--restarts", "2", "--restart-delay", "0", "--",
                     *ringtrain("train", "--dataset", "synthetic", "--epochs", "100000", "--log-every", "5",
                                "--run-dir", run_dir, "--no-progress"))
    assert wait_until(lambda: '"event": "train"' in _text(tmp_path / "run" / "metrics.jsonl"), 90)
    pid = rank_pid(run_dir, 1)
    assert pid is not None
    os.kill(pid, signal.SIGUSR1)
    code, out = finish(launcher, tmp_path, timeout=90)
    assert code == 138 and "restart 1 of 2" not in out, out
    assert out.strip().splitlines()[-1] == (
        "ringtrain launch: the job stopped with a checkpoint (status 138) after a SIGUSR1 reached its ranks "
        "(Slurm's --signal, a preemption or a kill); not restarting it"), out
    assert _text(tmp_path / "run" / "metrics.jsonl").count('"event": "start"') == 1, "the job was started again"


def _text(path):
    try:
        return path.read_text()
    except OSError:
        return ""


def test_the_launcher_says_it_gave_up_after_the_last_restart(tmp_path):
    result = run(ringtrain("launch", "-np", "2", "--restarts", "1", "--restart-delay", "0", "--", "sh", "-c",
                           "exit 3"), timeout=60)
    assert result.returncode == 3, show(result)
    assert result.stderr.strip().splitlines()[-1] == (
        "ringtrain launch: gave up: the job failed again (status 3) after 1 restart(s), as many as --restarts "
        "allows; fix the failure above, or give a larger --restarts"), show(result)


def test_a_report_under_o_blames_this_jobs_rank_not_an_earlier_larger_jobs_log(tmp_path):
    logs = tmp_path / "logs"
    earlier = run(ringtrain("launch", "-np", "3", "-o", str(logs), "--", "sh", "-c",
                            '[ "$PMI_RANK" = 2 ] && echo "Traceback (most recent call last):" && exit 1; exit 0'),
                  timeout=60)
    assert earlier.returncode != 0 and "last 1 line(s) of " + f"{logs}/rank-2.log" in earlier.stderr, show(earlier)
    # The same -o, 2 ranks: rank 0 fails. rank-2.log and its traceback are the earlier job's.
    result = run(ringtrain("launch", "-np", "2", "-o", str(logs), "--", "sh", "-c",
                           '[ "$PMI_RANK" = 0 ] && echo "rank 0 ran out" && exit 1; sleep 1'), timeout=60)
    assert result.returncode != 0, show(result)
    assert f"ringtrain launch: last 1 line(s) of {logs}/rank-0.log:\n    rank 0 ran out" in result.stderr, \
        show(result)
    assert "rank-2.log" not in result.stderr and "Traceback" not in result.stderr, show(result)


@pytest.mark.parametrize("line", ["fe80::1 slots=2", "::1:2", "[::1]:2"])
def test_an_ipv6_host_is_refused_saying_so(tmp_path, line):
    hostfile = tmp_path / "hosts"
    hostfile.write_text(f"# the cluster\n{line}\n")
    result = run(ringtrain("launch", "-np", "2", "--hostfile", str(hostfile), "--", "true"), timeout=60)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, show(result)
    assert "hostfile line 2: '" in result.stderr and "is an IPv6 address, which MPI's host lists cannot carry; " \
        "give the host by name" in result.stderr, show(result)


def test_a_job_that_succeeds_under_o_says_so_and_shows_rank_0s_last_lines(tmp_path):
    logs = tmp_path / "logs"
    result = run(ringtrain("launch", "-np", "2", "-o", str(logs), "--", "sh", "-c",
                           'echo "first of $PMI_RANK"; echo "done on rank $PMI_RANK"'), timeout=60)
    assert result.returncode == 0, show(result)
    lines = result.stderr.strip().splitlines()
    assert lines[-3] == (f"ringtrain launch: the job finished (exit status 0); each rank's output is in "
                         f"{logs}/rank-R.log; the last 2 line(s) of {logs}/rank-0.log:"), show(result)
    assert lines[-2:] == ["    first of 0", "    done on rank 0"], show(result)


def _full_tmpfs():
    """A mounted tmpfs with no space left, or None where one cannot be mounted (not root, no mount)."""
    if os.geteuid() != 0:
        return None
    where = tempfile.mkdtemp(prefix="ringtrain-full-")
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=128k", "tmpfs", where], capture_output=True,
                      timeout=30).returncode != 0:
        os.rmdir(where)
        return None
    return where


def test_a_full_disk_under_o_is_named_before_the_start_after_a_success_and_after_a_failure(tmp_path):
    where = _full_tmpfs()
    if where is None:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        # Fills up while a job that succeeds runs: the lines shown from its log are not its last ones.
        result = run(ringtrain("launch", "-np", "2", "-o", os.path.join(where, "ok"), "--", "sh", "-c",
                               "head -c 400000 /dev/zero | tr '\\0' x; echo; echo done; exit 0"), timeout=60)
        assert result.returncode == 0 and "the job finished (exit status 0)" in result.stderr, show(result)
        assert result.stderr.rstrip().splitlines()[-1].startswith(
            f"ringtrain launch: the file system of {where}/ok is full (0 bytes free): the ranks' output there is "
            "cut short"), show(result)
        for name in os.listdir(os.path.join(where, "ok")):
            os.remove(os.path.join(where, "ok", name))
        # Fills up while the job runs: the report says why the logs are cut short.
        result = run(ringtrain("launch", "-np", "2", "-o", os.path.join(where, "logs"), "--", "sh", "-c",
                               "head -c 400000 /dev/zero | tr '\\0' x; echo; echo done"), timeout=60)
        assert result.returncode != 0, show(result)
        assert f"ringtrain launch: the file system of {where}/logs is full (0 bytes free)" in result.stderr, \
            show(result)
        # Full before it starts: refused, one line, nothing started.
        result = run(ringtrain("launch", "-np", "2", "-o", os.path.join(where, "more"), "--", "echo", "hi"),
                     timeout=60)
        assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, show(result)
        assert result.stderr.startswith(f"ringtrain: error: -o {where}/more: its file system is full"), show(result)
    finally:
        subprocess.run(["umount", where], capture_output=True, timeout=30)
        os.rmdir(where)

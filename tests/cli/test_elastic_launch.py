"""``ringtrain launch`` with horovodrun's elastic flags, under real mpirun: restarts at the size the hosts allow.

The program (tests/cli/programs/elastic_train.py) trains through
``hvd.elastic`` and makes its own events at known steps: a rank SIGKILLs
itself, the discovery script's file is rewritten, a HostsUpdatedInterrupt
is raised. Each run must end with the training finished, every sample of
every epoch trained (none skipped, none twice but an epoch's last padding),
every rank holding the same parameters, and the last commit on disk being
that end.
"""

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest

from mpirun import ROOT, ringtrain, run, show
from mpirun import test_env as job_env

PROGRAM = os.path.join(ROOT, "tests", "cli", "programs", "elastic_train.py")


def elastic_launch(hosts_file, *flags):
    return ringtrain("launch", "--host-discovery-script", f"cat {hosts_file}", "--restart-delay", "0", *flags)


def read_report(path):
    with open(path) as fh:
        return json.load(fh)


def check_trained(report, samples, epochs):
    """Every epoch's samples all trained, and beyond them only the padding of its last partition."""
    assert sorted(report["seen"]) == [str(e) for e in range(epochs)], report["seen"].keys()
    for epoch, seen in report["seen"].items():
        assert set(seen) == set(range(samples)), f"epoch {epoch}: samples missing"
        assert len(seen) - samples < max(report["sizes"]), f"epoch {epoch}: {len(seen) - samples} taken twice"
    assert len(set(report["digests"])) == 1, "the ranks hold different parameters"


def check_last_commit(directory, report):
    """The commit on disk is the run's end: its steps, and the parameters every rank holds."""
    from ringtrain.torch.elastic.commits import CommitStore

    _, snapshot, meta = CommitStore(str(directory)).latest()
    assert meta["finished"] and snapshot["result"] == report["steps"]
    state = snapshot["state"]
    assert state["objects"]["steps"] == report["steps"] and state["objects"]["seen"] == report["seen"]
    h = hashlib.sha256()
    for tensor in state["handlers"]["model"].values():
        h.update(tensor.numpy().tobytes())
    assert h.hexdigest() == report["digests"][0]


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed (pip install "
                    "torch==2.13.0): the program trains through hvd.elastic")
def test_a_killed_worker_and_slots_that_shrink_and_grow_back_end_with_the_training_done(tmp_path):
    hosts, report, commits = tmp_path / "hosts", tmp_path / "report.json", tmp_path / "commits"
    hosts.write_text("localhost:2\n")
    program = [sys.executable, PROGRAM, str(report), "--samples", "64", "--epochs", "3", "--sleep", "0.05",
               "--hosts", str(hosts),
               "--kill", "0:4:1",                # start 0: rank 1 SIGKILLs itself after 4 steps
               "--set", "1:4:localhost:1",       # start 1: one slot is gone
               "--interrupt", "2:3",             # start 2: the script raises HostsUpdatedInterrupt
               "--set", "2:8:localhost:2"]       # start 2: the slot is back
    started = time.monotonic()
    result = run(elastic_launch(hosts, "-np", "2", "--min-np", "1", "--max-np", "2", "--", *program),
                 timeout=240, env=job_env(RINGTRAIN_ELASTIC_DIR=str(commits)))
    assert result.returncode == 0, show(result)
    lines = [line for line in result.stderr.splitlines() if line.startswith("ringtrain ")]
    assert "ringtrain launch: the job exited with status 9 (rank 1 on localhost failed)" in lines, show(result)
    assert [line.split(" rank(s)")[0] for line in lines if " rank(s) on " in line] == [
        "ringtrain launch: starting 2", "ringtrain launch: restarting 2", "ringtrain launch: restarting 1",
        "ringtrain launch: restarting 2"], show(result)
    assert sum("ringtrain elastic: resuming from commit" in line for line in lines) == 3, show(result)
    got = read_report(report)
    # Four starts at 2, 2, 1 and 2 ranks, one reset in the process (the interrupt) at 1 rank.
    assert got["sizes"] == [2, 2, 1, 1, 2] and got["start"] == 3 and got["size"] == 2, got["sizes"]
    assert got["resets"] == [2], got["resets"]  # this last process saw one reset: its restart
    check_trained(got, 64, 3)
    check_last_commit(commits, got)
    print(f"elastic launch with 4 starts: {time.monotonic() - started:.1f}s")


def test_too_few_slots_gives_up_in_one_line_after_the_elastic_timeout(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:1\n")
    result = run(elastic_launch(hosts, "-np", "2", "--min-np", "2", "--elastic-timeout", "1", "--", "true"),
                 timeout=60)
    assert result.returncode == 1, show(result)
    last = result.stderr.strip().splitlines()[-1]
    assert last == ("ringtrain launch: gave up: the hosts give 1 slot(s) (localhost:1), fewer than -np 2, after "
                    "waiting 1s (--elastic-timeout)"), show(result)


def test_a_host_that_keeps_failing_is_left_out_and_then_the_launch_gives_up(tmp_path):
    result = run(ringtrain("launch", "-np", "2", "--min-np", "1", "-H", "localhost:2", "--restart-delay", "0",
                           "--elastic-timeout", "0", "--", "sh", "-c", "exit 3"), timeout=90)
    assert result.returncode == 3, show(result)
    lines = result.stderr.strip().splitlines()
    assert sum(line.startswith("ringtrain launch: the job exited with status 3 (rank ") for line in lines) == 3
    assert "ringtrain launch: host localhost is left out after failing 3 times" in lines, show(result)
    assert lines[-1].startswith("ringtrain launch: gave up: the hosts give 0 slot(s) (no hosts; left out after "
                                "repeated failures: localhost), fewer than --min-np 1"), show(result)


def test_the_reset_limit_ends_the_launch_in_one_line(tmp_path):
    result = run(ringtrain("launch", "-np", "1", "--max-np", "1", "--reset-limit", "1", "--restart-delay", "0",
                           "--", "sh", "-c", "exit 3"), timeout=60)
    assert result.returncode == 3, show(result)
    assert result.stderr.strip().splitlines()[-1] == \
        "ringtrain launch: gave up: the job needed restart 2, more than --reset-limit 1", show(result)


@pytest.mark.parametrize("flags, message", [
    (["-np", "2", "--min-np", "1", "--restarts", "2"], "--restarts is for a job of fixed size"),
    (["-np", "2", "--host-discovery-script", "echo 'a b'"], "host discovery script \"echo 'a b'\" line 1: "
                                                            "expected 'host:slots' or 'host', got 'a b'"),
])
def test_elastic_flags_that_cannot_work_are_one_line_and_exit_2(tmp_path, flags, message):
    # More cases, without a process each: tests/unit/test_elastic.py.
    result = run(ringtrain("launch", *flags, "-o", str(tmp_path / "logs"), "--", "true"), timeout=60)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, show(result)
    assert message in result.stderr, show(result)
    assert not (tmp_path / "logs").exists(), "a refused launch wrote something"


def test_ringtrain_train_resumes_at_the_size_the_hosts_allow(tmp_path):
    hosts, run_dir = tmp_path / "hosts", tmp_path / "run"
    hosts.write_text("localhost:2\n")
    out = open(tmp_path / "launcher.out", "w")

    # Each step at least 20 ms (slow_train.py), so the run cannot end before the launcher sees the change.
    train = [sys.executable, os.path.join(ROOT, "tests", "cli", "programs", "slow_train.py"), "0.02", "--dataset",
             "digits", "--epochs", "12", "--hidden", "16", "--run-dir", str(run_dir)]
    launcher = subprocess.Popen(
        elastic_launch(hosts, "-np", "2", "--min-np", "1", "--", *train),
        stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=job_env(), cwd=ROOT,
        start_new_session=True)
    out.close()
    try:
        metrics = run_dir / "metrics.jsonl"
        end = time.monotonic() + 120
        while time.monotonic() < end and launcher.poll() is None:
            if metrics.exists() and metrics.read_text().count("\n") >= 3:
                break
            time.sleep(0.1)
        hosts.write_text("localhost:1\n")  # a slot goes away while the job trains
        code = launcher.wait(timeout=240)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, 9)
            launcher.wait()
    text = (tmp_path / "launcher.out").read_text()
    assert code == 0, text
    assert "asking the job to stop now (SIGUSR1: checkpoint and stop) and restarting it at 1 rank(s)" in text, text
    assert "ringtrain: stopped at step" in text and "restarting 1 rank(s) on localhost:1" in text, text
    assert "resuming a 2-rank run on 1 ranks" in text, text
    from ringtrain import load_checkpoint

    _, meta = load_checkpoint(str(run_dir))
    assert meta["world_size"] == 1 and meta["epoch"] == 12, meta


@pytest.mark.parametrize("lagging", [False, True], ids=["both-stop", "one-rank-lags"])
def test_a_plain_program_stopped_for_a_host_change_is_restarted_not_blamed(tmp_path, lagging):
    # A program that neither uses hvd.elastic nor starts MPI is stopped with SIGUSR1 when the hosts
    # change; MPICH's mpiexec reports such a rank as status 10 (the bare signal), not 138. A rank slower
    # to die (here: rank 1 holds the signal) is killed by mpiexec once rank 0 has died, and mpiexec ORs
    # the statuses: 10 | 9 = 11, which a loaded machine gave by chance; still the stop that was asked.
    # One mark per rank, and the hosts change only once both ranks sleep: under load a rank that starts late
    # would find a shared mark and exit 0, or meet the SIGUSR1 before its program runs.
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:2\n")
    rank = "${PMI_RANK:-$OMPI_COMM_WORLD_RANK}"
    hold = f"[ {rank} = 1 ] && trap '' USR1; " if lagging else ""
    program = f"{hold}m={tmp_path}/done-{rank}; test -e $m && exit 0; touch $m; sleep 60"
    proc = subprocess.Popen(elastic_launch(hosts, "-np", "2", "--min-np", "1", "--", "sh", "-c", program),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=job_env(), cwd=ROOT,
                            start_new_session=True)
    deadline = time.time() + 60
    while not all((tmp_path / f"done-{rank}").exists() for rank in (0, 1)) and time.time() < deadline:
        time.sleep(0.2)
    hosts.write_text("localhost:1\n")
    try:
        out, err = proc.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, err = proc.communicate()
        raise AssertionError(f"the launch did not end\n{err}") from None
    assert proc.returncode == 0, err
    assert "the job exited with status" not in err, err
    assert "restarting 1 rank(s) on localhost:1" in err, err

"""The elastic launcher never blocks, never re-signals, and gives up on an error a restart cannot fix.

Real launcher, real mpirun, each run under a time bound: a discovery script
that hangs on a later poll holds up neither a SIGTERM nor a job's end (and
is killed with the launch); one that prints without end is refused in one
line; hosts that change and change back send the job one SIGUSR1, not two;
the same error again and again ends the launch even with a cool-down and
no --reset-limit; Slurm host lists and task counts that expand without end
are refused in one line, even for --dry-run.
"""

import os
import signal
import subprocess
import sys
import time

import pytest

from mpirun import ROOT, ringtrain, run, show
from mpirun import test_env as job_env


def start(args, tmp_path, name="launcher.out"):
    out = open(tmp_path / name, "w")
    proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=job_env(),
                            cwd=ROOT, start_new_session=True)
    out.close()
    return proc


def wait_for(path, seconds=60):
    end = time.monotonic() + seconds
    while not os.path.exists(path) and time.monotonic() < end:
        time.sleep(0.1)
    assert os.path.exists(path), f"{path} never appeared"


def finish(proc, seconds, what):
    """Wait ``seconds`` for the launcher; kill it and fail when it takes longer."""
    try:
        return proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise AssertionError(f"the launcher did not end within {seconds}s of {what}") from None


def gone(pid, seconds=10):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def hanging_script(tmp_path):
    """Prints one host at its first run; every later run records its pid and hangs."""
    script = tmp_path / "discover.sh"
    state = tmp_path / "state"
    script.write_text(f"#!/bin/sh\nif [ -e {state}.first ]; then echo $$ > {state}.hung; exec sleep 600; fi\n"
                      f"touch {state}.first\necho localhost:1\n")
    script.chmod(0o755)
    return str(script), f"{state}.hung"


# --- discovery off the loop ---------------------------------------------------------------

# The launcher's own bound on a discovery run is 30 s: each case below ends well inside it, so an
# answer that waited for the hung script would take longer than the bound given to finish().
@pytest.mark.parametrize("how", ["sigterm", "job ends"])
def test_a_hung_discovery_script_holds_up_neither_a_stop_nor_the_end_of_the_job(tmp_path, how):
    script, hung = hanging_script(tmp_path)
    job = ["sleep", "600"] if how == "sigterm" else ["sh", "-c", f"while [ ! -e {hung} ]; do sleep 0.1; done"]
    proc = start(ringtrain("launch", "-np", "1", "--min-np", "1", "--host-discovery-script", script, "--",
                           *job), tmp_path)
    wait_for(hung)  # a later poll hangs now
    if how == "sigterm":
        time.sleep(0.5)
        os.kill(proc.pid, signal.SIGTERM)
    code = finish(proc, 20, "a SIGTERM" if how == "sigterm" else "the job's end")
    text = (tmp_path / "launcher.out").read_text()
    assert (code != 0) if how == "sigterm" else (code == 0), text  # MPICH says 15 for a SIGTERM
    pid = int(open(hung).read())
    assert gone(pid), "the hung discovery script outlived the launch"


def test_a_discovery_script_that_prints_without_end_is_refused_in_one_line(tmp_path):
    result = run(ringtrain("launch", "-np", "1", "--min-np", "1", "--host-discovery-script",
                           "yes localhost:1 | head -c 3000000", "-o", str(tmp_path / "logs"), "--", "true"),
                 timeout=60)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, show(result)
    assert "printed more than 1,048,576 bytes" in result.stderr and "MemoryError" not in result.stderr, show(result)
    assert not (tmp_path / "logs").exists()


@pytest.mark.parametrize("line", ["a" * 100_000, "localhost:" + "x" * 900_000])
def test_a_discovery_line_of_garbage_is_refused_in_a_short_line(tmp_path, line):
    # A 100,000-character host name went whole onto mpirun's command line; a bad line was quoted whole.
    (tmp_path / "line").write_text(line + "\n")
    result = run(ringtrain("launch", "-np", "1", "--min-np", "1", "--host-discovery-script",
                           f"cat {tmp_path / 'line'}", "--dry-run", "--", "true"), timeout=60)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and len(lines[0]) < 400, show(result)
    assert "host discovery script" in lines[0] and not result.stdout, show(result)


# --- one SIGUSR1 per restart ------------------------------------------------------------------

def test_hosts_that_change_and_change_back_send_the_job_one_sigusr1(tmp_path):
    hosts, signals, started = tmp_path / "hosts", tmp_path / "sigusr1", tmp_path / "started"
    hosts.write_text("localhost:1\n")
    # As `ringtrain train` does: SIGUSR1 starts a checkpoint that takes a while, then the job stops with 138;
    # a second SIGUSR1 meanwhile is what would make it abort without its checkpoint.
    program = (f"test -e {started} && exit 0; touch {started}; trap 'echo usr1 >> {signals}; stop=1' USR1; "
               "stop=0; n=0; while :; do sleep 0.1; if [ $stop = 1 ]; then n=$((n+1)); "
               "[ $n -ge 80 ] && exit 138; fi; done")
    proc = start(ringtrain("launch", "-np", "1", "--min-np", "1", "--max-np", "2", "--restart-delay", "0",
                           "--host-discovery-script", f"cat {hosts}", "--", "sh", "-c", program), tmp_path)
    wait_for(started)
    hosts.write_text("localhost:2\n")  # a slot comes: the job is asked to stop
    wait_for(signals)
    hosts.write_text("localhost:1\n")  # and goes again while the job checkpoints
    code = finish(proc, 120, "the restart")
    text = (tmp_path / "launcher.out").read_text()
    assert signals.read_text().count("usr1") == 1, text
    assert code == 0 and "restarting 1 rank(s) on localhost:1" in text, text


# --- the same error, again and again ----------------------------------------------------------

@pytest.mark.parametrize("logs", [False, True])
def test_the_same_error_again_and_again_ends_the_launch_despite_a_cooldown(tmp_path, logs):
    program = [sys.executable, "-c", "raise ValueError('the same bug')"] if logs else ["sh", "-c", "exit 3"]
    flags = ["-o", str(tmp_path / "logs")] if logs else []
    result = run(ringtrain("launch", "-np", "1", "--min-np", "1", "--max-np", "1", "-H", "localhost:1",
                           "--blacklist-cooldown-range", "1", "1", "--restart-delay", "0", *flags, "--", *program),
                 timeout=180)
    status = 1 if logs else 3
    assert result.returncode == status, show(result)
    lines = result.stderr.strip().splitlines()
    assert sum(line.startswith(f"ringtrain launch: the job exited with status {status}") for line in lines) == 5
    what = "status 1, rank 0: ValueError: the same bug" if logs else "status 3, rank 0"
    assert lines[-1] == (f"ringtrain launch: gave up: the job failed the same way 5 times in a row ({what}); a "
                         "restart cannot fix that: fix the program, or give a larger --same-error-limit"), show(result)


def test_the_same_error_limit_is_a_flag(tmp_path):
    result = run(ringtrain("launch", "-np", "1", "--max-np", "1", "--same-error-limit", "2", "--restart-delay", "0",
                           "--", "sh", "-c", "exit 3"), timeout=90)
    assert result.returncode == 3, show(result)
    assert "gave up: the job failed the same way 2 times in a row (status 3, rank 0)" in result.stderr.splitlines()[-1]
    refused = run(ringtrain("launch", "-np", "1", "--same-error-limit", "2", "--", "true"), timeout=60)
    assert refused.returncode == 2 and "--same-error-limit is an elastic flag" in refused.stderr, show(refused)


# --- Slurm's lists, bounded -------------------------------------------------------------------

@pytest.mark.parametrize("variables, message", [
    ({"SLURM_JOB_NODELIST": "n[1-99999999999]", "SLURM_TASKS_PER_NODE": "1"}, "names more than 100,000 nodes"),
    ({"SLURM_JOB_NODELIST": "n1", "SLURM_TASKS_PER_NODE": "1(x99999999999)"}, "are for more than 100,000 nodes"),
    # Said what is wrong, not that 2 nodes and 2 counts do not match, nor that n[3-1] names 0 nodes.
    ({"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_TASKS_PER_NODE": "0(x2)"}, "'0(x2)' gives a node no tasks"),
    ({"SLURM_JOB_NODELIST": "n[3-1]", "SLURM_TASKS_PER_NODE": "1"}, "the range '3-1' runs backwards"),
])
@pytest.mark.parametrize("dry_run", [[], ["--dry-run"]])
def test_slurm_lists_that_expand_without_end_are_refused_in_one_line(tmp_path, variables, message, dry_run):
    env = job_env(SLURM_JOB_ID="7", **variables)
    for name in ("SLURM_STEP_ID", "SLURM_STEPID", "SLURM_NTASKS", "SLURM_NPROCS"):
        env.pop(name, None)
    result = run(ringtrain("launch", "-np", "1", *dry_run, "--", "true"), timeout=30, env=env)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, show(result)
    assert message in result.stderr and "Traceback" not in result.stderr, show(result)


# --- a signal while the first discovery run is waited for -------------------------------------

@pytest.mark.parametrize("signum, status", [(signal.SIGTERM, 128 + signal.SIGTERM), (signal.SIGINT, 130)])
def test_a_signal_during_the_first_discovery_run_kills_the_script_and_ends_the_launch_quietly(tmp_path, signum,
                                                                                                 status):
    # The first run is waited for before the job starts: a stop then must end the script's whole group too
    # (it runs in a session of its own, so the terminal's signal never reaches it), and the launcher is no
    # MPI rank, so it must not start MPI to call itself "rank 0" and MPI_Abort.
    script = tmp_path / "discover.sh"
    pid_file = tmp_path / "discover.pid"
    script.write_text(f"#!/bin/sh\necho $$ > {pid_file}.tmp && mv {pid_file}.tmp {pid_file}\nexec sleep 600\n")
    script.chmod(0o755)
    proc = start(ringtrain("launch", "-np", "1", "--min-np", "1", "--host-discovery-script", str(script), "--",
                           "true"), tmp_path)
    wait_for(pid_file)
    time.sleep(0.5)
    os.kill(proc.pid, signum)
    code = finish(proc, 20, f"signal {signum}")
    text = (tmp_path / "launcher.out").read_text()
    assert code in (status, -signum), text
    assert "rank 0" not in text and "MPI_Abort" not in text and "Traceback" not in text, text
    assert gone(int(pid_file.read_text())), "the discovery script outlived the launch"

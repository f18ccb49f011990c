"""``ringtrain launch`` when things go wrong: absurd hosts, stuck mpiexec, blame, leftovers, links.

Every job runs under real mpirun with a time bound; each launcher is started
in its own session, so a test can signal it and kill what is left.
"""

import os
import signal
import subprocess
import sys
import time

import pytest

from mpirun import ROOT, ringtrain, run, show
from mpirun import test_env as job_env
from refusals import assert_refused
from ringtrain.cluster import leftovers
from test_launch_lifecycle import alive, wait_until

PROGRAMS = os.path.join(ROOT, "tests", "cli", "programs")


def hosts(tmp):
    (tmp / "huge.hosts").write_text("localhost slots=2147483647\n")
    (tmp / "overflow.hosts").write_text("a:65536\nb:65536\n")


# --- what the launcher accepts: one line, exit 2, nothing started or written ---------

@pytest.mark.parametrize("args, needle", [
    (["--hostfile", "{tmp}/huge.hosts"], "hostfile line 1: slots 2,147,483,647 is above ringtrain launch's limit"),
    (["--hostfile", "{tmp}/overflow.hosts"], "hostfile gives 131,072 slots in all"),
    (["-H", "localhost:2147483647"], "-H entry 1: slots 2,147,483,647 is above"),
], ids=["one-host", "the-total", "inline"])
def test_an_absurd_slot_count_is_refused_before_mpiexec_starts(tmp_path, args, needle):
    assert_refused(tmp_path, ["launch", "-np", "2", "-o", "{tmp}/logs", *args, "--", "true"], needle,
                   lambda cmd: run(cmd, timeout=30), hosts)


@pytest.mark.parametrize("program, needle", [
    ("no-such-program-xyz", "cannot run 'no-such-program-xyz': not found on PATH"),
    ("/etc/passwd", "cannot run '/etc/passwd': not an executable file"),
])
def test_a_command_that_cannot_run_is_refused_not_restarted(tmp_path, program, needle):
    assert_refused(tmp_path, ["launch", "-np", "2", "--restarts", "3", "--restart-delay", "0", "--", program], needle,
                   lambda cmd: run(cmd, timeout=30), lambda tmp: None)


# --- a stuck mpiexec ends when the launcher is told to stop ------------------------------

STUCK_MPIRUN = """#!{python}
import os, signal, subprocess, sys, time
if sys.argv[1:2] == ["--version"]:
    print("a stuck mpiexec"); sys.exit(0)
for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(s, signal.SIG_IGN)
open(os.environ["STUCK_PID"], "w").write(str(os.getpid()))
if os.environ.get("STUCK_CHILD"):
    # A proxy that ignores every polite signal too (SIG_IGN survives exec).
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    open(os.environ["STUCK_CHILD"], "w").write(str(child.pid))
while True:
    time.sleep(0.1)
"""


def start_stuck(tmp_path, child=False):
    fake = tmp_path / "mpirun"
    fake.write_text(STUCK_MPIRUN.format(python=sys.executable))
    fake.chmod(0o755)
    env = job_env(STUCK_PID=str(tmp_path / "mpirun.pid"))
    if child:
        env["STUCK_CHILD"] = str(tmp_path / "child.pid")
    launcher = subprocess.Popen(ringtrain("launch", "-np", "2", "--mpirun", str(fake), "--", "true"),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
                                env=env, cwd=ROOT, start_new_session=True)
    # The launcher prints its command line once mpiexec is started; give it that long.
    time.sleep(3)
    return launcher


def end(launcher, tmp_path=None):
    """Kill whatever is left: the launcher's group, and a fake mpirun in its own session."""
    if launcher.poll() is None:
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait(timeout=10)
    for name in ("mpirun.pid", "child.pid"):
        path = tmp_path / name if tmp_path is not None else None
        if path is not None and path.exists() and alive(int(path.read_text())):
            os.kill(int(path.read_text()), signal.SIGKILL)


def test_sigterm_ends_an_mpiexec_that_started_nothing_and_ignores_sigterm(tmp_path):
    launcher = start_stuck(tmp_path)
    try:
        os.kill(launcher.pid, signal.SIGTERM)
        began = time.monotonic()
        launcher.wait(timeout=15)
        assert time.monotonic() - began < 10
        assert launcher.returncode != 0
        assert not alive(int((tmp_path / "mpirun.pid").read_text()))
    finally:
        end(launcher, tmp_path)


def test_a_second_sigterm_ends_a_stuck_job_and_everything_it_started(tmp_path):
    launcher = start_stuck(tmp_path, child=True)
    try:
        assert wait_until(lambda: (tmp_path / "child.pid").exists(), 20)
        child = int((tmp_path / "child.pid").read_text())
        os.kill(launcher.pid, signal.SIGTERM)
        time.sleep(1)
        assert launcher.poll() is None  # the job has started something: it gets its time to end cleanly
        os.kill(launcher.pid, signal.SIGTERM)
        began = time.monotonic()
        launcher.wait(timeout=20)
        assert time.monotonic() - began < 10
        assert wait_until(lambda: not alive(child), 5), "the stuck child outlived the launcher"
    finally:
        end(launcher, tmp_path)


# --- the failure report blames only a real failure ---------------------------------------

@pytest.mark.parametrize("np", [2, 3])
@pytest.mark.parametrize("how", ["raise", "kill"])
def test_the_report_blames_the_failed_rank_not_one_that_printed_error(tmp_path, np, how):
    # raise: the failing rank's log holds ringtrain's failure record; kill: its
    # log is empty, and only its exit record says it was the first to die.
    logs = tmp_path / "logs"
    result = run(ringtrain("launch", "-np", str(np), "-o", str(logs), "--",
                           sys.executable, os.path.join(PROGRAMS, "blame.py"), how), timeout=60)
    assert result.returncode not in (0, 2), show(result)
    # The report shows the failed rank's log, or says it is empty (a SIGKILLed rank printed nothing).
    shown = [line for line in result.stderr.splitlines()
             if line.startswith("ringtrain launch: last ") or " is empty: rank " in line]
    blamed = f"/rank-{np - 1}.log:" if how == "raise" else f"/rank-{np - 1}.log is empty: rank {np - 1} printed"
    assert len(shown) == 1 and blamed in shown[0], show(result)
    assert "validation error" in (logs / "rank-0.log").read_text()


# --- what an aborted job leaves in /dev/shm ---------------------------------------------------

@pytest.mark.skipif(not os.path.isdir(leftovers.SHM_DIR), reason="no /dev/shm on this machine")
def test_an_aborted_job_leaves_no_shared_memory_segment_behind(tmp_path):
    before, since = leftovers.segments(), time.time()
    # Not through mpirun.run: it sweeps /dev/shm itself after a failed job.
    launcher = subprocess.Popen(ringtrain("launch", "-np", "2", "--", sys.executable,
                                          os.path.join(PROGRAMS, "raise_on_rank.py"), "guarded"),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
                                env=job_env(), cwd=ROOT, start_new_session=True)
    try:
        assert launcher.wait(timeout=60) not in (0, 2)
    finally:
        end(launcher)
    # Other jobs may be running: only what appeared since, and no live process maps, is this job's.
    left = leftovers.leftovers(before, leftovers.segments(), leftovers.mapped_paths(), since)
    assert left == [], left


# --- symbolic links in -o ---------------------------------------------------------------------

def test_links_in_the_log_directory_are_replaced_never_written_through(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    targets = {name: tmp_path / f"precious-{name}" for name in ("rank-0.log", "rank-1.log", "hostfile")}
    for name, target in targets.items():
        target.write_text("keep me\n")
        (logs / name).symlink_to(target)
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost:2\n")
    result = run(ringtrain("launch", "-np", "2", "--hostfile", str(hostfile), "-o", str(logs), "--",
                           sys.executable, "-c", "print('hello from a rank')"), timeout=60)
    assert result.returncode == 0, show(result)
    assert all(t.read_text() == "keep me\n" for t in targets.values())
    assert "hello from a rank" in (logs / "rank-1.log").read_text()
    assert not any((logs / name).is_symlink() for name in targets)

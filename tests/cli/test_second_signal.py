"""A second signal while the ranks exit after a graceful stop: the first one's status, no traceback.

The run is stopped by SIGINT (it checkpoints and starts to exit); while
every rank lingers on its way out (tests/cli/programs/slow_exit.py), each
gets a second SIGINT. Real jobs, alone and under mpirun at 2 and 3 ranks,
each under a time bound.
"""

import os
import signal
import subprocess
import sys
import time

import pytest

from mpirun import ROOT, show
from mpirun import test_env as job_env
from ringtrain.cluster.launch import mpirun_command

SLOW_EXIT = os.path.join(ROOT, "tests", "cli", "programs", "slow_exit.py")
FLAGS = ["--dataset", "synthetic", "--samples", "400", "--features", "8", "--classes", "3", "--hidden", "8",
         "--batch-size", "8", "--epochs", "10", "--no-progress"]


def wait_for(paths, proc, timeout=60):
    deadline = time.monotonic() + timeout
    while not all(os.path.exists(p) for p in paths):
        if proc.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.parametrize("np", [1, 2, 3])
def test_a_second_sigint_while_exiting_gives_130_and_no_traceback(tmp_path, np):
    program = [sys.executable, SLOW_EXIT, str(tmp_path), "30", *FLAGS, "--run-dir", str(tmp_path / "run")]
    args = program if np == 1 else mpirun_command(np, program)
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=job_env(), cwd=ROOT,
                            start_new_session=True)
    try:
        pids = [tmp_path / f"pid-{r}" for r in range(np)]
        assert wait_for(pids, proc), show(subprocess.CompletedProcess(args, proc.poll(), *proc.communicate()))
        time.sleep(1.0)  # into the training steps
        for path in pids:
            os.kill(int(path.read_text()), signal.SIGINT)
        assert wait_for([tmp_path / f"exiting-{r}" for r in range(np)], proc), \
            show(subprocess.CompletedProcess(args, proc.poll(), *proc.communicate()))
        began = time.monotonic()
        for path in pids:
            os.kill(int(path.read_text()), signal.SIGINT)
        out, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    result = subprocess.CompletedProcess(args, proc.returncode, out, err)
    assert time.monotonic() - began < 10, show(result)
    assert proc.returncode == 130, show(result)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, show(result)
    assert "ringtrain: stopped at step" in err, show(result)


@pytest.mark.parametrize("first, second, status", [(signal.SIGUSR1, signal.SIGINT, 138),
                                                   (signal.SIGTERM, signal.SIGUSR1, 143)])
def test_a_second_signal_while_waiting_in_mpi_finalize_keeps_the_first_ones_status(tmp_path, first, second, status):
    # Rank 1 lingers after its run; rank 0 goes straight on to exit and waits
    # for it in MPI's finalisation, where Python no longer runs handlers. The
    # second signal reaches rank 0 there.
    program = [sys.executable, SLOW_EXIT, str(tmp_path), "4", *FLAGS, "--run-dir", str(tmp_path / "run")]
    args = mpirun_command(2, program)
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=job_env(SLOW_EXIT_RANKS="1"), cwd=ROOT, start_new_session=True)
    try:
        pids = [tmp_path / f"pid-{r}" for r in range(2)]
        assert wait_for(pids, proc), show(subprocess.CompletedProcess(args, proc.poll(), *proc.communicate()))
        time.sleep(1.0)  # into the training steps
        for path in pids:
            os.kill(int(path.read_text()), first)
        assert wait_for([tmp_path / f"exiting-{r}" for r in range(2)], proc), \
            show(subprocess.CompletedProcess(args, proc.poll(), *proc.communicate()))
        time.sleep(1.0)  # rank 0 is in MPI_Finalize, rank 1 still asleep
        os.kill(int(pids[0].read_text()), second)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    result = subprocess.CompletedProcess(args, proc.returncode, out, err)
    assert proc.returncode == status, show(result)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err and "BAD TERMINATION" not in err, show(result)

"""The time bound covers start-up: a rank that never reaches MPI ends the job within --timeout.

MPMD jobs (``mpirun -np N-1 ringtrain train ... : -np 1 LATE``) where the
last rank is stopped (SIGSTOP) or sleeps before ringtrain even starts, so
every other rank waits inside ``MPI_Init``. Each job runs under a time bound.
"""

import os
import subprocess
import sys
import time

import pytest

from mpirun import ringtrain, run, show
from mpirun import test_env as job_env
from ringtrain.cluster.launch import find_mpirun, mpirun_command

SMALL = ["--dataset", "synthetic", "--samples", "200", "--features", "4", "--classes", "3", "--hidden", "4",
         "--epochs", "1", "--no-progress"]
# The late rank: stopped, or asleep for longer than any bound here, before it runs ringtrain at all.
LATE = ("import os, runpy, signal, sys, time\n"
        "os.kill(os.getpid(), signal.SIGSTOP) if sys.argv[1] == 'stop' else time.sleep(120)\n"
        "sys.argv = ['ringtrain'] + sys.argv[2:]\n"
        "runpy.run_module('ringtrain', run_name='__main__')\n")


@pytest.mark.parametrize("np", [2, 3])
@pytest.mark.parametrize("how", ["stop", "sleep"])
def test_a_rank_that_never_reaches_mpi_ends_the_job_within_the_timeout(tmp_path, np, how):
    train = ["train", *SMALL, "--timeout", "5", "--run-dir", str(tmp_path / "run")]
    args = mpirun_command(np - 1, ringtrain(*train)) + [":", "-np", "1", sys.executable, "-c", LATE, how, *train]
    began = time.monotonic()
    result = run(args, timeout=90)
    elapsed = time.monotonic() - began
    assert result.returncode != 0, show(result)
    assert elapsed < 25, f"the job took {elapsed:.1f}s to end with --timeout 5\n{show(result)}"
    lines = [line for line in result.stderr.splitlines() if "did not finish within 5s" in line]
    # Every rank that waited says so; the late rank, the one to look at, says nothing.
    assert {line.split(":")[0] for line in lines} <= {f"rank {r}" for r in range(np - 1)} and lines, show(result)
    assert lines[0].split(": ", 1)[1] == ("start-up: MPI start and settings agreement did not finish within 5s (a "
                                          "rank that printed no such line never got there; raise --timeout if this "
                                          "is expected)"), show(result)
    assert "Traceback" not in result.stderr, show(result)


@pytest.mark.parametrize("np", [2, 3])
def test_info_is_bounded_at_start_up_too(np):
    args = mpirun_command(np - 1, ringtrain("info")) + [":", "-np", "1", sys.executable, "-c", LATE, "stop", "info"]
    began = time.monotonic()
    result = run(args, timeout=90, env=job_env(RINGTRAIN_TIMEOUT="4"))
    assert result.returncode != 0 and time.monotonic() - began < 25, show(result)
    assert "rank 0: start-up: MPI start did not finish within 4s (a rank that printed no such line" in result.stderr, \
        show(result)


def test_the_start_up_bound_costs_nothing_when_every_rank_is_there(tmp_path):
    result = run(mpirun_command(2, ringtrain("train", *SMALL, "--timeout", "5", "--run-dir", str(tmp_path / "r"))),
                 timeout=90)
    assert result.returncode == 0, show(result)
    assert "did not finish" not in result.stderr, show(result)


# --- a stale rank variable -----------------------------------------------------------------

@pytest.mark.parametrize("args, needle", [
    (["train", "--epochs", "0"], "--epochs: must be > 0, got 0"),
    (["info", "--bogus"], "unrecognized arguments: --bogus"),
])
def test_a_stale_pmi_rank_outside_mpirun_is_named_with_the_fix(tmp_path, args, needle):
    env = job_env(PMI_RANK="1")
    for name in ("PMI_FD", "PMI_PORT", "PMI_SIZE"):
        env.pop(name, None)
    result = subprocess.run(ringtrain(*args), capture_output=True, text=True, env=env, timeout=60, cwd=tmp_path)
    assert result.returncode == 2, show(result)
    assert result.stderr.splitlines() == [
        f"ringtrain: error: {needle}" + (" (see 'ringtrain --help')" if "unrecognized" in needle else ""),
        "ringtrain: warning: PMI_RANK=1 is set, but no MPI launcher started this process; unset PMI_RANK, "
        "or start it with mpirun"], show(result)
    assert os.listdir(tmp_path) == []


def test_under_mpirun_rank_0_alone_reports_and_nothing_is_called_stale():
    result = run(mpirun_command(2, ringtrain("train", "--epochs", "0"), mpirun=find_mpirun()), timeout=60)
    assert result.returncode == 2, show(result)
    assert result.stderr.splitlines() == ["ringtrain: error: --epochs: must be > 0, got 0"], show(result)


@pytest.mark.parametrize("np", [1, 2])
def test_a_bad_bound_in_the_environment_is_one_line_and_exit_2(tmp_path, np):
    from refusals import assert_refused

    env = job_env(RINGTRAIN_TIMEOUT="soon")
    start = (lambda cmd: run(cmd, timeout=30, env=env)) if np == 1 else \
        (lambda cmd: run(mpirun_command(np, cmd), timeout=30, env=env))
    assert_refused(tmp_path, ["info"], "RINGTRAIN_TIMEOUT='soon': must be a number of seconds > 0; unset it",
                   start, lambda tmp: None)


# A library program: the engine's init (Horovod's hvd.init), then one op, then a line saying so.
INIT = ("import numpy as np\n"
        "import ringtrain.engine as hvd\n"
        "hvd.init()\n"
        "print('op', hvd.allreduce(np.ones(2), op=hvd.Sum), flush=True)\n")
# The rank that never calls it: it leaves before starting MPI, raises, or starts MPI and returns.
NEVER = {"exits": "import sys; sys.exit(0)",
         "raises": "raise RuntimeError('before hvd.init')",
         "starts MPI and returns": "from mpi4py import MPI"}


@pytest.mark.parametrize("np", [2, 3])
@pytest.mark.parametrize("never", list(NEVER))
def test_a_rank_that_never_calls_hvd_init_ends_the_job_within_the_library_bound(np, never):
    args = mpirun_command(np - 1, [sys.executable, "-c", INIT]) + [":", "-np", "1", sys.executable, "-c",
                                                                     NEVER[never]]
    began = time.monotonic()
    result = run(args, timeout=90, env=job_env(RINGTRAIN_TIMEOUT="4"))
    elapsed = time.monotonic() - began
    assert result.returncode != 0 and elapsed < 25, f"{elapsed:.1f}s\n{show(result)}"
    lines = [line for line in result.stderr.splitlines() if "did not finish within 4s" in line]
    # Every rank that waited in init says so, naming it; the one that never came says nothing.
    assert {line.split(":")[0] for line in lines} == {f"rank {r}" for r in range(np - 1)}, show(result)
    assert all(line.split(": ", 1)[1].startswith("hvd.init") and "never reached it" in line for line in lines), \
        show(result)
    assert "op" not in result.stdout, show(result)

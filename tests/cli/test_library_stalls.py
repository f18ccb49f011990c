"""The library collectives keep the trainer's promise: a stall ends the job within the bound, naming ranks.

Programs that call ``ringtrain.allreduce_`` themselves (no trainer), under
real mpirun at 2 and 3 ranks, MPMD where the ranks disagree (the last rank
runs another role), each under a time bound.
"""

import os
import sys
import time

import pytest

from mpirun import ROOT, run, show
from mpirun import test_env as job_env
from ringtrain.cluster.launch import mpirun_command

PROGRAMS = os.path.join(ROOT, "tests", "cli", "programs")
STALL = os.path.join(PROGRAMS, "library_stall.py")


def mpmd(np, role, *extra, env=None):
    """``mpirun -np N-1 STALL all : -np 1 STALL role``: the last rank disagrees."""
    args = mpirun_command(np - 1, [sys.executable, STALL, "all", *extra])
    args += [":", "-np", "1", sys.executable, STALL, role, *extra]
    began = time.monotonic()
    result = run(args, timeout=90, env=env)
    return result, time.monotonic() - began


@pytest.mark.parametrize("np", [2, 3])
@pytest.mark.parametrize("role", ["skip", "raise", "return"])
def test_a_collective_one_rank_misses_ends_the_job_within_the_timeout(np, role):
    result, elapsed = mpmd(np, role, "3")
    assert result.returncode != 0, show(result)
    assert elapsed < 25, f"{elapsed:.1f}s with a 3s timeout\n{show(result)}"
    lines = [line for line in result.stderr.splitlines() if "did not finish within 3s" in line]
    assert lines, show(result)
    # Each waiting rank names itself and the call; the rank that printed nothing is the one that left.
    assert {line.split(":")[0] for line in lines} <= {f"rank {r}" for r in range(np - 1)}, show(result)
    assert "allreduce_ (call 2 on this communicator) did not finish within 3s" in lines[0], show(result)


def test_the_bound_can_come_from_the_environment():
    result, elapsed = mpmd(2, "skip", env=job_env(RINGTRAIN_TIMEOUT="3"))
    assert result.returncode != 0 and elapsed < 25, show(result)
    assert "rank 0: allreduce_ (call 2 on this communicator) did not finish within 3s" in result.stderr, show(result)


def test_a_bad_bound_in_the_environment_is_one_line_on_every_rank():
    result, _ = mpmd(2, "all", env=job_env(RINGTRAIN_TIMEOUT="soon"))
    assert result.returncode != 0, show(result)
    assert "RINGTRAIN_TIMEOUT='soon': must be a number of seconds > 0" in result.stderr, show(result)


def test_every_rank_agreeing_is_not_slowed_or_stopped():
    result, _ = mpmd(3, "all", "3")
    assert result.returncode == 0 and "did not finish" not in result.stderr, show(result)


@pytest.mark.parametrize("np", [2, 3])
def test_two_threads_on_one_communicator_are_refused(np):
    began = time.monotonic()
    result = run(mpirun_command(np, [sys.executable, os.path.join(PROGRAMS, "two_threads.py")]), timeout=90)
    assert result.returncode != 0 and time.monotonic() - began < 60, show(result)
    assert ("another thread is in allreduce_ on this communicator; call ringtrain's collectives on one "
            "communicator from one thread at a time") in result.stderr, show(result)

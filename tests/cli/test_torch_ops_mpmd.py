"""Two programs that call a ringtrain.torch collective differently, in real MPMD jobs (``mpirun -np 1 A : -np 1 B``).

Every rank must raise (an error derived from RuntimeError), within the job's
time bound, and the ranks must still be in step afterwards. Assertions come
after the job ends. Skipped without torch.
"""

import os
import re
import sys

import pytest

import mpirun
from mpirun import ROOT, run, show
from ringtrain.cluster.launch import find_mpirun

pytest.importorskip("torch", reason="torch is not installed (pip install torch==2.13.0)")

PROGRAM = os.path.join(ROOT, "tests", "cli", "programs", "hvd_disagree.py")


def mpmd(case):
    command = [find_mpirun(), "-np", "1", sys.executable, PROGRAM, case, "a", ":",
               "-np", "1", sys.executable, PROGRAM, case, "b"]
    return run(command, timeout=120, env=mpirun.test_env())


@pytest.mark.parametrize("case", ["shape", "dtype", "op", "root", "trailing", "kind", "set", "grouped", "splits",
                                  "large"])
def test_ranks_that_disagree_all_raise_and_stay_in_step(case):
    result = mpmd(case)
    assert result.returncode == 0, show(result)
    # mpiexec may join the two ranks' lines: count the verdicts, not the lines.
    assert re.findall(r"\bok\b|mismatch: ", result.stdout) == ["mismatch: ", "mismatch: "], show(result)
    assert re.findall(r"level|out of step", result.stdout) == ["level", "level"], show(result)


def test_ranks_that_pass_the_same_nan_factor_agree():
    result = mpmd("nan")
    assert result.returncode == 0, show(result)
    # mpiexec may join the two ranks' lines ("okok"): count them, and see that nothing failed.
    assert result.stdout.count("ok") == 2 and "mismatch" not in result.stdout, show(result)


def test_a_bad_engine_setting_on_one_rank_ends_every_rank_at_init_with_one_line_and_status_2():
    # Only rank 1 has the bad value (mpiexec's -env applies to its own program): rank 0 must not be left
    # in init, nor start with a fusion threshold its peer does not share.
    code = "import ringtrain.torch as hvd; hvd.init(); print('started', flush=True)"
    command = [find_mpirun(), "-np", "1", sys.executable, "-c", code, ":",
               "-np", "1", "-env", "HOROVOD_FUSION_THRESHOLD", "64MB", sys.executable, "-c", code]
    result = run(command, timeout=120, env=mpirun.test_env())
    assert result.returncode == 2, show(result)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines == ["ringtrain: error: rank 1: HOROVOD_FUSION_THRESHOLD='64MB': must be a whole number of bytes "
                     ">= 0; unset it for the default"], show(result)
    assert "started" not in result.stdout, show(result)


def test_unnamed_ops_of_two_threads_pair_thread_by_thread_whatever_order_the_ranks_submit_them_in():
    # Rank a's main thread submits first, rank b's worker does: matched by submission order alone, each
    # rank's first op would meet the other thread's (1 + 100), and neither rank could tell.
    program = os.path.join(ROOT, "tests", "cli", "programs", "hvd_threads.py")
    command = [find_mpirun(), "-np", "1", sys.executable, program, "a", ":", "-np", "1", sys.executable, program, "b"]
    result = run(command, timeout=120, env=mpirun.test_env())
    assert result.returncode == 0, show(result)
    found = sorted(re.findall(r"rank (\d): (main|worker) ([0-9.]+)", result.stdout))
    assert found == [("0", "main", "2.0"), ("0", "worker", "200.0"), ("1", "main", "2.0"), ("1", "worker", "200.0")], \
        show(result)

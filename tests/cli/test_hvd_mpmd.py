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

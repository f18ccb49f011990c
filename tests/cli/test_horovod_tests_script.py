"""scripts/horovod_tests.sh under real mpirun: a test that fails on one rank ends its mpirun, the rest run again.

A checkout made here holds a test_torch.py of four tests; the second fails
on rank 1 before the collective that rank 0 goes on to. Without ``-x`` and
the rerun, the ranks would wait in different tests until the bound. Skipped
without torch.
"""

import os
import subprocess
import sys

import pytest

from mpirun import ROOT

pytest.importorskip("torch", reason="torch is not installed (pip install torch==2.13.0)")

SCRIPT = os.path.join(ROOT, "scripts", "horovod_tests.sh")
TESTS = '''
import torch
import horovod.torch as hvd


def test_a():
    hvd.init()
    assert hvd.allreduce(torch.ones(3), op=hvd.Sum).tolist() == [hvd.size()] * 3


def test_b():
    hvd.init()
    assert hvd.rank() == 0, "rank 1 fails here"
    hvd.allreduce(torch.ones(3), name="b")


def test_c():
    hvd.init()
    hvd.allreduce(torch.ones(3), name="c")


def test_d():
    hvd.init()
    assert hvd.allreduce(torch.ones(3), op=hvd.Sum, name="d").tolist() == [hvd.size()] * 3
'''


def test_a_test_failing_on_one_rank_ends_its_mpirun_and_the_chunk_goes_on_in_a_new_one(tmp_path):
    parallel = tmp_path / "checkout" / "test" / "parallel"
    parallel.mkdir(parents=True)
    (parallel / "test_torch.py").write_text(TESTS)
    keep = tmp_path / "logs"
    env = dict(os.environ, PYTHON=sys.executable, CHUNK="20", TIMEOUT="150", KEEP_LOGS=str(keep))
    done = subprocess.run(["bash", SCRIPT, str(tmp_path / "checkout"), "2"], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    attempts = sorted(os.listdir(keep / "np2"))
    assert attempts == ["chunk-000.000", "chunk-000.001"], attempts
    rerun = (keep / "np2" / "chunk-000.000" / "rest").read_text().split()
    assert [test_id.rsplit("::", 1)[-1] for test_id in rerun] == ["test_c", "test_d"]
    lines = done.stdout.splitlines()
    assert "np=2: 3 passed, 1 failed, 0 skipped, of 4" in lines, done.stdout + done.stderr
    failed = [line for line in lines if line.startswith("  FAILED test_b:")]
    assert len(failed) == 1 and "rank 1: AssertionError: rank 1 fails here" in failed[0], done.stdout
    # A directory of an earlier run is not mixed into a new one.
    again = subprocess.run(["bash", SCRIPT, str(tmp_path / "checkout"), "2"], capture_output=True, text=True,
                           env=env, timeout=60)
    assert again.returncode == 2 and "KEEP_LOGS must name an empty or new directory" in again.stderr

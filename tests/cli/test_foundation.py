"""Whole commands in a subprocess: info, one-line usage errors, abort on exception."""

import json
import os
import sys
import time

import pytest
from mpi4py import MPI

from mpirun import ROOT, mpirun, ringtrain, run, show
from ringtrain.comm.cuda_aware import cuda_aware

PROGRAM = os.path.join(ROOT, "tests", "cli", "programs", "raise_on_rank.py")


def test_info_prints_one_table_for_three_ranks():
    result = mpirun(3, ringtrain("info"), timeout=60)
    assert result.returncode == 0, show(result)
    lines = result.stdout.strip().splitlines()
    assert lines[0].startswith("ringtrain: 3 rank(s) on 1 node(s); MPI: ")
    aware, why = cuda_aware()
    assert lines[1] == f"CUDA-aware MPI: {'yes' if aware else 'no'} ({why})"
    assert lines[2].split() == ["rank", "host", "local", "node", "device"]
    rows = [line.split() for line in lines[3:]]
    host = MPI.Get_processor_name()
    assert rows == [[str(r), host, f"{r}/3", "0/1", "cpu"] for r in range(3)]


def test_info_json_says_the_device_as_the_table_does():
    result = mpirun(2, ringtrain("info", "--json"), timeout=60)
    assert result.returncode == 0, show(result)
    ranks = json.loads(result.stdout)["ranks"]
    # The table says "cpu" for a rank without a GPU; the JSON says the same, and its GPU index is null.
    assert [(r["rank"], r["device"], r["gpu"]) for r in ranks] == [(0, "cpu", None), (1, "cpu", None)]


def test_info_without_mpirun_is_one_rank():
    result = run(ringtrain("info"), timeout=60)
    assert result.returncode == 0, show(result)
    assert "1 rank(s) on 1 node(s)" in result.stdout


def test_python_dash_m_and_console_script_agree():
    script = os.path.join(os.path.dirname(sys.executable), "ringtrain")
    a = run([script, "--version"], timeout=30)
    b = run(ringtrain("--version"), timeout=30)
    assert a.returncode == b.returncode == 0 and a.stdout == b.stdout and "ringtrain" in a.stdout


@pytest.mark.parametrize("args", [["info", "--bogus"], ["nosuchcommand"], []])
def test_usage_error_is_one_line_exit_2_on_every_rank(args):
    result = mpirun(2, ringtrain(*args), timeout=60)
    assert result.returncode == 2, show(result)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ringtrain: error: "), show(result)
    assert "Traceback" not in result.stderr


def test_exception_on_one_rank_aborts_the_whole_job_quickly():
    start = time.monotonic()
    result = mpirun(3, [sys.executable, PROGRAM, "guarded"], timeout=60)
    elapsed = time.monotonic() - start
    assert result.returncode != 0, show(result)
    assert "rank 1: RuntimeError: boom on purpose" in result.stderr, show(result)
    assert elapsed < 30, f"job took {elapsed:.1f}s to end"


def test_control_unguarded_exception_would_hang():
    # The reason abort_on_error exists: without it the peers wait forever in
    # the barrier. A short bound proves the hang without spending long on it.
    with pytest.raises(AssertionError, match="timed out"):
        mpirun(3, [sys.executable, PROGRAM, "unguarded"], timeout=8)

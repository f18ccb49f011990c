"""``ringtrain bench allreduce`` under real mpirun: its table, its JSON, and what it refuses."""

import json
import os
import sys

import pytest

from mpirun import ROOT, mpirun, ringtrain, run, show
from ringtrain import backend

SMALL = ["--min-bytes", "4K", "--max-bytes", "128K", "--iters", "3", "--warmup", "1"]


def test_table_has_every_contestant_and_a_row_per_size():
    result = mpirun(2, ringtrain("bench", "allreduce", *SMALL), timeout=120)
    assert result.returncode == 0, show(result)
    lines = result.stdout.strip().splitlines()
    assert lines[0].startswith("# ringtrain bench allreduce --device cpu: 2 rank(s)")
    assert all(name in lines[2] for name in ("mpi us", "ring us", "auto us", "auto/mpi", "auto/copy"))
    rows = [line for line in lines if not line.startswith("#")]
    assert [row.split()[0] for row in rows] == ["4K", "8K", "16K", "32K", "64K", "128K"]


def test_json_rows_hold_each_contestants_bandwidth_and_the_ratios():
    result = mpirun(3, ringtrain("bench", "allreduce", *SMALL, "--json"), timeout=120)
    assert result.returncode == 0, show(result)
    report = json.loads(result.stdout)
    assert report["ranks"] == 3 and report["device"] == "cpu" and report["baseline"] == "mpi"
    for row in report["rows"]:
        for name in ("mpi", "ring", "auto"):
            assert row[name]["busbw_GBps"] > 0
        assert row["ratios"]["auto/mpi"] == pytest.approx(row["auto"]["busbw_GBps"] / row["mpi"]["busbw_GBps"])


def test_one_rank_is_one_line_exit_2():
    result = run(ringtrain("bench", "allreduce"), timeout=60)
    assert result.returncode == 2, show(result)
    assert result.stderr.strip() == ("ringtrain: error: bench allreduce needs at least 2 ranks to compare anything; "
                                     "run it under mpirun -np 2 (or more)")


def test_bench_alone_says_what_to_type():
    result = mpirun(2, ringtrain("bench"), timeout=60)
    assert result.returncode == 2, show(result)
    assert result.stderr.strip() == ("ringtrain: error: say what to benchmark: ringtrain bench allreduce (under "
                                     "mpirun -np 2 or more)"), show(result)


@pytest.mark.skipif(backend.gpu_available(), reason="a GPU is visible here, so --device gpu is valid input")
def test_gpu_without_one_is_one_line_exit_2_on_every_rank():
    result = mpirun(2, ringtrain("bench", "allreduce", "--device", "gpu"), timeout=60)
    assert result.returncode == 2, show(result)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--device gpu needs a CUDA GPU" in lines[0], show(result)
    assert "Traceback" not in result.stderr


def test_the_small_call_benchmark_prints_its_ratio():
    script = os.path.join(ROOT, "scripts", "bench_small_calls.py")
    result = mpirun(2, [sys.executable, script, "--calls", "50", "--rounds", "3"], timeout=120)
    assert result.returncode == 0, show(result)
    record = json.loads(result.stdout.strip().splitlines()[-1])
    assert record["ranks"] == 2 and record["bytes"] == 4096
    assert record["ratio_to_mpi"] == pytest.approx(record["us"]["ringtrain"] / record["us"]["mpi"])

"""scripts/gpu_acceptance.sh and its report, on this machine: what can be checked without a GPU.

On a machine without a GPU the script must end at once with one line and a
non-zero status. The report (scripts/gpu_report.py) is fed the files an
acceptance run leaves, with figures on both sides of every target, and
real checkpoints from two CPU runs for the bitwise resume row.
"""

import glob
import json
import os
import subprocess
import sys

import pytest
from mpirun import ROOT, mpirun, ringtrain, show

from ringtrain import backend
from ringtrain.cluster.launch import find_mpirun

SCRIPT = os.path.join(ROOT, "scripts", "gpu_acceptance.sh")
REPORT = os.path.join(ROOT, "scripts", "gpu_report.py")
MIB = 1 << 20


@pytest.mark.skipif(bool(glob.glob("/dev/nvidia[0-9]*")) or backend.gpu_available(), reason="a GPU is here")
def test_without_a_gpu_it_ends_at_once_with_one_line():
    result = subprocess.run(["bash", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, show(result)
    assert result.stdout.count("\n") == 1 and result.stderr == "", show(result)
    assert result.stdout.startswith("gpu_acceptance: no NVIDIA GPU on this machine"), show(result)


def write_run(tmp_path, *, busbw_256, probe_256, gpu_rates, cold_s, warm_s, failed_step=False):
    (tmp_path / "steps.tsv").write_text(
        f"tests at 2 ranks\t{1 if failed_step else 0}\t40.0\n"
        f"train, cold kernel cache\t0\t{cold_s}\ntrain, warm kernel cache\t0\t{warm_s}\n")
    rows = [{"bytes": n * MIB, "auto": {"busbw_GBps": bw}} for n, bw in ((16, 40.0), (64, 95.0), (256, busbw_256))]
    (tmp_path / "bench-2.json").write_text(json.dumps({"rows": rows}))
    (tmp_path / "probe-2.txt").write_text(
        "".join(f"2 ranks {n * MIB} " + json.dumps({"busbw_GBs": {"ipc": bw, "gloo_cuda": 1.7}}) + "\n"
                for n, bw in ((64, 93.5), (256, probe_256))))
    for name, rates in (("train-warm", gpu_rates), ("train-cpu", [40_000.0, 40_000.0, 40_000.0])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("".join(
            json.dumps({"event": "train", "epoch": i + 1, "samples_per_sec": r}) + "\n" for i, r in enumerate(rates)))


def report(tmp_path):
    result = subprocess.run([sys.executable, REPORT, str(tmp_path)], capture_output=True, text=True, timeout=60)
    lines = {line.split("  ")[0]: line for line in result.stdout.splitlines()}
    return result, lines


def test_the_report_meets_every_target_it_can_see(tmp_path):
    # The first epoch (compiling) is left out of the throughput: 90k, not 10k.
    write_run(tmp_path, busbw_256=160.0, probe_256=179.0, gpu_rates=[10_000.0, 90_000.0, 90_000.0],
              cold_s=14.0, warm_s=11.0)
    result, lines = report(tmp_path)
    assert result.returncode == 0, show(result)
    assert lines["allreduce 256 MiB / probe"].split()[-1] == "yes" and "89.39%" in lines["allreduce 256 MiB / probe"]
    assert "2.25x" in lines["GPU / CPU samples/s"] and lines["GPU / CPU samples/s"].endswith("yes")
    assert "3.0 s" in lines["cold-cache run's compile time (cold wall - warm wall)"]
    assert lines["resume after a stop equals the straight run"].split()[-1] == "-"  # not run here: not met, not missed


def test_the_report_counts_every_miss_and_failed_step(tmp_path):
    write_run(tmp_path, busbw_256=120.0, probe_256=179.0, gpu_rates=[30_000.0, 30_000.0], cold_s=20.0, warm_s=11.0,
              failed_step=True)
    result, lines = report(tmp_path)
    # 256 MiB under 150 GB/s, under 80% of the probe, 0.75x the CPU, 9 s of compiling, and the failed step.
    assert result.returncode == 5, show(result)
    assert lines["step: tests at 2 ranks"].endswith("NO") and lines["allreduce 64 MiB busbw, 2 ranks"].endswith("yes")


def test_the_report_compares_a_resumed_run_with_a_straight_one_bitwise(tmp_path):
    flags = ["--dataset", "digits", "--batch-size", "32", "--no-progress", "--epochs", "2"]
    runs = [flags + ["--resume", "none", "--run-dir", str(tmp_path / "straight")],
            flags + ["--resume", "none", "--max-steps", "30", "--run-dir", str(tmp_path / "resumed")],
            flags + ["--resume", "auto", "--run-dir", str(tmp_path / "resumed")]]
    for args in runs:
        result = mpirun(2, ringtrain("train", *args), timeout=120)
        assert result.returncode == 0, show(result)
    result, lines = report(tmp_path)
    assert lines["resume after a stop equals the straight run"].split()[-2:] == ["bitwise", "yes"], show(result)


def test_on_a_gpu_machine_it_checks_its_dependencies_before_running_anything(tmp_path):
    # A GPU the driver lists, and a CuPy that imports and sees it but has no
    # cuBLAS (cupy-cudaXXx without [ctk]): the preflight must name it and stop.
    bin_dir, py_dir = tmp_path / "bin", tmp_path / "py" / "cupy"
    bin_dir.mkdir()
    py_dir.mkdir(parents=True)
    (bin_dir / "nvidia-smi").write_text('#!/bin/sh\necho "GPU 0: A stand-in GPU (UUID: GPU-0)"\n')
    (bin_dir / "nvidia-smi").chmod(0o755)
    (py_dir / "__init__.py").write_text(
        "import numpy\n__version__ = '0'\nfloat32 = numpy.float32\n"
        "def is_available():\n    return True\n"
        "class _A(numpy.ndarray):\n"
        "    def __matmul__(self, other):\n        raise RuntimeError('CUBLAS_STATUS_NOT_INITIALIZED')\n"
        "def ones(shape, dtype):\n    return numpy.ones(shape, dtype).view(_A)\n")
    # This suite's Python and mpirun, wherever its environment is (the script's default is the clone's .venv).
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", PYTHONPATH=str(tmp_path / "py"),
               RINGTRAIN_ACCEPTANCE_DIR=str(tmp_path / "out"), PYTHON=sys.executable, MPIRUN=find_mpirun())
    result = subprocess.run(["bash", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, show(result)
    lines = result.stdout.splitlines()
    assert lines[0] == "gpu_acceptance: missing:" and "NVRTC and cuBLAS" in lines[1], show(result)
    assert "CUBLAS_STATUS_NOT_INITIALIZED" in lines[1] and len(lines) == 3, show(result)
    assert lines[2].startswith("install: python3 -m venv .venv && .venv/bin/pip install -e '.[mpich,test,mnist,cuda12]")
    assert "===" not in result.stdout + result.stderr and not (tmp_path / "out").exists()  # nothing ran


def test_a_figure_whose_steps_passed_but_left_nothing_to_read_is_missed(tmp_path):
    # The resume row once read "-" (not run) whenever no checkpoint could be
    # loaded, so an acceptance whose three runs passed but saved nothing
    # passed without ever comparing a bit.
    (tmp_path / "steps.tsv").write_text("".join(f"{name}\t0\t9.0\n" for name in (
        "bench at 2 ranks", "straight run", "run stopped at step 50", "the same run resumed")))
    for name in ("straight", "resumed"):
        (tmp_path / name).mkdir()
    result, lines = report(tmp_path)
    assert lines["resume after a stop equals the straight run"].split()[-1] == "NO", show(result)
    assert lines["allreduce 256 MiB busbw, 2 ranks"].split()[-1] == "NO", show(result)
    assert lines["allreduce 256 MiB / probe"].split()[-1] == "-", show(result)  # the probe did not run
    assert result.returncode == 3, show(result)  # both bench rows and the resume row


def test_an_mpi4py_that_cannot_load_its_mpi_library_is_named_before_anything_runs(tmp_path):
    # A bare GPU machine's mpi4py imports, but has no libmpi to load: "import
    # mpi4py" passed the preflight once, and every step then failed.
    bin_dir, py_dir = tmp_path / "bin", tmp_path / "py"
    bin_dir.mkdir()
    (py_dir / "mpi4py").mkdir(parents=True)
    (py_dir / "cupy").mkdir()
    (bin_dir / "nvidia-smi").write_text('#!/bin/sh\necho "GPU 0: A stand-in GPU (UUID: GPU-0)"\n')
    (bin_dir / "nvidia-smi").chmod(0o755)
    (py_dir / "mpi4py" / "__init__.py").write_text("")
    (py_dir / "mpi4py" / "MPI.py").write_text(
        "raise ImportError('libmpi.so.12: cannot open shared object file: No such file or directory')\n")
    (py_dir / "cupy" / "__init__.py").write_text(
        "import numpy\n__version__ = '0'\nfloat32 = numpy.float32\nones = numpy.ones\n"
        "def is_available():\n    return True\n")
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", PYTHONPATH=str(py_dir),
               RINGTRAIN_ACCEPTANCE_DIR=str(tmp_path / "out"))
    result = subprocess.run(["bash", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, show(result)
    named = [line for line in result.stdout.splitlines() if "mpi4py with an MPI library" in line]
    assert named and "libmpi.so.12: cannot open shared object file" in named[0], show(result)
    assert "===" not in result.stdout + result.stderr and not (tmp_path / "out").exists()  # nothing ran

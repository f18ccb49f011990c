"""Runs every file in tests/mpi under real mpirun, at 1, 2, 3 and 4 ranks.

Each (job, size) is one mpirun with a time bound, so a hang fails that job
instead of the whole suite. A job is one file, or the files that share one
heavy import (torch's files, TensorFlow's), run by one pytest per rank: each
rank then imports torch or TensorFlow once instead of once per file, which
is most of those files' time. 4 ranks oversubscribe this 2-core machine on
purpose.
"""

import glob
import importlib.util
import os
import subprocess
import sys

import pytest

from conftest import EVERY_FILE_COLLECTS
from mpirun import ROOT, mpirun, show

FILES = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "tests", "mpi", "test_*.py")))
SIZES = [1, 2, 3, 4]
# Files whose every test needs a GPU: without one, each job would start four
# ranks only to skip everything, so the job itself is skipped, saying why.
GPU_ONLY = {os.path.join("tests", "mpi", name) for name in ("test_gpu.py", "test_cuda_ipc.py")}
# Files whose every test needs torch: skipped the same way where torch is not
# installed (the [test] extra alone), instead of an exit 5 from a file that
# skips itself whole at import.
TORCH_ONLY = {os.path.join("tests", "mpi", f"test_{name}.py")
              for name in ("elastic", "torch_ops", "torch_process_sets", "torch_interop", "torch_model",
                           "torch_optimizer", "keras_torch")}
# Files whose every test needs tensorflow (the [tensorflow] extra): skipped the same way without it.
TF_ONLY = {os.path.join("tests", "mpi", f"test_{name}.py") for name in ("tf_ops", "tf_keras")}
# Files for ringtrain.keras on Keras 3's other backends: each needs keras and its backend's package
# (jax is in no extra), and is skipped the same way without them.
KERAS_BACKEND_FILES = {os.path.join("tests", "mpi", "test_keras_torch.py"): ("keras", "torch"),
                       os.path.join("tests", "mpi", "test_keras_jax.py"): ("keras", "jax")}


# Files run together, in one pytest per rank (the jobs' ids name them). Not the Keras backend files:
# Keras reads KERAS_BACKEND once per process. Not the elastic file: its ranks leave and rejoin.
SHARED = {"torch": [os.path.join("tests", "mpi", f"test_{name}.py")
                    for name in ("torch_ops", "torch_process_sets", "torch_interop", "torch_model", "torch_optimizer")],
          "tensorflow": [os.path.join("tests", "mpi", f"test_{name}.py") for name in ("tf_ops", "tf_keras")]}
JOBS = (dict(SHARED)
        | {os.path.basename(p)[5:-3]: [p] for p in FILES if not any(p in paths for paths in SHARED.values())})


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("job", sorted(JOBS))
def test_under_mpirun(job, size):
    paths = JOBS[job]
    _skip_where_missing(paths)
    # Hypothesis's pytest plugin imports all of Hypothesis on every rank; no file here uses it.
    result = mpirun(size, [sys.executable, "-m", "pytest", "--with-mpi", "-q", "-p", "no:cacheprovider",
                           "-p", "no:hypothesispytest", "-x", *paths], timeout=300,
                    env=dict(os.environ, **{EVERY_FILE_COLLECTS: "1"}))
    # Exit 5 ("no tests collected", from any one file of the job: tests/conftest.py) fails too: every
    # file has tests at every size (pytest-mpi skips, rather than drops, those that need more ranks),
    # so a file that stops collecting has lost its tests.
    assert result.returncode == 0, show(result)


def _skip_where_missing(paths):
    """Skip the job, saying why, where something every test in its files needs is missing."""
    files = ", ".join(os.path.basename(p) for p in paths)
    if any(p in GPU_ONLY for p in paths) and not _gpu_available():
        pytest.skip(f"no CUDA GPU visible to CuPy on this machine: every test in {files} needs one")
    if any(p in TORCH_ONLY for p in paths) and importlib.util.find_spec("torch") is None:
        pytest.skip(f"torch is not installed (pip install torch==2.13.0): every test in {files} needs it")
    if any(p in TF_ONLY for p in paths) and importlib.util.find_spec("tensorflow") is None:
        pytest.skip(f"tensorflow is not installed (pip install tensorflow-cpu==2.21.0): every test in {files} "
                    "needs it")
    needed = [name for p in paths for name in KERAS_BACKEND_FILES.get(p, ())]
    missing = [name for name in needed if importlib.util.find_spec(name) is None]
    if missing:
        pytest.skip(f"{' and '.join(missing)} not installed (pip install {' '.join(missing)}): every test in "
                    f"{files} needs {' and '.join(needed)}")


def _gpu_available():
    from ringtrain import backend

    return backend.gpu_available()


def test_files_that_skip_whole_without_torch_are_torch_only():
    # CI always installs torch, so an unlisted file that skips itself at import
    # would only fail (exit 5) for a user of the [test] extra alone.
    for path in FILES:
        with open(os.path.join(ROOT, path)) as fh:
            skips_whole = 'importorskip("torch"' in fh.read()
        assert not skips_whole or path in TORCH_ONLY, f"{path} skips whole without torch: add it to TORCH_ONLY"


def test_files_that_skip_whole_without_tensorflow_are_tf_only():
    for path in FILES:
        with open(os.path.join(ROOT, path)) as fh:
            skips_whole = 'importorskip("tensorflow"' in fh.read()
        assert skips_whole == (path in TF_ONLY), f"{path}: importorskip('tensorflow') and TF_ONLY must agree"


def test_every_file_runs_in_exactly_one_job_and_shared_jobs_need_the_same_thing():
    ran = sorted(p for paths in JOBS.values() for p in paths)
    assert ran == FILES, "a file in tests/mpi runs in no job, or in two"
    for name, paths in SHARED.items():
        needs = {(p in TORCH_ONLY, p in TF_ONLY, p in GPU_ONLY, p in KERAS_BACKEND_FILES) for p in paths}
        assert len(needs) == 1, f"the {name} job mixes files that need different things: one would skip the other"
        alone = [p for p in paths if p in KERAS_BACKEND_FILES or os.path.basename(p) == "test_elastic.py"]
        assert not alone, f"{alone} must run in a process of their own (see SHARED)"


def test_a_file_skipped_at_import_fails_the_job_it_shares(tmp_path):
    # The job's pytest, without MPI: tests/conftest.py loaded as a plugin, two files, one skipped whole.
    (tmp_path / "test_kept.py").write_text("def test_kept():\n    pass\n")
    (tmp_path / "test_gone.py").write_text('import pytest\n\npytest.importorskip("no_such_module_anywhere")\n\n\n'
                                           'def test_gone():\n    pass\n')
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:hypothesispytest",
               "-p", "conftest", "test_kept.py", "test_gone.py"]
    env = {k: v for k, v in os.environ.items() if k != EVERY_FILE_COLLECTS}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.join(ROOT, "tests"), env.get("PYTHONPATH")]))
    shared = subprocess.run(command, cwd=tmp_path, env={**env, EVERY_FILE_COLLECTS: "1"}, capture_output=True,
                            text=True, timeout=120)
    assert shared.returncode == 5, shared.stdout + shared.stderr
    assert "no tests collected from" in shared.stdout + shared.stderr and "test_gone.py" in shared.stdout
    alone = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert alone.returncode == 0, alone.stdout + alone.stderr  # what pytest does by itself: the file unseen


def test_files_for_keras_backends_name_their_backend():
    # Keras reads KERAS_BACKEND once, at its first import: a file for a backend sets it at its top.
    for path, (_, backend) in KERAS_BACKEND_FILES.items():
        with open(os.path.join(ROOT, path)) as fh:
            assert f'os.environ["KERAS_BACKEND"] = "{backend}"' in fh.read(), path

"""The GPU path's pure pieces, checked without CuPy or a GPU.

The rank-order kernel's CUDA source is evaluated here by translating its C into Python: the same
statements in the same order, on NumPy scalars, against NumPy's own
``minimum``/``maximum``/``add`` folded over the ranks in rank order.
"""

import functools
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from ringtrain.backend import rank_order_source
from ringtrain.comm.transports.cuda_ipc import describe_refusal

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_source(body, operands):
    """Evaluate the kernel body (``T a = x0; a = (c) ? a : x1; ... y = a;``) on NumPy scalars."""
    py = body.replace("T a = ", "a = ").replace("||", " or ")
    py = re.sub(r"\(([^()]*)\) \? a : (x\d+);", r"a if (\1) else \2;", py)
    namespace = {f"x{i}": v for i, v in enumerate(operands)}
    for statement in filter(None, (s.strip() for s in py.split(";"))):
        exec(statement, {}, namespace)  # noqa: S102 - our own generated source, in a test
    return namespace["y"]


@pytest.mark.parametrize("combine", ["add", "minimum", "maximum"])
def test_the_source_grows_linearly_with_the_rank_count(combine):
    # It used to paste the running expression four times per rank: 202 KB at 8 ranks, 52 MB at 12.
    lengths = [len("".join(rank_order_source(n, combine))) for n in (2, 4, 8, 16, 64)]
    per_rank = (lengths[-1] - lengths[0]) / 62
    assert all(length < 40 + 60 * n for length, n in zip(lengths, (2, 4, 8, 16, 64)))
    assert lengths == sorted(lengths) and per_rank < 60


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("combine", ["minimum", "maximum"])
def test_min_and_max_follow_numpy_with_nan_in_rank_order(combine, n):
    rng = np.random.default_rng(n)
    for trial in range(20):
        operands = list(rng.standard_normal(n).astype(np.float32))
        if trial % 3 == 0:
            operands[rng.integers(n)] = np.float32("nan")
        want = functools.reduce(getattr(np, combine), operands)
        got = run_source(rank_order_source(n, combine)[1], operands)
        assert np.array_equal(np.float32(got), np.float32(want), equal_nan=True)


def test_the_sum_adds_left_to_right():
    inputs, body = rank_order_source(4, "add")
    assert inputs == "T x0, T x1, T x2, T x3" and body == "y = x0 + x1 + x2 + x3;"


@pytest.mark.parametrize("name", ["multiply", "cupy_add", "max"])
def test_any_other_combine_is_an_error_not_a_silent_max(name):
    with pytest.raises(ValueError, match=f"unknown combine '{name}'; choose one of add, maximum, minimum"):
        rank_order_source(3, name)


def test_a_cuda_ipc_refusal_names_every_rank_that_failed_and_what_follows():
    line = describe_refusal([None, "CUDARuntimeError: cudaErrorMapBufferObjectFailed", None, "OutOfMemoryError: x"])
    assert line.startswith("CUDA IPC is unavailable (rank 1: CUDARuntimeError: cudaErrorMapBufferObjectFailed; "
                           "rank 3: OutOfMemoryError: x); GPU allreduces stage through pinned host memory")
    assert "\n" not in line


def test_a_cpu_run_never_imports_cupy(tmp_path):
    # Importing CuPy loads the CUDA libraries (0.5-1 s per rank). A stand-in
    # cupy package on the path records whether anything imports it.
    marker = tmp_path / "imported"
    (tmp_path / "cupy").mkdir()
    (tmp_path / "cupy" / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\n"
                                                   "raise ImportError('a stand-in, not CuPy')\n")
    program = ("import numpy as np\n"
               "import ringtrain, ringtrain.cli, ringtrain.comm, ringtrain.training.loop\n"
               "from ringtrain import backend\n"
               "x = np.ones(3)\n"
               "assert not backend.is_gpu_array(x) and backend.get_array_module(x) is np\n"
               "backend.synchronize(x); backend.use_device(None)\n"
               "import os; print(os.path.exists({!r}))\n"
               "print(backend.gpu_available(), os.path.exists({!r}))\n").format(str(marker), str(marker))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), ROOT]))
    out = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    # Nothing imported it on the CPU path; asking for a GPU does (so the stand-in was on the path).
    assert out.stdout.split() == ["False", "False", "True"]


@pytest.mark.parametrize("extra, package", [("cuda12", "cupy-cuda12x"), ("cuda13", "cupy-cuda13x")])
def test_the_cuda_extras_bring_the_toolkit_libraries(extra, package):
    # cupy-cudaXXx alone imports and sees the GPU, then fails at the first
    # kernel compile (NVRTC) or matrix product (cuBLAS) on a bare machine.
    import configparser

    config = configparser.ConfigParser()
    config.read(os.path.join(ROOT, "setup.cfg"))
    requirements = config["options.extras_require"][extra].split()
    assert requirements == [f"{package}[ctk]>=14"]


@pytest.mark.parametrize("env, local", [({"MPI_LOCALRANKID": "3"}, 3), ({"OMPI_COMM_WORLD_LOCAL_RANK": "1"}, 1),
                                        ({"SLURM_LOCALID": "2", "PMI_RANK": "7"}, 2), ({"PMI_RANK": "7"}, None),
                                        ({"MPI_LOCALRANKID": ""}, None)])
def test_the_local_rank_is_known_before_mpi_starts(env, local):
    # A CUDA-aware MPI may set up CUDA on the current device in MPI_Init: the
    # device is chosen from the launcher's local rank before mpi4py is imported.
    from ringtrain.cluster.launch import local_rank_from_env

    assert local_rank_from_env(env) == local


@pytest.mark.parametrize("argv, gpu", [(["train", "--device", "gpu"], True),
                                       (["bench", "allreduce", "--device=gpu"], True),
                                       (["train", "--device", "cpu"], False), (["train", "--dataset", "gpu"], False),
                                       (["train", "--device"], False), ([], False)])
def test_a_gpu_run_is_recognised_from_its_command_line(argv, gpu):
    from ringtrain.cli import wants_gpu

    assert wants_gpu(argv) is gpu


def test_a_cpu_command_line_chooses_no_device_before_mpi(tmp_path):
    # Even with a launcher's local rank set, a CPU run must not import CuPy (the stand-in would record it).
    marker = tmp_path / "imported"
    (tmp_path / "cupy").mkdir()
    (tmp_path / "cupy" / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\n"
                                                   "raise ImportError('a stand-in, not CuPy')\n")
    program = "from ringtrain import cli\ncli._device_before_mpi(['train', '--device', 'cpu'])\n"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), ROOT]), MPI_LOCALRANKID="1")
    out = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and not marker.exists(), out.stderr

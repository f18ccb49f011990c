"""ringtrain.keras on Keras 3's torch backend (``KERAS_BACKEND=torch``), which Horovod never served.

Run at 1, 2, 3 and 4 ranks by tests/test_mpi_suite.py; the tests are
tests/keras_backend_cases.py's. ``fit`` runs eagerly (Keras's default on
torch) and under ``torch.compile`` (``jit_compile=True``), where the
reduction is a graph break. Skipped where torch or keras is not installed.
"""

import os

os.environ["KERAS_BACKEND"] = "torch"  # before Keras is first imported: it reads the backend once

import pytest  # noqa: E402
from mpi4py import MPI  # noqa: E402

pytest.importorskip("torch", reason="torch is not installed (pip install torch==2.13.0)")

from keras_backend_cases import use  # noqa: E402

use("torch", "torch")

from keras_backend_cases import (fit_equals_one_process, runtime,  # noqa: E402,F401 - the tests and their fixture
                                 test_load_model_keeps_the_state_and_averages_again,
                                 test_metric_average_and_learning_rate_callbacks,
                                 test_the_broadcast_callback_makes_every_rank_start_from_rank_0,
                                 test_values_reduce_gather_and_broadcast_as_numpy_says)


@pytest.mark.mpi
@pytest.mark.parametrize("name, compiled", [("SGD", False), ("Adam", False), ("SGD", True)],
                         ids=["SGD", "Adam", "SGD-torch.compile"])
def test_fit_on_n_ranks_equals_one_process_on_the_whole_batch(runtime, name, compiled):
    if compiled and MPI.COMM_WORLD.Get_size() != 2:
        pytest.skip("torch.compile's first step takes minutes here; 2 ranks show the graph break at the reduction")
    fit_equals_one_process(runtime, name, compiled)

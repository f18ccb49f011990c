"""ringtrain.keras on Keras 3's JAX backend (``KERAS_BACKEND=jax``), which Horovod never served.

Run at 1, 2, 3 and 4 ranks by tests/test_mpi_suite.py; the tests are
tests/keras_backend_cases.py's. ``fit`` runs its step under ``jax.jit``
(Keras's default on JAX: the reduction is an ordered host callback in the
compiled step) and eagerly (``jit_compile=False``). Skipped where jax or
keras is not installed (jax is in no extra: docs/tensorflow.md says why).
"""

import os

os.environ["KERAS_BACKEND"] = "jax"  # before Keras is first imported: it reads the backend once

import pytest  # noqa: E402

from keras_backend_cases import use  # noqa: E402

use("jax", "jax")

from keras_backend_cases import (fit_equals_one_process, runtime,  # noqa: E402,F401 - the tests and their fixture
                                 test_load_model_keeps_the_state_and_averages_again,
                                 test_metric_average_and_learning_rate_callbacks,
                                 test_the_broadcast_callback_makes_every_rank_start_from_rank_0,
                                 test_values_reduce_gather_and_broadcast_as_numpy_says)


@pytest.mark.mpi
@pytest.mark.parametrize("name, compiled", [("SGD", True), ("Adam", True), ("Adam", False)],
                         ids=["SGD-jit", "Adam-jit", "Adam-eager"])
def test_fit_on_n_ranks_equals_one_process_on_the_whole_batch(runtime, name, compiled):
    fit_equals_one_process(runtime, name, compiled)

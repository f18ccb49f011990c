"""ringtrain.keras on Keras 2 (tf-keras, ``TF_USE_LEGACY_KERAS=1``): the Keras 3 checks, run again at 2 ranks.

tests/mpi/test_tf_keras.py runs under tests/test_mpi_suite.py with Keras 3;
the Keras flavour is chosen once per process, so this runs the same file in
a job of its own with Keras 2. Skipped without tensorflow or tf-keras.
"""

import importlib.util
import os
import sys

import pytest

import mpirun
from mpirun import ROOT, show

pytest.importorskip("tensorflow", reason="tensorflow is not installed (pip install tensorflow-cpu==2.21.0)")


def test_keras_2_trains_on_n_ranks_as_one_process_on_the_whole_batch():
    if importlib.util.find_spec("tf_keras") is None:
        pytest.skip("tf-keras is not installed (pip install tf-keras==2.21.0)")
    path = os.path.join(ROOT, "tests", "mpi", "test_tf_keras.py")
    result = mpirun.mpirun(2, [sys.executable, "-m", "pytest", "--with-mpi", "-q", "-p", "no:cacheprovider",
                               "-p", "no:hypothesispytest", "-x", path],
                           timeout=300, env=mpirun.test_env(TF_USE_LEGACY_KERAS="1"))
    assert result.returncode == 0, show(result)
    assert "14 passed" in result.stdout, show(result)

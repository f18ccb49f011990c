"""--standardize on a user's .npz whose columns differ by 1e6 in scale, as users run it."""

import os

import numpy as np
import pytest
from mpi4py import MPI

from mpirun import mpirun, ringtrain as rt, show
from ringtrain.io.checkpoint import read_checkpoint


@pytest.fixture(scope="module")
def wild(tmp_path_factory):
    """600 rows, two classes split by a linear rule, columns scaled by 1e-3 to 1e3."""
    rng = np.random.default_rng(7)
    z = rng.normal(size=(600, 6))
    y = (z @ np.array([1.0, -2.0, 0.5, 1.5, -1.0, 0.7]) > 0).astype(np.int64)
    x = (z * np.array([1e-3, 1e-2, 1.0, 10.0, 1e2, 1e3]) + np.array([0, 0, 0, 5e3, 0, 1e4])).astype(np.float32)
    path = tmp_path_factory.mktemp("data") / "wild.npz"
    np.savez(path, x=x, y=y)
    return str(path)


def command(data, run_dir, *flags):
    return rt("train", "--dataset", data, "--hidden", "16", "--epochs", "8", "--lr", "0.05", "--batch-size", "16",
              "--run-dir", str(run_dir), "--no-progress", *flags)


def scaling(run_dir):
    ckpts = sorted(os.listdir(run_dir / "checkpoints"))
    arrays, meta = read_checkpoint(str(run_dir / "checkpoints" / ckpts[-1]))
    return arrays["scale/mean"], arrays["scale/std"], meta["eval"]["accuracy"]


def test_raw_features_of_many_magnitudes_are_warned_about(wild, tmp_path):
    result = mpirun(2, command(wild, tmp_path / "raw"), timeout=120)
    assert result.returncode == 0, show(result)
    warnings = [line for line in result.stderr.splitlines() if "orders of magnitude" in line]
    assert len(warnings) == 1 and warnings[0].startswith("ringtrain: warning: features span 6 orders"), show(result)
    assert "add --standardize" in warnings[0]


def test_standardized_statistics_are_bitwise_the_same_at_1_and_3_ranks(wild, tmp_path):
    found = {}
    for ranks in (1, 3):
        result = mpirun(ranks, command(wild, tmp_path / f"r{ranks}", "--standardize"), timeout=120)
        assert result.returncode == 0, show(result)
        assert "orders of magnitude" not in result.stderr, show(result)
        found[ranks] = scaling(tmp_path / f"r{ranks}")
    (mean1, std1, acc1), (mean3, std3, acc3) = found[1], found[3]
    assert np.array_equal(mean1, mean3) and np.array_equal(std1, std3)
    assert min(acc1, acc3) >= 0.9, found
    # The statistics are the training rows' (not the held-out ones'), as float64 computes them.
    from ringtrain.data.load import load_sharded

    x = load_sharded(wild, MPI.COMM_SELF).x.astype(np.float64)
    assert np.all(np.abs(mean1 - x.mean(axis=0)) <= 1e-12 * np.abs(x).max(axis=0)), (mean1, x.mean(axis=0))
    np.testing.assert_allclose(std1, x.std(axis=0), rtol=1e-9)

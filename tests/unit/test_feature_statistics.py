"""--standardize's statistics: exact, so the same bits whatever the rows' split over ranks."""

import numpy as np
import pytest
from mpi4py import MPI

from ringtrain.data.standardize import (feature_statistics, fixed_point_sum, grid_exponents, spread_warning)


def wild_columns(rows=1000, seed=0):
    rng = np.random.default_rng(seed)
    scales = np.array([1e-3, 1.0, 1e3, 1e6], np.float32)
    return (rng.normal(size=(rows, 4)).astype(np.float32) * scales + scales).astype(np.float32)


def test_fixed_point_sums_do_not_depend_on_how_rows_are_split():
    x = wild_columns().astype(np.float64)
    k = grid_exponents(np.abs(x).max(axis=0), len(x))
    whole = fixed_point_sum(x, k)
    for parts in (2, 3, 7):
        pieces = sum(fixed_point_sum(piece, k) for piece in np.array_split(x, parts))
        assert np.array_equal(pieces, whole)


def test_grid_keeps_int64_sums_in_range():
    largest = np.array([0.0, 1e-30, 1.0, 3e38])
    k = grid_exponents(largest, 10**6)
    assert k[0] == 0
    assert np.all(np.ldexp(largest[1:], k[1:]) * 10**6 < 2.0**63)


def test_statistics_match_float64_reference():
    x = wild_columns()
    scaling = feature_statistics(x, len(x), MPI.COMM_SELF)
    reference = x.astype(np.float64)
    np.testing.assert_allclose(scaling.mean, reference.mean(axis=0), rtol=1e-12)
    np.testing.assert_allclose(scaling.std, reference.std(axis=0), rtol=1e-9)
    scaled = scaling.apply(x)
    assert scaled.dtype == np.float32
    np.testing.assert_allclose(scaled.mean(axis=0), 0, atol=1e-5)
    np.testing.assert_allclose(scaled.std(axis=0), 1, rtol=1e-4)


def test_constant_feature_is_centred_not_divided_by_zero():
    x = np.ones((10, 2), np.float32)
    x[:, 1] = np.arange(10)
    scaling = feature_statistics(x, 10, MPI.COMM_SELF)
    assert scaling.std[0] == 1.0 and np.all(scaling.apply(x)[:, 0] == 0)


@pytest.mark.parametrize("largest, warns", [([1.0, 1e6], True), ([0.01, 5.0], False), ([0.0, 1e9], False),
                                            ([1.0 / 255, 1.0], False)])
def test_warning_when_scales_span_orders_of_magnitude(largest, warns):
    line = spread_warning(np.array(largest))
    assert (line is not None) == warns
    if warns:
        assert line.startswith("features span 6 orders of magnitude") and "--standardize" in line

"""The shared-memory window's rounds, run among N simulated ranks without MPI.

Every rank's slot is a plain NumPy array here, and each "sync" is the point
between two loops over the ranks, so a whole allreduce of
:class:`~ringtrain.comm.transports.shm.WindowTransport` (publish, reduce in
rank order, gather) runs from its pure pieces. The reference is the
left-to-right sum over ranks, which the window promises bitwise.
"""

import functools

import numpy as np
import pytest

from ringtrain.comm.transports.shm import (gather_piece, piece_bounds, publish_others, region_views, round_plan,
                                           sum_in_rank_order)


def simulated_allreduce(inputs, half_bytes, combine=np.add, out_of_place=False):
    """Every rank's result of the window's fused allreduce over ``inputs`` (one array per rank).

    ``out_of_place``: each rank reads its input where it is and writes only
    its output (as ``WindowTransport.allreduce(x, source=...)``): the inputs
    are then checked untouched.
    """
    size = len(inputs)
    sources = list(inputs) if out_of_place else [x.copy() for x in inputs]
    xs = [np.full_like(x, np.nan) for x in inputs] if out_of_place else sources
    dtype, n = xs[0].dtype, xs[0].size
    bounds, piece, rounds = round_plan(n, dtype.itemsize, size, half_bytes)
    slots = [np.full(2 * half_bytes, 0xAB, np.uint8) for _ in range(size)]  # garbage, not zeros
    for k in range(rounds):
        regions = region_views(slots, k % 2, half_bytes, dtype)
        for r in range(size):
            publish_others(sources[r], regions[r], bounds, k, piece, r)
        for r in range(size):  # after the first sync
            a, b = piece_bounds(bounds, r, k, piece)
            mine = [regions[peer][r][:b - a] for peer in range(size)]  # every rank's values of my piece
            sum_in_rank_order(xs[r][a:b], mine.__getitem__, r, size, combine, np.empty(b - a, dtype),
                              sources[r][a:b] if out_of_place else None)
            regions[r][r][:b - a] = xs[r][a:b]
        for r in range(size):  # after the second sync
            gather_piece(xs[r], regions, bounds, k, piece, r)
    return xs, rounds


@pytest.mark.parametrize("out_of_place", [False, True], ids=["in-place", "out-of-place"])
@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("n, half_bytes", [(0, 4096), (1, 4096), (7, 4096), (1000, 4096), (5003, 2048)])
def test_the_rounds_sum_every_element_in_rank_order_bitwise(size, n, half_bytes, out_of_place):
    rng = np.random.default_rng(n + size)
    inputs = [rng.standard_normal(n).astype(np.float32) * 10.0 ** rng.integers(-3, 4, n) for _ in range(size)]
    kept = [x.copy() for x in inputs]
    got, rounds = simulated_allreduce(inputs, half_bytes, out_of_place=out_of_place)
    want = functools.reduce(np.add, inputs[1:], inputs[0].copy())  # rank 0 + rank 1 + ..., left to right
    assert all(np.array_equal(g, want) for g in got)
    assert all(np.array_equal(x, k) for x, k in zip(inputs, kept))
    if n * 4 > half_bytes:
        assert rounds > 1  # the case where pieces, not whole chunks, go round


@pytest.mark.parametrize("combine", [np.minimum, np.maximum])
def test_min_and_max_propagate_nan_as_numpy_does(combine):
    inputs = [np.array([1.0, np.nan, 3.0, -1.0]), np.array([2.0, 0.0, np.nan, -2.0]), np.array([0.5, 5.0, 1.0, 9.0])]
    got, _ = simulated_allreduce(inputs, 4096, combine)
    want = functools.reduce(combine, inputs[1:], inputs[0].copy())
    assert all(np.array_equal(g, want, equal_nan=True) for g in got)


def test_sum_in_rank_order_keeps_the_order_whoever_owns_the_chunk():
    # float32 addition is not associative: only the same order gives the same bits.
    values = [np.float32(1e8), np.float32(1.0), np.float32(-1e8), np.float32(1.0)]
    want = ((values[0] + values[1]) + values[2]) + values[3]
    for rank in range(4):
        chunk = np.array([values[rank]])
        sum_in_rank_order(chunk, lambda peer: np.array([values[peer]]), rank, 4, np.add, np.empty(1, np.float32))
        assert chunk[0] == want

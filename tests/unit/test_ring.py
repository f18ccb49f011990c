"""The ring's index maths and schedules, checked by simulating every rank in one process."""

import numpy as np
import pytest

from ringtrain.comm.buckets import plan_buckets
from ringtrain.commands.bench import message_sizes, parse_bytes
from ringtrain.errors import UsageError
from ringtrain.comm.schedule import chunk_bounds, doubling_schedule, ring_schedule, segments

SIZES = range(1, 10)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("n", [0, 1, 2, 3, 7, 8, 100, 101])
def test_chunk_bounds_cover_and_balance(n, size):
    bounds = chunk_bounds(n, size)
    lengths = np.diff(bounds)
    assert bounds[0] == 0 and bounds[-1] == n and len(bounds) == size + 1
    assert (lengths >= 0).all() and lengths.max() - lengths.min() <= 1
    assert list(lengths) == sorted(lengths, reverse=True)


@pytest.mark.parametrize("args", [(5, 0), (-1, 2)])
def test_chunk_bounds_rejects_bad_arguments(args):
    with pytest.raises(ValueError):
        chunk_bounds(*args)


@pytest.mark.parametrize("size", SIZES)
def test_ring_schedule_sums_every_chunk_once_then_shares_it(size):
    # Each rank's chunks as the set of ranks whose data they contain.
    held = [[{r} for _ in range(size)] for r in range(size)]
    schedules = [ring_schedule(r, size) for r in range(size)]
    for phase in (0, 1):
        for step in range(size - 1):
            sent = {}
            for r in range(size):
                send_chunk, _ = schedules[r][phase][step]
                sent[(r + 1) % size] = (send_chunk, set(held[r][send_chunk]))
            for r in range(size):
                _, recv_chunk = schedules[r][phase][step]
                chunk, value = sent[r]
                assert chunk == recv_chunk  # the left neighbour sends what I expect
                if phase == 0:
                    assert not held[r][chunk] & value  # each contribution added exactly once
                    held[r][chunk] |= value
                else:
                    held[r][chunk] = value
        if phase == 0:
            for r in range(size):
                assert held[r][(r + 1) % size] == set(range(size))
    assert all(chunk == set(range(size)) for r in range(size) for chunk in held[r])


def _simulate_doubling(size):
    """Run every rank's doubling schedule with message queues; return each rank's final set."""
    value = [frozenset([r]) for r in range(size)]
    steps = [doubling_schedule(r, size) for r in range(size)]
    where = [0] * size
    posted = [False] * size
    queue = {}
    progress = True
    while progress:
        progress = False
        for r in range(size):
            if where[r] == len(steps[r]):
                continue
            kind, peer = steps[r][where[r]]
            if kind in ("send", "exchange", "unfold") and not posted[r]:
                queue.setdefault((r, peer), []).append(value[r])
                posted[r] = True
                progress = True
                if kind == "unfold":
                    where[r] += 1
                    posted[r] = False
                    continue
            if kind in ("send", "recv", "exchange") and queue.get((peer, r)):
                got = queue[(peer, r)].pop(0)
                if kind == "send":
                    value[r] = got
                else:
                    assert not value[r] & got
                    value[r] = value[r] | got
                where[r] += 1
                posted[r] = False
                progress = True
    assert where == [len(s) for s in steps], "deadlock"
    assert not any(queue.values()), "unreceived messages"
    return value


@pytest.mark.parametrize("size", range(1, 17))
def test_doubling_schedule_reaches_everyone(size):
    assert all(v == set(range(size)) for v in _simulate_doubling(size))


def test_doubling_rounds_are_logarithmic():
    assert [len(doubling_schedule(0, n)) for n in (1, 2, 4, 8)] == [0, 1, 2, 3]
    assert doubling_schedule(0, 3) == [("send", 1)]
    assert doubling_schedule(1, 3) == [("recv", 0), ("exchange", 2), ("unfold", 0)]


def test_segments():
    assert segments(3, 10, 4) == [(3, 7), (7, 10)]
    assert segments(5, 5, 4) == []
    with pytest.raises(ValueError):
        segments(0, 1, 0)


def test_plan_buckets_keeps_order_and_splits_on_dtype_and_size():
    arrays = [np.zeros(10, np.float32), np.zeros(10, np.float32), np.zeros(100, np.float32),
              np.zeros(3, np.float64), np.zeros(2, np.float32)]
    assert plan_buckets(arrays, 80) == [[0, 1], [2], [3], [4]]
    assert plan_buckets(arrays, 10_000) == [[0, 1, 2], [3], [4]]
    assert plan_buckets([], 8) == []
    with pytest.raises(ValueError):
        plan_buckets(arrays, 0)


def test_bench_sizes():
    assert parse_bytes("4K") == 4096 and parse_bytes("256M") == 256 << 20 and parse_bytes("100") == 100
    assert parse_bytes("1GiB") == 1 << 30
    with pytest.raises(UsageError, match="expected a number of bytes"):
        parse_bytes("lots")
    assert message_sizes(4096, 32768) == [4096, 8192, 16384, 32768]

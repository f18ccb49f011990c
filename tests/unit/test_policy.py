"""The size policy, the transport registry and the window's round plan: pure, without ranks."""

import pytest

from ringtrain.comm.policy import RING_BYTES, SMALL_BYTES, WINDOW_BYTES, choose_transport, transport_choice
from ringtrain.comm.schedule import chunk_bounds
from ringtrain.comm.transports import TRANSPORTS, create_transport
from ringtrain.comm.transports.shm import HALF_BYTES, ROUND_BYTES, piece_bounds, round_plan

FITS, BIG = WINDOW_BYTES - 4096, max(WINDOW_BYTES, RING_BYTES) + 1


@pytest.mark.parametrize("algorithm, nbytes, one_host, gpu, expected", [
    ("auto", SMALL_BYTES, True, False, "shm"),
    ("auto", FITS, True, False, "shm"),
    ("auto", BIG, True, False, "ring"),       # past the window's cap
    ("auto", SMALL_BYTES, False, False, "mpi"),  # across hosts, latency-bound: MPI's own collectives
    ("auto", BIG, False, False, "ring"),
    ("auto", SMALL_BYTES, True, True, "cuda-ipc"),  # the peer window on GPUs, at any size
    ("auto", BIG, True, True, "cuda-ipc"),
    ("auto", SMALL_BYTES, False, True, "mpi"),      # across hosts: staged, or on device with CUDA-aware MPI
    ("ring", BIG, True, True, "ring"),
    ("ring", SMALL_BYTES, True, False, "ring"),
    ("mpi", BIG, True, False, "mpi"),
    ("shm", BIG, True, False, "shm"),         # forced: any size, in rounds
    ("shm", SMALL_BYTES, False, False, None),
    ("shm", BIG, True, True, "cuda-ipc"),
    ("shm", SMALL_BYTES, False, True, None),
    ("hierarchical", SMALL_BYTES, False, False, "hierarchical"),
])
def test_choose_transport(algorithm, nbytes, one_host, gpu, expected):
    assert choose_transport(algorithm, nbytes, one_host, gpu) == expected


def test_every_choice_is_a_registered_transport():
    for algorithm in ("auto", "ring", "mpi", "hierarchical", "shm"):
        for nbytes in (0, SMALL_BYTES, FITS, BIG):
            for gpu in (False, True):
                assert choose_transport(algorithm, nbytes, one_host=True, gpu=gpu) in TRANSPORTS


def test_unknown_names_list_the_known_ones():
    from mpi4py import MPI

    with pytest.raises(ValueError, match="unknown transport 'bogus'; choose one of auto, ring"):
        choose_transport("bogus", 10, True)
    with pytest.raises(ValueError, match=r"unknown transport 'bogus'; choose one of .*mpi.*ring.*shm"):
        create_transport("bogus", MPI.COMM_SELF)


@pytest.mark.parametrize("size", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("n, itemsize", [(0, 4), (1, 4), (10, 8), (100_003, 4), (3 * HALF_BYTES // 4 + 17, 4),
                                         (5 * HALF_BYTES // 8 + 3, 8)])
def test_round_plan_covers_each_chunk_once(n, itemsize, size):
    bounds, piece, rounds = round_plan(n, itemsize, size)
    assert bounds == chunk_bounds(n, size)
    for owner in range(size):
        covered = [piece_bounds(bounds, owner, k, piece) for k in range(rounds)]
        assert all(b - a <= piece for a, b in covered)
        assert sum(b - a for a, b in covered) == bounds[owner + 1] - bounds[owner]
        assert [a for a, _ in covered] == sorted(a for a, _ in covered)


def test_a_buffer_that_fits_one_half_goes_in_one_round_and_a_larger_one_in_cache_sized_rounds():
    assert round_plan(HALF_BYTES // 8, 4, 2)[2] == 1
    bounds, piece, rounds = round_plan(HALF_BYTES, 4, 2)
    assert piece * 4 * 2 <= ROUND_BYTES and rounds == -(-(bounds[1] - bounds[0]) // piece) > 1


@pytest.mark.parametrize("local_size, hosts", [(1, 1), (2, 1), (1, 3), (2, 2), (3, 2), (4, 3)])
@pytest.mark.parametrize("n", [0, 1, 5, 1009])
def test_two_level_spans_tile_the_buffer(n, local_size, hosts):
    from ringtrain.comm.transports.hierarchical import owned_span

    spans = sorted(owned_span(n, local_size, chunk, hosts, h) for chunk in range(local_size) for h in range(hosts))
    assert spans[0][0] == 0 and spans[-1][1] == n
    assert all(spans[i][1] == spans[i + 1][0] for i in range(len(spans) - 1))


def test_transport_is_the_word_and_algorithm_a_deprecated_alias():
    assert transport_choice("ring", None, "allreduce") == "ring"
    with pytest.warns(DeprecationWarning, match="allreduce: algorithm= is deprecated; use transport='mpi'"):
        assert transport_choice("auto", "mpi", "allreduce") == "mpi"
    with pytest.raises(TypeError, match="got transport='ring' and algorithm='mpi'; pass transport= only"):
        with pytest.warns(DeprecationWarning):
            transport_choice("ring", "mpi", "allreduce")


def test_a_device_never_gets_the_numpy_only_window():
    # The window is host memory written with NumPy: GPU buffers on one host go to CUDA IPC instead.
    for choice in ("auto", "shm"):
        for nbytes in (SMALL_BYTES + 1, FITS, BIG):
            assert choose_transport(choice, nbytes, one_host=True, gpu=True) == "cuda-ipc"
    assert choose_transport("shm", FITS, one_host=True, gpu=False) == "shm"

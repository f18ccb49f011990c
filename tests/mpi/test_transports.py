"""Every transport behind the one interface, against MPI's own Allreduce and against itself.

Runs at 1, 2, 3 and 4 ranks. What the sharded step relies on is checked
here once for every transport: the allreduce is bitwise its own
reduce-scatter followed by its allgather, the chunk a rank owns after the
reduce-scatter holds that chunk's reduction, and every rank ends with the
same bits. Each test finishes its collectives before it asserts.
"""

import contextlib

import numpy as np
import pytest
from mpi4py import MPI
from references import data, reference, same_everywhere

from ringtrain.comm.transports import create_transport, open_transport
from ringtrain.comm.transports.shm import HALF_BYTES, WindowTransport

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
# Bitwise equal to their two phases; MPI's Allreduce picks its own order. On one host the hierarchical
# transport is the window within the host and nothing across (tests/mpi/test_hierarchical.py fakes hosts).
TWO_PHASE = ["shm", "ring", "mpi", "hierarchical"]
# A few elements (some ranks own none at 4), one round, and several window rounds ending in a partial one.
LENGTHS = [3, 100_003, HALF_BYTES // 8 + 12_345]


@contextlib.contextmanager
def made(name, **options):
    """A transport on a duplicate of the world, closed and freed afterwards (collective)."""
    dup = comm.Dup()
    transport = create_transport(name, dup, **options)
    try:
        yield transport
    finally:
        transport.close()
        dup.Free()


@pytest.mark.mpi
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("name", TWO_PHASE)
def test_allreduce_matches_mpi_and_is_the_same_everywhere(name, n):
    with made(name) as transport:
        x, xi = data(n, np.float64, 1), data(n, np.int64, 2)
        want, want_i = reference(x), reference(xi)
        transport.allreduce(x)
        transport.allreduce(xi)
    np.testing.assert_allclose(x, want, rtol=1e-12, atol=1e-12)
    assert np.array_equal(xi, want_i)
    assert same_everywhere(x)


@pytest.mark.mpi
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("name", TWO_PHASE)
def test_allreduce_is_its_reduce_scatter_then_its_allgather(name, n):
    with made(name) as transport:
        fused, phased = data(n, np.float32, 3), data(n, np.float32, 3)
        transport.allreduce(fused)
        transport.reduce_scatter(phased)
        a, b = transport.owned(n)
        chunk = phased[a:b].copy()
        transport.allgather(phased)
        owned = comm.allgather((a, b))
    exact = name != "mpi"  # MPI's Allreduce and its Reduce_scatter may add in different orders
    compare = np.array_equal if exact else (lambda p, q: np.allclose(p, q, rtol=1e-5, atol=1e-5))
    assert compare(phased, fused)
    assert compare(chunk, fused[a:b])
    # The owned chunks tile the buffer: every element is reduced by exactly one rank.
    spans = sorted(owned)
    assert spans[0][0] == 0 and spans[-1][1] == n
    assert all(spans[i][1] == spans[i + 1][0] for i in range(len(spans) - 1))


@pytest.mark.mpi
@pytest.mark.parametrize("n", LENGTHS[:2])
def test_window_reads_shared_arrays_in_place_with_the_same_bits(n):
    # The sharded step keeps the model's buffers in the window; the allreduce stages through slots.
    with made("shm", shared_bytes=8 * n + 64) as transport:
        staged = data(n, np.float64, 4)
        shared = staged.copy()
        if size > 1:
            shared = transport.share(n, np.float64)
            shared[:] = staged
        transport.allreduce(staged)
        transport.reduce_scatter(shared)
        transport.allgather(shared)
        result = shared.copy()
    assert np.array_equal(result, staged)


@pytest.mark.mpi
@pytest.mark.parametrize("name", TWO_PHASE)
def test_small_sums_back_to_back(name):
    with made(name) as transport:
        sums = [transport.sum_small(np.array([rank + k, -1.0, 0.5])) for k in range(3)]
    total = size * (size - 1) / 2
    assert [list(s) for s in sums] == [[total + k * size, -size, 0.5 * size] for k in range(3)]


@pytest.mark.mpi
@pytest.mark.parametrize("cut", [1, 7, 50_000])
def test_window_results_do_not_depend_on_how_the_buffer_is_cut(cut):
    # Every element is summed in rank order whoever owns it: a gradient
    # reduced in buckets equals the sharded step's one reduce-scatter over it.
    with made("shm") as transport:
        whole = data(100_003, np.float32, 8)
        parts = whole.copy()
        transport.allreduce(whole)
        transport.allreduce(parts[:cut])
        transport.allreduce(parts[cut:])
    assert np.array_equal(whole, parts)


@pytest.mark.mpi
def test_host_and_device_transports_never_share_a_cache_slot():
    # The GPU path once got the host's hierarchical transport from a cache
    # keyed by name alone, and fed CuPy arrays to its NumPy-only window.
    dup = comm.Dup()
    cache = {}
    host = open_transport("hierarchical", dup, 1 << 20, None, cache=cache)
    device = open_transport("hierarchical", dup, 1 << 20, 0, cache=cache)
    again = open_transport("hierarchical", dup, 1 << 20, None, cache=cache)
    inner = [type(getattr(t, "local", t)).__name__ for t in (host, device)]
    no_window = WindowTransport.create(dup, device=0)
    for transport in (host, device):
        transport.close()
    dup.Free()
    assert again is host and device is not host
    assert set(cache) == {("hierarchical", None), ("hierarchical", 0)}
    assert no_window is None
    if size > 1:  # within the host: the window for host buffers; CUDA IPC (without a GPU, the ring) for device ones
        assert inner[0] == "WindowTransport" and inner[1] in ("CudaIpcTransport", "RingTransport")

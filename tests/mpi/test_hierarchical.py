"""The hierarchical allreduce against MPI's own Allreduce, at every size the harness runs.

On one machine every rank shares one host, so besides the real grouping
(MPI's shared-memory split) the tests attach made-up ones to a duplicate of
the world: blocks of two ranks per "host", and hosts whose ranks interleave.
Every test asserts after its last collective.
"""

import numpy as np
import pytest
from mpi4py import MPI
from references import data, reference, same_everywhere

from ringtrain.comm import allreduce, allreduce_, allreduce_many_
from ringtrain.comm.transports.hierarchical import Hierarchy
from ringtrain.comm.policy import SMALL_BYTES
from ringtrain.comm.transports import create_transport
from ringtrain.comm.transports.shm import HALF_BYTES
from ringtrain.errors import MismatchError

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
# Empty, one element, fewer than ranks, a prime; float32 also one above a 1 MiB ring segment.
LENGTHS = [0, 1, 3, 1009]
SEGMENTED = (1 << 20) // 4 + 7
GROUPINGS = ["shared-memory", "blocks of two", "interleaved"]


@pytest.fixture(params=GROUPINGS)
def grouped(request):
    """A communicator over every rank with the hierarchy under test cached on it."""
    if request.param == "shared-memory":
        yield comm
        return
    dup = comm.Dup()
    Hierarchy.attach(dup, rank // 2 if request.param == "blocks of two" else rank % 2)
    yield dup
    dup.Free()  # frees the cached sub-communicators too


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64, np.float16], ids=lambda d: np.dtype(d).name)
def test_sum_matches_mpi_and_is_identical_everywhere(grouped, dtype):
    failures = []
    tol = {"f": 1e-5 if dtype == np.float32 else 1e-12, "i": 0}[np.dtype(dtype).kind]
    if dtype == np.float16:
        tol = 2e-2
    for n in LENGTHS + ([SEGMENTED] if dtype == np.float32 else []):
        x = data(n, dtype)
        want = reference(x)
        got = allreduce(x, "sum", grouped, transport="hierarchical")
        if got.dtype != x.dtype or got.shape != x.shape:
            failures.append((n, "type"))
        if not np.allclose(got.astype(np.float64), want, rtol=tol, atol=tol * 4 * size):
            failures.append((n, "value"))
        if not same_everywhere(got):
            failures.append((n, "ranks differ"))
    assert failures == []


@pytest.mark.mpi
def test_mean_in_place_on_a_2d_array_and_repeatable(grouped):
    x = data((SMALL_BYTES // 20 + 1) * 5, np.float32, seed=1).reshape(-1, 5)  # above the small-message path
    want = reference(x, "mean")
    first = allreduce_(x.copy(), "mean", grouped, transport="hierarchical")
    second = allreduce_(x.copy(), "mean", grouped, transport="hierarchical")
    identical = same_everywhere(first)
    assert first.shape == x.shape
    assert np.allclose(first, want, rtol=1e-5, atol=1e-5)
    assert identical and first.tobytes() == second.tobytes()


@pytest.mark.mpi
def test_fused_gradients_through_allreduce_many(grouped):
    arrays = [data(n, np.float32, seed=s) for s, n in enumerate([7, 3000, 70000])]
    wants = [reference(a, "mean") for a in arrays]
    allreduce_many_(arrays, op="mean", comm=grouped, bucket_bytes=64 << 10, transport="hierarchical")
    identical = all(same_everywhere(a) for a in arrays)
    assert identical
    assert all(np.allclose(a, w, rtol=1e-5, atol=1e-5) for a, w in zip(arrays, wants))


@pytest.mark.mpi
def test_hierarchy_is_cached_and_matches_shared_memory():
    first, second = Hierarchy.of(comm), Hierarchy.of(comm)
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    expected = (local.Get_rank(), local.Get_size())
    local.Free()
    leaders = comm.allreduce(1 if expected[0] == 0 else 0)
    assert first is second
    assert (first.intra.Get_rank(), first.intra.Get_size()) == expected
    assert first.num_hosts == leaders
    assert (first.cross is not None) == (expected[0] == 0)


@pytest.mark.mpi
def test_attached_grouping_makes_one_leader_per_host():
    dup = comm.Dup()
    hierarchy = Hierarchy.attach(dup, rank // 2)
    cross = (hierarchy.cross.Get_rank(), hierarchy.cross.Get_size()) if hierarchy.cross is not None else None
    intra = (hierarchy.intra.Get_rank(), hierarchy.intra.Get_size())
    cached = Hierarchy.of(dup) is hierarchy
    dup.Free()
    assert cached
    assert intra == (rank % 2, min(2, size - rank // 2 * 2))
    assert cross == ((rank // 2, (size + 1) // 2) if rank % 2 == 0 else None)


@pytest.mark.mpi(min_size=2)
def test_mismatched_lengths_raise_on_every_rank():
    x = np.ones(SMALL_BYTES + (rank == 1), np.float32)
    with pytest.raises(MismatchError, match="lengths"):
        allreduce_(x, "sum", comm, transport="hierarchical")


def _host_sizes(grouping):
    """How many ranks each made-up host has under ``grouping``."""
    colours = [r // 2 if grouping == "blocks of two" else r % 2 for r in range(size)]
    return sorted(colours.count(c) for c in set(colours))


@pytest.mark.mpi
@pytest.mark.parametrize("n", [3, 1009, 2 * HALF_BYTES // 8 + 77])  # the last takes several window rounds
@pytest.mark.parametrize("grouping", GROUPINGS[1:])
def test_two_level_phases_over_made_up_hosts(grouping, n):
    # Equal hosts: both phases (window within, ring among chunk owners across),
    # bitwise the allreduce. Unequal hosts: the leader-based allreduce only.
    dup = comm.Dup()
    Hierarchy.attach(dup, rank // 2 if grouping == "blocks of two" else rank % 2)
    transport = create_transport("hierarchical", dup)
    x = data(n, np.float64, seed=5)
    want = reference(x)
    fused = x.copy()
    transport.allreduce(fused)
    two_phase = transport.two_phase
    phased, chunk, span = x.copy(), None, None
    if two_phase:
        transport.reduce_scatter(phased)
        span = transport.owned(n)
        chunk = phased[span[0]:span[1]].copy()
        transport.allgather(phased)
    spans = comm.allgather(span)
    transport.close()
    dup.Free()
    sizes = _host_sizes(grouping)
    assert two_phase == (size == 1 or min(sizes) == max(sizes))
    np.testing.assert_allclose(fused, want, rtol=1e-12, atol=1e-12)
    assert same_everywhere(fused)
    if two_phase:
        assert np.array_equal(phased, fused)
        assert np.array_equal(chunk, fused[span[0]:span[1]])
        spans = sorted(spans)  # every element is reduced by exactly one rank
        assert spans[0][0] == 0 and spans[-1][1] == n
        assert all(spans[i][1] == spans[i + 1][0] for i in range(len(spans) - 1))


@pytest.mark.mpi(min_size=4)
def test_only_chunk_owners_pair_up_across_hosts():
    # Blocks of two: local rank l of each host owns window chunk l, so the
    # ranks that talk across hosts are those with the same local rank.
    dup = comm.Dup()
    Hierarchy.attach(dup, rank // 2)
    transport = create_transport("hierarchical", dup)
    across = transport.across.group.Translate_ranks(list(range(transport.across.Get_size())), dup.group)
    transport.close()
    dup.Free()
    assert across == [r for r in range(size) if r % 2 == rank % 2 and r // 2 < size // 2 or r == rank]

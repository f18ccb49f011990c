"""ringtrain's collectives against MPI's own Allreduce, at every size the harness runs.

Floats are compared with a tolerance (the reduction order differs from MPI's),
integers exactly. Every test asserts after its last collective, so a failing
rank cannot strand its peers. The same tests run on CuPy arrays when a GPU is
present (marker ``gpu``).
"""

import numpy as np
import pytest
from mpi4py import MPI
from references import close, data, reference, same_everywhere

from ringtrain import backend
from ringtrain.comm import allreduce, allreduce_, allreduce_many_, broadcast_
from ringtrain.comm.policy import SMALL_BYTES
from ringtrain.comm.board import Board
from ringtrain.comm.collectives import reduce_into
from ringtrain.comm.transports.shm import HALF_BYTES
from ringtrain.comm.state import CommState, release
from ringtrain.errors import MismatchError, UsageError

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
DTYPES = [np.float16, np.float32, np.float64, np.int32, np.int64]
# Edge lengths (empty, one, fewer than ranks, primes) and one prime above the
# small-message threshold for every dtype, so "auto" takes its large-message path too.
LENGTHS = [0, 1, 2, 3, 7, 1009, SMALL_BYTES // 2 + 11]
ALGORITHMS = ["auto", "ring", "mpi", "shm"]  # every test rank shares this host, so shm applies


@pytest.fixture(params=["numpy", pytest.param("cupy", marks=pytest.mark.gpu)])
def xp(request):
    if request.param == "numpy":
        return np
    if not backend.gpu_available():
        pytest.skip("no CUDA GPU visible to CuPy on this machine")
    return backend.xp_for("gpu")


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_sum_matches_mpi_every_length(xp, dtype, algorithm):
    failures = []
    for n in LENGTHS:
        x = data(n, dtype)
        want = reference(x, "sum")
        got = allreduce(xp.asarray(x), "sum", comm, transport=algorithm)
        if not (got.dtype == x.dtype and got.shape == x.shape and backend.get_array_module(got) is xp):
            failures.append((n, "type"))
        if not close(got, want, dtype):
            failures.append((n, "value"))
        if not same_everywhere(got):
            failures.append((n, "ranks differ"))
    assert failures == []


@pytest.mark.mpi
@pytest.mark.parametrize("op", ["mean", "min", "max"])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, np.int64])
def test_other_ops_match_mpi(xp, op, dtype):
    failures = []
    for n in (1, 5, 1009, SMALL_BYTES // 2 + 11):
        for algorithm in ALGORITHMS:
            if op == "mean" and np.dtype(dtype).kind == "i":
                continue
            x = data(n, dtype, seed=1)
            want = reference(x, op)
            got = allreduce_(xp.asarray(x), op, comm, transport=algorithm)
            exact = op in ("min", "max")
            if not (np.array_equal(backend.to_numpy(got), want) if exact else close(got, want, dtype)):
                failures.append((n, algorithm))
    assert failures == []


@pytest.mark.mpi
def test_mean_on_integers_is_an_error_everywhere():
    with pytest.raises(UsageError, match="'mean' needs a floating-point dtype, got int32") as info:
        allreduce_(np.ones(4, np.int32), "mean", comm)
    assert info.value.everywhere


@pytest.mark.mpi
def test_unknown_op_and_transport_are_errors_everywhere():
    with pytest.raises(UsageError, match="unknown op 'avg'; choose one of sum, mean, min, max"):
        allreduce(np.ones(3), "avg", comm)
    with pytest.raises(UsageError, match="unknown transport 'tree'"):
        allreduce(np.ones(3), "sum", comm, transport="tree")


@pytest.mark.mpi
def test_algorithm_is_a_deprecated_name_for_transport():
    x = data(100_003, np.float32, 3)
    want = allreduce(x, "sum", comm, transport="ring")
    with pytest.warns(DeprecationWarning, match="allreduce: algorithm= is deprecated; use transport='ring'"):
        old = allreduce(x, "sum", comm, algorithm="ring")
    inplace = x.copy()
    with pytest.warns(DeprecationWarning, match="allreduce_: algorithm= is deprecated"):
        allreduce_(inplace, "sum", comm, algorithm="ring")
    with pytest.warns(DeprecationWarning, match="allreduce_many_: algorithm= is deprecated"):
        many = allreduce_many_([x.copy()], "sum", comm, algorithm="ring")[0]
    assert np.array_equal(old, want) and np.array_equal(inplace, want) and np.array_equal(many, want)


@pytest.mark.mpi
def test_in_place_and_out_of_place(xp):
    x = xp.asarray(data(12, np.float32).reshape(3, 4))
    before = backend.to_numpy(x).copy()
    y = allreduce(x, "sum", comm)
    unchanged = np.array_equal(backend.to_numpy(x), before)
    z = allreduce_(x, "sum", comm)
    # A non-contiguous view is reduced through a copy and written back.
    big = xp.asarray(data(40, np.float64))
    strided = big[::2]
    want = reference(backend.to_numpy(strided), "sum")
    allreduce_(strided, "sum", comm)
    untouched = data(40, np.float64)[1::2]
    assert unchanged and z is x and y is not x
    assert np.array_equal(backend.to_numpy(y), backend.to_numpy(z))
    assert close(strided, want, np.float64)
    assert np.array_equal(backend.to_numpy(big)[1::2], untouched)


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("nbytes", [SMALL_BYTES + 44, HALF_BYTES + 52], ids=["large", "several-rounds"])
@pytest.mark.parametrize("dtype, op", [(np.float32, "sum"), (np.float16, "mean")])
def test_a_new_result_reads_the_input_where_it_is_and_equals_in_place_bitwise(algorithm, nbytes, dtype, op):
    # allreduce() and reduce_into() reduce from the input into another array (the
    # shared-memory window and MPI without copying it in first; float16's mean divides first).
    x = data(nbytes // np.dtype(dtype).itemsize, dtype)
    kept = x.copy()
    new = allreduce(x, op, comm, transport=algorithm)
    in_place = allreduce_(x.copy(), op, comm, transport=algorithm)
    into = np.full_like(x, np.nan)
    reduce_into(into, x, op, comm, transport=algorithm)
    want = reference(x, op)
    everywhere = same_everywhere(new)
    assert np.array_equal(x, kept)
    assert np.array_equal(new, in_place) and np.array_equal(into, in_place)
    assert close(new, want, dtype) and everywhere


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("shift", [0, 3, -3], ids=["same", "ahead", "behind"])
def test_an_output_over_its_own_input_is_reduced_as_a_copy_would_be(algorithm, shift):
    # reduce_into's output may lie over its input (the engine's allreduce into a view of its own
    # tensor): the result must be the copy's, on every transport, and MPI must not see two buffers.
    n = SMALL_BYTES // 4 + 1000
    memory = data(n + 6, np.float32)
    x = memory[3:3 + n]
    want = allreduce_(x.copy(), "sum", comm, transport=algorithm)
    out = memory[3 + shift:3 + shift + n]
    reduce_into(out, x, "sum", comm, transport=algorithm)
    assert np.array_equal(out, want)


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_ranks_that_choose_differently_between_in_place_and_out_of_place_reduce_together(algorithm):
    # Whether reduce_into reads the input where it is is each rank's own choice (here rank 0's output
    # lies over its input, the others' do not): the ranks must still run one exchange, with one result.
    n = SMALL_BYTES // 4 + 1000
    memory = data(n + 3, np.float32)
    x = memory[:n]
    want = allreduce_(x.copy(), "sum", comm, transport=algorithm)
    out = memory[3:] if comm.rank == 0 else np.empty_like(x)
    reduce_into(out, x, "sum", comm, transport=algorithm)
    everywhere = same_everywhere(out)
    assert np.array_equal(out, want) and everywhere


@pytest.mark.mpi
def test_a_repeated_small_call_finds_its_plan_without_asking_for_it_again(monkeypatch):
    # allreduce_ looks its plan up inline, by the key small_plan stores it under: were the two keys
    # to differ, every call would still be right, only slower, so the lookups are counted here.
    from ringtrain.comm import collectives

    asked = []
    real = collectives.small_plan
    monkeypatch.setattr(collectives, "small_plan", lambda *a, **k: asked.append(1) or real(*a, **k))
    x = data(100, np.float32)
    results = [allreduce_(x.copy(), "sum", comm) for _ in range(4)]
    assert all(np.array_equal(r, results[0]) for r in results)
    assert len(asked) == (1 if comm.size > 1 else 0)


@pytest.mark.mpi
def test_fused_list_of_mixed_shapes_and_dtypes(xp):
    shapes = [(3, 4), (5,), (), (2, 2, 2), (1000,), (7,), (0,), (SMALL_BYTES // 4 + 3,)]
    dtypes = [np.float32, np.float32, np.float64, np.float64, np.float32, np.int64, np.float32, np.float32]
    host = [data(int(np.prod(s)), d, seed=i).reshape(s) for i, (s, d) in enumerate(zip(shapes, dtypes))]
    grads = [xp.asarray(a) for a in host]
    grads[3] = xp.asarray(host[3].transpose(2, 1, 0).copy()).transpose(2, 1, 0)  # non-contiguous member
    want = [reference(a, "sum") for a in host]
    results = []
    for bucket_bytes in (64, 1 << 20):
        out = allreduce_many_([g.copy() for g in grads], "sum", comm, bucket_bytes=bucket_bytes)
        results.append(all(close(o, w, o.dtype) and o.shape == w.shape for o, w in zip(out, want)))
    # The fusion buffer lives on the communicator and is reused: no new buffers second time.
    state = CommState.of(comm)
    allreduce_many_([g.copy() for g in grads], "sum", comm, bucket_bytes=1 << 20)
    buffers = {k: id(v) for k, v in state._buffers.items()}
    allreduce_many_([g.copy() for g in grads], "sum", comm, bucket_bytes=1 << 20)
    reused = buffers == {k: id(v) for k, v in state._buffers.items()}
    named = allreduce_many_({"w": xp.ones(3), "b": xp.ones(2)}, "mean", comm)
    empty = allreduce_many_([], "mean", comm)
    assert results == [True, True] and reused and empty == []
    assert np.array_equal(backend.to_numpy(named["w"]), np.ones(3))


@pytest.mark.mpi
def test_deterministic_and_identical_on_every_rank(xp):
    verdicts = []
    for algorithm in ALGORITHMS:
        for n in (1009, SMALL_BYTES // 2 + 11):
            x = data(n, np.float32, seed=7)
            first = backend.to_numpy(allreduce(xp.asarray(x), "mean", comm, transport=algorithm))
            second = backend.to_numpy(allreduce(xp.asarray(x), "mean", comm, transport=algorithm))
            verdicts.append((algorithm, n, first.tobytes() == second.tobytes(), same_everywhere(first)))
    assert all(a and b for _, _, a, b in verdicts), verdicts


def _mismatch(call):
    """Run ``call`` expecting MismatchError on every rank; return its message."""
    try:
        call()
    except MismatchError as exc:
        return str(exc)
    return None


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("n0, n", [(10, 11), (SMALL_BYTES, SMALL_BYTES + 1), (10, SMALL_BYTES)])
def test_different_lengths_raise_everywhere(n0, n):
    message = _mismatch(lambda: allreduce_(np.ones(n0 if rank == 0 else n, np.float32), "sum", comm))
    # The communicator is still in step afterwards.
    after = allreduce(np.ones(5), "sum", comm)
    assert message is not None and f"{n0} elements and {n} elements" in message
    assert np.array_equal(after, np.full(5, float(size)))


@pytest.mark.mpi(min_size=2)
def test_different_dtypes_ops_and_lists_raise_everywhere():
    dtype = np.float64 if rank == size - 1 else np.float32
    messages = [
        _mismatch(lambda: allreduce_(np.ones(100, dtype), "sum", comm)),
        _mismatch(lambda: allreduce_(np.ones(100_000, dtype), "sum", comm)),
        _mismatch(lambda: allreduce_(np.ones(4), "sum" if rank else "mean", comm)),
        _mismatch(lambda: allreduce_many_([np.ones(3)] * (2 if rank else 3), "sum", comm)),
        _mismatch(lambda: allreduce_many_([np.ones((2, 3)) if rank else np.ones((3, 2))], "sum", comm)),
        _mismatch(lambda: broadcast_(np.ones(4), root=0 if rank else 1, comm=comm)),
    ]
    after = allreduce(np.ones(5), "sum", comm)
    assert all(m is not None for m in messages), messages
    assert "different dtypes: float32 and float64" in messages[0] and "float32 and float64" in messages[1]
    assert "'sum' and 'mean'" in messages[2]
    assert "different numbers of arrays: 2 and 3" in messages[3]
    assert "different shapes" in messages[4]
    assert "different roots: 0 and 1" in messages[5]
    assert np.array_equal(after, np.full(5, float(size)))


@pytest.mark.mpi
def test_broadcast(xp):
    root = size - 1
    x = xp.asarray(data(1009, np.float32, seed=3))
    want = comm.bcast(data(1009, np.float32, seed=3), root=root)
    broadcast_(x, root=root, comm=comm)
    y = xp.asarray(data(20, np.int64, seed=4))[::2]
    want_y = comm.bcast(data(20, np.int64, seed=4)[::2], root=0)
    broadcast_(y, comm=comm)
    assert np.array_equal(backend.to_numpy(x), want)
    assert np.array_equal(backend.to_numpy(y), want_y)


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", [np.float32, np.int64])
def test_shared_memory_in_blocks_matches_mpi(dtype):
    # Above one stage the window works in rounds that go round a ring of
    # stages: a length past all of them reuses each stage and ends in a
    # partial round.
    from ringtrain.comm.transports.shm import HALF_BYTES

    n = HALF_BYTES // np.dtype(dtype).itemsize + 100_003
    x = data(n, dtype, seed=7)
    want = reference(x, "sum")
    got = allreduce(x, "sum", comm, transport="shm")
    again = allreduce(x, "sum", comm, transport="shm")
    everywhere = same_everywhere(got)
    assert close(got, want, dtype) and everywhere
    assert got.tobytes() == again.tobytes()


@pytest.fixture(params=["board", "messages"])
def header_comm(request):
    """A duplicate of the world whose header exchange goes through the shared-memory board or by messages."""
    dup = comm.Dup()
    state = CommState.of(dup)
    if request.param == "messages":
        state.exchange_by_messages()
    board = state.board()
    assert isinstance(board, Board) if request.param == "board" else board is None
    yield dup
    release(dup)


@pytest.mark.mpi
def test_small_calls_match_mpi_either_way(header_comm):
    failures = []
    for dtype in DTYPES:
        for n in (0, 1, 3, 1009, 2048, 2100, SMALL_BYTES // np.dtype(dtype).itemsize):
            for op in ("sum", "mean", "max"):
                if op == "mean" and np.dtype(dtype).kind == "i":
                    continue
                x = data(n, dtype, seed=5)
                want = reference(x, op, on=header_comm)
                got = allreduce_(x.copy(), op, header_comm)
                if not (close(got, want, dtype) and same_everywhere(got, on=header_comm)):
                    failures.append((np.dtype(dtype).name, n, op))
    assert failures == []


@pytest.mark.mpi(min_size=2)
def test_mismatches_raise_either_way(header_comm):
    last = size - 1
    messages = [
        _mismatch(lambda: allreduce_(np.ones(10 if rank == 0 else 11, np.float32), "sum", header_comm)),
        _mismatch(lambda: allreduce_(np.ones(2100, np.float64 if rank == last else np.float32), "sum", header_comm)),
        _mismatch(lambda: allreduce_(np.ones(10 if rank == 0 else 100_000), "sum", header_comm)),
    ]
    after = allreduce(np.ones(5), "sum", header_comm)
    assert all(m is not None for m in messages), messages
    assert "10 elements and 11 elements" in messages[0] and "float32 and float64" in messages[1]
    assert "10 elements and 100000 elements" in messages[2]
    assert np.array_equal(after, np.full(5, float(size)))


@pytest.mark.mpi(min_size=2)
def test_broadcast_and_lists_either_way(header_comm):
    x = data(1009, np.float64, seed=8)
    want = header_comm.bcast(x.copy(), root=size - 1)
    broadcast_(x, root=size - 1, comm=header_comm)
    arrays = [data(n, np.float32, seed=9 + n) for n in (3, 1000, SMALL_BYTES)]
    wants = [reference(a, "sum", on=header_comm) for a in arrays]
    allreduce_many_(arrays, "sum", header_comm)
    wrong_root = _usage_error(lambda: broadcast_(np.ones(3), root=0 if rank else 1, comm=header_comm))
    assert np.array_equal(x, want)
    assert all(close(a, w, np.float32) for a, w in zip(arrays, wants))
    assert wrong_root is not None


def _usage_error(call):
    """Run ``call`` expecting UsageError on every rank; return its message."""
    try:
        call()
    except UsageError as exc:
        return str(exc)
    return None


@pytest.mark.mpi(min_size=2)
def test_arguments_that_cannot_be_sent_are_refused_everywhere():
    # Values the header cannot carry (an unhashable op, a root past int64)
    # must become a problem code, not an error on one rank that strands the rest.
    odd = rank == size - 1
    messages = [
        _usage_error(lambda: allreduce_(np.ones(4), ["sum"] if odd else "sum", comm)),
        _usage_error(lambda: allreduce(np.ones(100_000), "sum", comm, transport={} if odd else "auto")),
        _usage_error(lambda: broadcast_(np.ones(4), root=2 ** 70 if odd else 0, comm=comm)),
    ]
    after = allreduce(np.ones(5), "sum", comm)
    assert all(m is not None for m in messages), messages
    assert "unknown op" in messages[0] or "could not take part" in messages[0]
    assert np.array_equal(after, np.full(5, float(size)))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("nbytes", [4096, 8192, SMALL_BYTES, 3 * SMALL_BYTES])
def test_one_host_sums_in_rank_order(nbytes):
    # On one host small calls (the board) and larger ones (the window) both
    # add rank 0's values, then rank 1's, ...: bitwise a NumPy sum in rank order.
    x = data(nbytes // 4, np.float32, seed=6)
    everyone = comm.allgather(x)
    want = everyone[0].copy()
    for theirs in everyone[1:]:
        want += theirs
    got = allreduce(x, "sum", comm)
    assert got.tobytes() == want.tobytes()

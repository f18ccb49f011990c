"""ringtrain.torch's Horovod collectives against references computed with MPI and NumPy.

Run at 1, 2, 3 and 4 ranks by tests/test_mpi_suite.py. Every rank makes its
own seeded data; the reference is what MPI's allgather of everyone's data
gives, reduced with NumPy. Values are small integers, so sums and products
are exact in every dtype (float16 and bfloat16 included) and the results
must be equal, not close. Skipped where torch is not installed.
"""

import json
import os
import time

import numpy as np
import pytest
from mpi4py import MPI

torch = pytest.importorskip("torch", reason="torch is not installed (pip install torch==2.13.0)")
hvd = pytest.importorskip("ringtrain.torch")

from ringtrain.engine.kernels import scatter_rows  # noqa: E402 - after the importorskip above

DTYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
          torch.float32, torch.float64]
COMM = MPI.COMM_WORLD


@pytest.fixture(autouse=True)
def runtime():
    hvd.init()
    yield
    # Every test ends level: a rank that failed early must not leave its peers in an op.
    hvd.barrier()


def _data(shape, dtype, seed, low=-3, high=4):
    """This rank's values: small integers (non-negative for uint8), as ``dtype``, and as float64 for NumPy."""
    rng = np.random.default_rng(seed)
    low = 0 if dtype in (torch.uint8, torch.bool) else low
    values = rng.integers(low, high, size=shape).astype(np.float64)
    if dtype == torch.bool:
        values = values > 1
    return torch.tensor(values).to(dtype), values


def _everyone(values):
    """Every rank's float64 values, through MPI's own allgather."""
    return np.stack(COMM.allgather(values))


def _as_numpy(tensor):
    return tensor.to(torch.float64).numpy() if tensor.dtype != torch.bool else tensor.numpy()


REDUCE = {hvd.Sum: lambda a: a.sum(0), hvd.Min: lambda a: a.min(0), hvd.Max: lambda a: a.max(0),
          hvd.Product: lambda a: a.prod(0)}


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_allreduce_every_op_matches_numpy_over_mpi_allgather(dtype):
    for op, reduce in REDUCE.items():
        # Products of 4 ranks' values stay small enough for int8; sums of 4 for uint8.
        high = 3 if op == hvd.Product else 4
        for shape in [(), (5,), (3, 4)]:
            tensor, values = _data(shape, dtype, seed=COMM.Get_rank() * 7 + op, high=high)
            got = hvd.allreduce(tensor, op=op)
            want = reduce(_everyone(values))
            assert got.dtype == dtype and got.shape == tensor.shape
            np.testing.assert_array_equal(_as_numpy(got), want, err_msg=f"{dtype} op {op} shape {shape}")


@pytest.mark.mpi
def test_allreduce_average_and_scale_factors():
    size = COMM.Get_size()
    for dtype in [torch.int32, torch.int64, torch.float32, torch.float64]:
        tensor, values = _data((6,), dtype, seed=COMM.Get_rank())
        total = _everyone(values).sum(0)
        got = hvd.allreduce(tensor, op=hvd.Average)
        # Integers are averaged in float64 and truncated toward zero, as Horovod does; floats in their dtype.
        kind = {torch.float32: np.float32}.get(dtype, np.float64)
        want = np.trunc(total / size) if not dtype.is_floating_point else total.astype(kind) / kind(size)
        np.testing.assert_array_equal(_as_numpy(got), want, err_msg=str(dtype))
    tensor, values = _data((6,), torch.float64, seed=COMM.Get_rank())
    got = hvd.allreduce(tensor, op=hvd.Sum, prescale_factor=0.5, postscale_factor=4.0)
    np.testing.assert_allclose(got.numpy(), (_everyone(values) * 0.5).sum(0) * 4.0, rtol=1e-15)


@pytest.mark.mpi
def test_the_same_tensors_reduced_again_after_a_change_give_the_new_values():
    # Small ops read CPU tensors through cached NumPy views: a later call on the same (or a strided,
    # or a detached) tensor must see what the tensor holds now, never what it held at the first call.
    rank = COMM.Get_rank()
    base, values = _data((8, 6), torch.float32, seed=rank + 40)
    cases = {"strided": lambda: base.t(), "contiguous": lambda: base, "detached": lambda: base.detach()}
    for step in range(3):
        base.add_(1.0)
        total = _everyone(values + step + 1).sum(0)
        for what, view in cases.items():
            np.testing.assert_array_equal(hvd.allreduce(view(), op=hvd.Sum, name=what).numpy(),
                                          total.T if what == "strided" else total, err_msg=f"{what} step {step}")
            np.testing.assert_array_equal(hvd.allreduce(view(), op=hvd.Average, name=what).numpy(),
                                          _average(total.T if what == "strided" else total),
                                          err_msg=f"{what} average step {step}")
        in_place = base.clone().t()
        hvd.allreduce_(in_place, op=hvd.Sum, name="in place")
        np.testing.assert_array_equal(in_place.numpy(), total.T, err_msg=f"in place step {step}")


def _average(total):
    return total.astype(np.float32) / np.float32(COMM.Get_size())


@pytest.mark.mpi
def test_bool_allreduce_is_logical():
    tensor, values = _data((8,), torch.bool, seed=COMM.Get_rank())
    everyone = _everyone(values.astype(np.float64)) > 0
    np.testing.assert_array_equal(hvd.allreduce(tensor, op=hvd.Max).numpy(), everyone.any(0))
    np.testing.assert_array_equal(hvd.allreduce(tensor, op=hvd.Min).numpy(), everyone.all(0))


@pytest.mark.mpi
def test_in_place_and_grouped_allreduce():
    tensors, values = zip(*[_data((n,), torch.float32, seed=COMM.Get_rank() * 10 + n) for n in (1, 4, 9)])
    pointers = [t.data_ptr() for t in tensors]
    hvd.grouped_allreduce_(list(tensors), op=hvd.Sum)
    assert pointers == [t.data_ptr() for t in tensors]
    for t, v in zip(tensors, values):
        np.testing.assert_array_equal(t.numpy(), _everyone(v).sum(0))
    fresh, values = zip(*[_data((n, 2), torch.float64, seed=COMM.Get_rank() + n) for n in (3, 5)])
    for got, v in zip(hvd.grouped_allreduce(list(fresh), op=hvd.Max), values):
        np.testing.assert_array_equal(got.numpy(), _everyone(v).max(0))


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", DTYPES + [torch.bool], ids=str)
def test_allgather_with_a_different_first_dimension_on_each_rank(dtype):
    rank = COMM.Get_rank()
    tensor, values = _data((rank + 1, 3), dtype, seed=rank)
    got = hvd.allgather(tensor)
    np.testing.assert_array_equal(_as_numpy(got), np.concatenate(COMM.allgather(values)))
    grouped = hvd.grouped_allgather([tensor, tensor[:, :1]])
    np.testing.assert_array_equal(_as_numpy(grouped[1]), np.concatenate(COMM.allgather(values[:, :1])))


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", DTYPES + [torch.bool], ids=str)
def test_broadcast_from_every_root(dtype):
    for root in range(COMM.Get_size()):
        tensor, values = _data((2, 3), dtype, seed=COMM.Get_rank() + 100 * root)
        want = COMM.bcast(values, root=root)
        np.testing.assert_array_equal(_as_numpy(hvd.broadcast(tensor, root)), want)
        hvd.broadcast_(tensor, root)
        np.testing.assert_array_equal(_as_numpy(tensor), want)
        scalar, value = _data((), dtype, seed=COMM.Get_rank())
        np.testing.assert_array_equal(_as_numpy(hvd.broadcast(scalar, root)), COMM.bcast(value, root=root))


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", [torch.int8, torch.float16, torch.bfloat16, torch.float64], ids=str)
def test_alltoall_with_uneven_splits(dtype):
    rank, size = COMM.Get_rank(), COMM.Get_size()
    splits = [(rank + dest) % 3 for dest in range(size)]  # zeros included
    tensor, values = _data((sum(splits) + 1, 2), dtype, seed=rank)  # one row more than sent
    got, received = hvd.alltoall(tensor, torch.tensor(splits, dtype=torch.int32))
    starts = np.cumsum([0] + splits)
    pieces = COMM.alltoall([values[starts[d]:starts[d + 1]] for d in range(size)])
    np.testing.assert_array_equal(_as_numpy(got), np.concatenate(pieces))
    assert received.tolist() == [len(p) for p in pieces]
    even, values = _data((2 * size, 3), dtype, seed=rank)
    pieces = COMM.alltoall(np.split(values, size))
    np.testing.assert_array_equal(_as_numpy(hvd.alltoall(even)), np.concatenate(pieces))


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", [torch.int16, torch.int64, torch.float16, torch.float32], ids=str)
def test_reducescatter_with_even_and_uneven_rows(dtype):
    rank, size = COMM.Get_rank(), COMM.Get_size()
    for rows in (1, 2 * size, 2 * size + 1):
        tensor, values = _data((rows, 2), dtype, seed=rank + rows)
        start, count = scatter_rows(rows, size)[rank]
        total = _everyone(values).sum(0)
        got = hvd.reducescatter(tensor, op=hvd.Sum)
        np.testing.assert_array_equal(_as_numpy(got), total[start:start + count])
        got = hvd.reducescatter(tensor, op=hvd.Max)
        np.testing.assert_array_equal(_as_numpy(got), _everyone(values).max(0)[start:start + count])


def test_scatter_rows_gives_the_first_ranks_one_more_row():
    assert scatter_rows(7, 3) == [(0, 3), (3, 2), (5, 2)]
    assert scatter_rows(2, 4) == [(0, 1), (1, 1), (2, 0), (2, 0)]


@pytest.mark.mpi
def test_async_ops_submitted_in_a_different_order_on_each_rank_complete():
    rank, size = COMM.Get_rank(), COMM.Get_size()
    names = [f"op{i}" for i in range(6)]
    order = np.random.default_rng(rank).permutation(len(names))  # each rank its own order
    handles, values = {}, {}
    for i in order:
        tensor, values[i] = _data((i + 1,), torch.float32, seed=rank * 100 + int(i))
        if i % 3 == 0:
            handles[i] = hvd.allreduce_async(tensor, name=names[i], op=hvd.Sum)
        elif i % 3 == 1:
            handles[i] = hvd.allgather_async(tensor, name=names[i])
        else:
            handles[i] = hvd.broadcast_async(tensor, root_rank=size - 1, name=names[i])
    for i in sorted(handles):
        got = hvd.synchronize(handles[i]).numpy()
        if i % 3 == 0:
            want = _everyone(values[i]).sum(0)
        elif i % 3 == 1:
            want = np.concatenate(COMM.allgather(values[i]))
        else:
            want = COMM.bcast(values[i], root=size - 1)
        np.testing.assert_array_equal(got, want, err_msg=names[i])


@pytest.mark.mpi
def test_many_small_async_allreduces_fuse_and_each_gets_its_own_result():
    rank = COMM.Get_rank()
    pending = []
    for i in range(40):
        tensor, values = _data((i % 5 + 1,), torch.float64, seed=rank * 1000 + i)
        pending.append((hvd.allreduce_async(tensor, op=hvd.Sum), values))
    for handle, values in pending:
        np.testing.assert_array_equal(hvd.synchronize(handle).numpy(), _everyone(values).sum(0))


@pytest.mark.mpi
def test_many_async_collectives_of_different_shapes_fuse_and_each_gets_its_own_result():
    # Large enough to be collectives (ordered by the leader) rather than computed on the spot.
    rank = COMM.Get_rank()
    pending = []
    for i in range(12):
        tensor, values = _data((3000 + 7 * i,), torch.float64, seed=rank * 1000 + i)
        pending.append((hvd.allreduce_async(tensor, op=hvd.Sum if i % 2 else hvd.Average), values, i))
    for handle, values, i in pending:
        want = _everyone(values).sum(0) / (1 if i % 2 else COMM.Get_size())
        np.testing.assert_array_equal(hvd.synchronize(handle).numpy(), want, err_msg=str(i))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("what", ["shape", "dtype", "op", "root", "rows"])
def test_ranks_that_disagree_raise_on_every_rank(what):
    rank = COMM.Get_rank()
    odd = rank % 2
    with pytest.raises(RuntimeError) as caught:
        if what == "shape":
            hvd.allreduce(torch.ones(3 + odd))
        elif what == "dtype":
            hvd.allreduce(torch.ones(3, dtype=torch.float64 if odd else torch.float32))
        elif what == "op":
            hvd.allreduce(torch.ones(3), op=hvd.Max if odd else hvd.Sum)
        elif what == "root":
            hvd.broadcast(torch.ones(3), root_rank=odd)
        else:  # an allgather's rows may differ; its other dimensions may not
            hvd.allgather(torch.ones(2, 3 + odd))
    assert isinstance(caught.value, hvd.HorovodInternalError)
    verdicts = COMM.allgather(str(caught.value))
    assert all(v == verdicts[0] for v in verdicts), verdicts  # the same message everywhere


@pytest.mark.mpi
def test_local_mistakes_raise_value_error_before_anything_is_sent():
    size = COMM.Get_size()
    if size > 1:
        with pytest.raises(ValueError, match="multiple of the number of ranks"):
            hvd.alltoall(torch.ones(size + 1))
    with pytest.raises(ValueError, match="int32"):
        hvd.alltoall(torch.ones(size), torch.ones(size))
    with pytest.raises(ValueError, match="more than the first dimension"):
        hvd.alltoall(torch.ones(size - 1), torch.ones(size, dtype=torch.int32))
    with pytest.raises(ValueError, match="0-dim"):
        hvd.reducescatter(torch.tensor(1.0))
    with pytest.raises(ValueError, match="not supported"):
        hvd.allreduce(torch.ones(2, dtype=torch.complex64))


@pytest.mark.mpi(min_size=2)
def test_a_name_in_flight_twice_raises_value_error_on_that_rank():
    rank = COMM.Get_rank()
    tensor = torch.ones(4)
    # Ranks other than 0 check while rank 0 holds the op back (it has not
    # submitted "first" yet), so their first op cannot have finished.
    if rank != 0:
        first = hvd.allreduce_async(tensor, name="first")
        with pytest.raises(ValueError, match="in flight"):
            hvd.allreduce_async(tensor, name="first")
    hvd.broadcast(torch.zeros(1), root_rank=0, name="go-first")
    if rank == 0:
        second = hvd.allreduce_async(tensor, name="second")
        with pytest.raises(ValueError, match="in flight"):
            hvd.allreduce_async(tensor, name="second")
        first = hvd.allreduce_async(tensor, name="first")
    hvd.broadcast(torch.zeros(1), root_rank=0, name="go-second")
    if rank != 0:
        second = hvd.allreduce_async(tensor, name="second")
    hvd.synchronize(first)
    hvd.synchronize(second)
    hvd.synchronize(hvd.allreduce_async(tensor, name="first"))  # free again once synchronized


@pytest.mark.mpi
def test_a_dropped_handle_frees_its_name_once_its_op_is_done():
    hvd.allreduce_async(torch.ones(3), name="dropped")  # its handle is never synchronized
    # The op completes on the engine's own thread; until then the name is in flight (ValueError, nothing sent).
    deadline = time.monotonic() + 60
    while True:
        try:
            got = hvd.allreduce(torch.ones(3), op=hvd.Sum, name="dropped")
            break
        except ValueError:
            assert time.monotonic() < deadline, "the dropped handle's name was never freed"
            time.sleep(0.01)
    np.testing.assert_array_equal(got.numpy(), np.full(3, float(COMM.Get_size())))


@pytest.mark.mpi
def test_a_collective_in_place_on_a_parameter_under_no_grad_runs_on_any_thread():
    # Large enough to be a collective; synchronized late, so the engine's own thread may run it.
    size = COMM.Get_size()
    p = torch.nn.Parameter(torch.full((5000,), float(COMM.Get_rank())))
    with torch.no_grad():
        handle = hvd.allreduce_async_(p, name="param")  # an average: the sum is divided in place
    time.sleep(0.05)
    assert hvd.synchronize(handle) is p
    np.testing.assert_array_equal(p.detach().numpy(), np.full(5000, sum(range(size)) / size))


@pytest.mark.mpi
def test_adasum_raises_not_implemented_on_every_rank():
    with pytest.raises(NotImplementedError, match="Adasum"):
        hvd.allreduce(torch.ones(4), op=hvd.Adasum)


@pytest.mark.mpi
def test_gradients_are_horovods():
    rank, size = COMM.Get_rank(), COMM.Get_size()
    x = torch.ones(3, requires_grad=True)
    hvd.allreduce(x, op=hvd.Sum).sum().backward()
    # d/dx of the sum of an allreduce(Sum) is the same allreduce of the ones coming back.
    np.testing.assert_array_equal(x.grad.numpy(), np.full(3, COMM.allreduce(1.0)))
    rows = torch.ones(rank + 1, 2, requires_grad=True)
    weights = torch.arange(float(size * (size + 1) // 2 * 2)).view(-1, 2)
    (hvd.allgather(rows) * weights).sum().backward()
    start = rank * (rank + 1) // 2
    np.testing.assert_array_equal(rows.grad.numpy(), weights[start:start + rank + 1].numpy())
    b = torch.ones(2, requires_grad=True)
    hvd.broadcast(b, root_rank=0).sum().backward()
    np.testing.assert_array_equal(b.grad.numpy(), np.ones(2) if rank == 0 else np.zeros(2))
    r = torch.ones(2 * size, requires_grad=True)
    hvd.reducescatter(r, op=hvd.Sum).sum().backward()
    np.testing.assert_array_equal(r.grad.numpy(), np.full(2 * size, float(size)))


@pytest.mark.mpi(min_size=2)
def test_a_joined_rank_adds_zeros_and_join_returns_the_last_rank_everywhere():
    rank, size = COMM.Get_rank(), COMM.Get_size()
    tensor, values = _data((5,), torch.float32, seed=rank)
    if rank == 0:
        last = hvd.join()
    else:
        got = hvd.allreduce(tensor, op=hvd.Sum, name="while-joined")
        with pytest.raises(RuntimeError, match="joined"):
            # Named: only the ranks that are not joined make this call, so an
            # unnamed one would put their per-kind counters out of step with rank 0's.
            hvd.broadcast(tensor, root_rank=1, name="refused-while-joined")
        last = hvd.join()
    contributions = COMM.allgather(values if rank else np.zeros_like(values))
    if rank:
        np.testing.assert_array_equal(got.numpy(), np.sum(contributions, axis=0))
    assert last != 0 and COMM.allgather(last) == [last] * size


@pytest.mark.mpi(min_size=2)
def test_while_a_rank_is_joined_other_ops_fail_at_once_even_unnamed_and_out_of_step():
    # Horovod's pattern: each rank in turn joins first; the others' unnamed allgathers fail at once, although
    # their per-kind counters no longer agree with the joined rank's (it made no allgather that round).
    rank, size = COMM.Get_rank(), COMM.Get_size()
    for first in range(size):
        if rank != first:
            with pytest.raises(RuntimeError, match="joined"):
                hvd.allgather(torch.ones(3, 2))
        last = hvd.join()
        assert last != first and COMM.allgather(last) == [last] * size


@pytest.mark.mpi(min_size=2)
def test_process_set_ops_run_over_its_ranks_only():
    rank, size = COMM.Get_rank(), COMM.Get_size()
    evens = hvd.add_process_set([r for r in range(size) if r % 2 == 0])
    try:
        tensor, values = _data((4,), torch.int32, seed=rank)
        everyone = _everyone(values)
        if evens.included():
            got = hvd.allreduce(tensor, op=hvd.Sum, process_set=evens)
            np.testing.assert_array_equal(got.numpy(), everyone[::2].sum(0))
            np.testing.assert_array_equal(hvd.broadcast(tensor, 2 if size > 2 else 0, process_set=evens).numpy(),
                                          everyone[2 if size > 2 else 0])
            assert evens.rank() == rank // 2 and evens.size() == (size + 1) // 2
        else:
            assert evens.rank() == -1
    finally:
        hvd.remove_process_set(evens)


@pytest.mark.mpi
def test_timeline_is_a_chrome_trace_with_every_ranks_ops(tmp_path):
    path = COMM.bcast(str(tmp_path / "timeline.json"), root=0)
    hvd.start_timeline(path)
    hvd.allreduce(torch.ones(3), name="traced")
    hvd.stop_timeline()
    if COMM.Get_rank() == 0:
        with open(path) as fh:
            events = json.load(fh)["traceEvents"]
        traced = [e for e in events if "traced" in e.get("name", "")]
        assert sorted({e["pid"] for e in traced}) == list(range(COMM.Get_size()))
        os.remove(path)


@pytest.mark.mpi
def test_basics_agree_with_mpi():
    assert (hvd.rank(), hvd.size()) == (COMM.Get_rank(), COMM.Get_size())
    local = COMM.Split_type(MPI.COMM_TYPE_SHARED)
    assert (hvd.local_rank(), hvd.local_size()) == (local.Get_rank(), local.Get_size())
    local.Free()
    assert hvd.cross_size() * hvd.local_size() == hvd.size() or not hvd.is_homogeneous()
    assert hvd.mpi_built() and not hvd.gloo_built() and hvd.nccl_built() == 0
    assert hvd.mpi_threads_supported() == (MPI.Query_thread() == MPI.THREAD_MULTIPLE)

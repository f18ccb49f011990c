"""ringtrain.engine's ops on NumPy arrays, against references computed with MPI and NumPy.

No framework is needed (tests/unit/test_layout.py checks the engine imports none).

Run at 1, 2, 3 and 4 ranks by tests/test_mpi_suite.py. Each rank submits
its ops in its own random order (ops are matched by name), and every result
is compared exactly with what MPI's allgather of everyone's data gives,
reduced with NumPy. Values are small integers, so sums are exact.
"""

import dataclasses
import time

import numpy as np
import pytest
from mpi4py import MPI

from ringtrain import engine
from ringtrain.engine.arrays import bf16_to_f32, f32_to_bf16

from cli.programs.late_sends import LateTo  # (tests/ is on the path: tests/conftest.py)

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.Get_rank(), COMM.Get_size()


@pytest.fixture(autouse=True)
def runtime():
    engine.init()
    yield
    engine.barrier()  # every test ends level: a rank that failed early must not leave its peers in an op


def _values(shape, seed, dtype=np.float32):
    return np.random.default_rng(seed).integers(-3, 4, size=shape).astype(dtype)


def _everyone(values):
    return np.stack(COMM.allgather(values))


@pytest.mark.mpi
def test_allreduce_in_place_into_out_and_new_in_any_order():
    rng = np.random.default_rng(RANK)  # each rank its own order
    shapes = {f"a{i}": (i + 1, 3) for i in range(6)}
    inputs = {name: _values(shape, RANK * 31 + i) for i, (name, shape) in enumerate(shapes.items())}
    outs = {name: np.empty_like(a) for name, a in inputs.items()}
    handles, kept = {}, {name: a.copy() for name, a in inputs.items()}
    for name in rng.permutation(sorted(shapes)):
        form = int(name[1:]) % 3  # in place, into out, into a new array
        out = inputs[name] if form == 0 else outs[name] if form == 1 else None
        handles[name] = engine.allreduce_async(inputs[name], name=name, op=engine.Sum, out=out)
    results = {name: engine.synchronize(h) for name, h in handles.items()}
    for name, result in sorted(results.items()):  # (the reference is collective: one order everywhere)
        form = int(name[1:]) % 3
        assert result is (inputs[name] if form == 0 else outs[name] if form == 1 else result)
        np.testing.assert_array_equal(result, _everyone(kept[name]).sum(0), err_msg=name)


@pytest.mark.mpi
@pytest.mark.parametrize("op", [engine.Sum, engine.Average])
def test_a_lone_large_allreduce_into_out_leaves_its_input_and_equals_in_place(op):
    # The bandwidth path of a lone op reads the input where it is when the result goes elsewhere.
    # Values of every magnitude: float32 sums that only the same order gives bitwise alike.
    rng = np.random.default_rng(RANK + 7)
    n = (1 << 18) + 5  # above the small-op bytes: the transport, not the announcement
    values = (rng.standard_normal(n) * 10.0 ** rng.integers(-3, 4, n)).astype(np.float32)
    kept = values.copy()
    out = np.full_like(values, np.nan)
    into = engine.synchronize(engine.allreduce_async(values, name="into", op=op, out=out))
    new = engine.synchronize(engine.allreduce_async(values, name="new", op=op))
    in_place = values.copy()
    engine.synchronize(engine.allreduce_async(in_place, name="in-place", op=op, out=in_place))
    aliased = values.copy()
    view = engine.synchronize(engine.allreduce_async(aliased, name="view", op=op, out=aliased.view()))
    want = _everyone(kept).astype(np.float64).sum(0)
    assert into is out and np.array_equal(values, kept)
    np.testing.assert_array_equal(into, in_place)
    np.testing.assert_array_equal(new, in_place)
    np.testing.assert_array_equal(view, in_place)  # an output over the input's own memory: in place
    np.testing.assert_allclose(in_place, want / SIZE if op == engine.Average else want, rtol=1e-5, atol=1e-2)


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", [np.float32, np.int32, np.float16])
@pytest.mark.parametrize("layout", ["strided", "transposed"])
@pytest.mark.parametrize("n", [4, 40_000], ids=["small", "large"])
def test_an_input_laid_over_its_output_from_the_same_address_is_read_before_it_is_overwritten(dtype, layout, n):
    # The input starts where the output does and holds other elements (every other one, or the
    # transpose): it must be read as it was, not taken for the output itself.
    side = int(n ** 0.5)
    memory = (np.arange(2 * n) % 7 + RANK).astype(dtype)
    if layout == "strided":
        x, out = memory[0::2][:n], memory[:n]
    else:
        out = memory[:side * side].reshape(side, side)
        x = out.T
    kept = x.copy()
    got = engine.synchronize(engine.allreduce_async(x, name="laid-over", op=engine.Sum, out=out))
    broadcast = (np.arange(2 * n) % 5 + RANK).astype(dtype)
    root_view = broadcast[0::2][:n] if layout == "strided" else broadcast[:side * side].reshape(side, side).T
    root_kept = COMM.bcast(root_view.copy(), root=0)
    cast = engine.synchronize(engine.broadcast_async(root_view, 0, name="laid-over-b", out=(
        broadcast[:n] if layout == "strided" else broadcast[:side * side].reshape(side, side))))
    want = _everyone(kept).sum(0, dtype=np.float64).astype(dtype)
    assert got is out
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(cast, root_kept)


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.float16, np.float64, np.bool_])
def test_every_op_of_every_dtype_matches_numpy(dtype):
    values = _values((4, 2), RANK + 1, np.float64)
    a = (values > 0) if dtype is np.bool_ else values.astype(dtype)
    everyone = _everyone(a)
    for op, reduce in [(engine.Sum, "sum"), (engine.Min, "min"), (engine.Max, "max")]:
        got = engine.synchronize(engine.allreduce_async(a, name=f"r{op}", op=op))
        want = getattr(everyone, "any" if dtype is np.bool_ and reduce != "min" else
                       "all" if dtype is np.bool_ else reduce)(0)
        np.testing.assert_array_equal(got, want.astype(got.dtype), err_msg=f"{dtype} {reduce}")
    gathered = engine.synchronize(engine.allgather_async(a, name="g"))
    np.testing.assert_array_equal(gathered, np.concatenate(list(everyone)))
    root = SIZE - 1
    b = engine.synchronize(engine.broadcast_async(a, root, name="b"))
    np.testing.assert_array_equal(b, everyone[root])


@pytest.mark.mpi
def test_bfloat16_bits_are_reduced_in_float32_and_rounded_back():
    values = _values((5,), RANK + 7) / 4  # quarter steps: exact in bfloat16
    raw = f32_to_bf16(values.astype(np.float32))
    got = engine.synchronize(engine.allreduce_async(raw, name="bf", op=engine.Sum, dtype="bfloat16"))
    assert got.dtype == np.uint16
    np.testing.assert_array_equal(bf16_to_f32(got), _everyone(values).sum(0).astype(np.float32))


@pytest.mark.mpi
def test_alltoall_and_reducescatter_match_numpy():
    splits = [(RANK + r) % 3 for r in range(SIZE)]
    a = np.repeat(np.arange(sum(splits), dtype=np.int64)[:, None] + 100 * RANK, 2, axis=1)
    out, received = engine.synchronize(engine.alltoall_async(a, splits, name="t"))
    everyone = COMM.allgather((a, splits))
    want = np.concatenate([x[sum(s[:RANK]):sum(s[:RANK + 1])] for x, s in everyone])
    np.testing.assert_array_equal(out, want.reshape(-1, 2))
    np.testing.assert_array_equal(received, [s[RANK] for _, s in everyone])
    rows = _values((SIZE * 2 + 1, 3), RANK)
    mine = engine.synchronize(engine.reducescatter_async(rows, name="rs", op=engine.Sum))
    total = _everyone(rows).sum(0)
    base, extra = divmod(total.shape[0], SIZE)
    start = RANK * base + min(RANK, extra)
    np.testing.assert_array_equal(mine, total[start:start + base + (RANK < extra)])


@pytest.mark.mpi
def test_ranks_that_disagree_all_get_a_mismatch_error():
    a = np.zeros(3 + RANK, np.float32)  # a shape of its own on every rank
    if SIZE == 1:
        pytest.skip("one rank cannot disagree with itself")
    with pytest.raises(engine.CollectiveMismatchError, match="shape"):
        engine.synchronize(engine.allreduce_async(a, name="bad"))


@pytest.mark.mpi
@pytest.mark.parametrize("odd_set", ["subset", "global"])
def test_one_name_on_two_process_sets_fails_both_ops_and_every_later_op_of_it_pairs_right(odd_set):
    # The last rank submits allreduce 'x' on one set while the others submit it on the other. Each set's
    # leader sees only its own op wait (at 3 and 4 ranks the two leaders differ): both ops must fail, on
    # every rank, before anyone goes on, or an op left waiting pairs with the next 'x', one step off.
    if SIZE == 1:
        pytest.skip("one rank cannot disagree with itself")
    subset = engine.add_process_set(engine.ProcessSet(range(1, SIZE) if SIZE > 2 else range(SIZE)))
    members, odd = list(subset.ranks), RANK == SIZE - 1
    on_subset = RANK in members and odd == (odd_set == "subset")
    errors, sums = [], []
    try:
        engine.allreduce(np.ones(3, np.float32), name="x",
                         process_set=subset if on_subset else engine.global_process_set)
    except engine.CollectiveMismatchError as exc:
        errors.append(str(exc))
    sums.append(engine.allreduce(np.ones(1, np.float32), name="x", op=engine.Sum)[0])  # the same name: level?
    if RANK in members:
        sums.append(engine.allreduce(np.ones(1, np.float32), name="x", op=engine.Sum, process_set=subset)[0])
    engine.barrier()
    engine.remove_process_set(subset)
    assert len(errors) == 1 and "every rank must submit the same op under one name" in errors[0], errors
    assert sums == [SIZE] + ([len(members)] if RANK in members else []), sums


def _sum_or_mismatch(value, process_set):
    try:
        return float(engine.allreduce(np.full(1, value, np.float32), name="x", op=engine.Sum,
                                      process_set=process_set)[0])
    except engine.CollectiveMismatchError:
        return "mismatch"


@pytest.mark.mpi
def test_one_name_on_three_sets_in_a_cycle_fails_every_op_and_every_later_op_of_it_pairs_right():
    # Ranks 0, 1, 2 submit 'x' on {0, 1}, {1, 2}, {0, 2}: each op waits for a rank whose op waits for another.
    # Then 'x' on the three ranks' set, and on each pair again. (A fourth rank only watches.)
    if SIZE < 3:
        pytest.skip("needs three ranks")
    sets = [engine.add_process_set(engine.ProcessSet(ranks)) for ranks in ([0, 1], [1, 2], [0, 2], [0, 1, 2])]
    got = []
    if RANK < 3:
        got = [_sum_or_mismatch(1, sets[RANK]), _sum_or_mismatch(1, sets[3])]
        got += [_sum_or_mismatch(10, ps) for ps in sets[:3] if RANK in ps.ranks]
    engine.barrier()
    for ps in sets:
        engine.remove_process_set(ps)
    assert got == (["mismatch", 3.0, 20.0, 20.0] if RANK < 3 else []), got


@pytest.mark.mpi
def test_an_op_waiting_for_a_late_rank_on_another_set_is_not_taken_for_a_conflict():
    # The last two ranks allreduce 'x' on their own set, one of them 2.5 s late; the others meanwhile wait on
    # 'x' of the global set, which the last rank is not in yet. That op may fail (a name in two sets for a
    # second), but the pair's op is right and on time: no one withdraws it.
    if SIZE == 1:
        pytest.skip("one rank cannot disagree with itself")
    pair = engine.add_process_set(engine.ProcessSet([SIZE - 2, SIZE - 1]))
    if RANK == SIZE - 2:
        time.sleep(2.5)
    got = [_sum_or_mismatch(1, pair)] if RANK in pair.ranks else []
    everyone = _sum_or_mismatch(1, engine.global_process_set)
    engine.barrier()
    engine.remove_process_set(pair)
    assert got == ([2.0] if RANK in pair.ranks else []), got
    assert len(set(COMM.allgather(everyone))) == 1  # the same outcome on every rank


def _through_a_handle(a, **kwargs):
    return engine.synchronize(engine.allreduce_async(a, **kwargs))


# A blocking small allreduce on an idle set runs alone, from synchronize (Protocol.run_alone, the op queued
# first) or from the blocking call (engine.allreduce: Channel.run_now, never queued): the tests below take both.
BLOCKING = pytest.mark.parametrize("reduce", [_through_a_handle, engine.allreduce], ids=["handle", "blocking"])


@pytest.mark.mpi
@BLOCKING
@pytest.mark.parametrize("late", [0.0, 0.2])
def test_a_loop_of_small_blocking_ops_matches_mpi_whoever_is_late(late, reduce):
    # A member late now and then (``late``: the share of steps a rank sleeps first) sends the others down
    # the general path mid-loop, with its announcement and theirs already sent. Every result must still be
    # MPI's, on every rank, in place, into an output or into a new array.
    rng = np.random.default_rng(RANK)
    inputs = [_values((16, 4), step * SIZE + RANK) for step in range(200)]
    results = []
    for step, a in enumerate(inputs):
        if rng.random() < late:
            time.sleep(rng.uniform(0, 0.002))
        a = a.copy()
        out = (a, np.empty_like(a), None)[step % 3]
        results.append(reduce(a, name=f"loop{step % 3}", op=engine.Sum, out=out))
        assert out is None or results[-1] is out
    everyone = COMM.allgather(inputs)
    for step, result in enumerate(results):
        np.testing.assert_array_equal(result, np.sum([e[step] for e in everyone], 0), err_msg=f"step {step}")


@pytest.mark.mpi
@BLOCKING
def test_a_record_that_changes_after_a_warm_loop_is_a_mismatch_on_every_rank(reduce):
    # After a loop every rank runs alone, the ranks' records are cached: a rank whose next op differs
    # (its prescale factor here) must still fail the op on every rank, as the general path fails it.
    if SIZE == 1:
        pytest.skip("one rank cannot disagree with itself")
    a = np.ones(8, np.float32)
    for _ in range(50):
        reduce(a, name="warm", out=a)
    factor = 2.0 if RANK == SIZE - 1 else 1.0
    with pytest.raises(engine.CollectiveMismatchError, match="ranks submitted different"):
        reduce(a, name="warm", out=a, prescale_factor=factor)
    np.testing.assert_array_equal(reduce(a, name="warm", out=a), 1.0)


@pytest.mark.mpi
@BLOCKING
def test_a_lone_op_stays_right_after_the_ids_of_records_start_again(reduce):
    # A broadcast makes a new record every call, so a loop of one named allreduce and one broadcast makes
    # the ranks start their records' ids again (every 4096): the lone announcement, which carries its
    # record's id, must carry the new one, or the members read another record under it.
    a = np.zeros(4, np.float32)
    for step in range(4200):
        a[:] = step + RANK
        got = reduce(a, name="loss", op=engine.Sum, out=a)
        engine.synchronize(engine.broadcast_async(np.full(2, step, np.float32), 0, name="b"))
        assert got[0] == SIZE * step + SIZE * (SIZE - 1) // 2, f"step {step}"
    protocol = engine.current().engine.channels[0].protocol  # (the kept buffers' count is theirs, not more)
    assert protocol._lone_bytes == sum(lone.nbytes for lone in protocol._lones.values())


@pytest.mark.mpi
@BLOCKING
def test_an_array_in_non_native_byte_order_is_refused_even_after_a_native_one_of_its_shape(reduce):
    # A native int64 allreduce of this shape makes a record the common op's shortcut finds by the
    # element type's name, which ">i8" shares: the swapped array must still be checked, and refused.
    for _ in range(3):
        reduce(np.arange(4, dtype=np.int64), name="native", op=engine.Sum)
    swapped = np.arange(4).astype(">i8")
    with pytest.raises(ValueError, match="non-native byte order"):
        reduce(swapped, name="swapped", op=engine.Sum, out=swapped)


@pytest.mark.mpi
@BLOCKING
def test_a_lone_op_whose_last_announcement_is_still_on_its_way_is_not_written_over(reduce, monkeypatch):
    # A name's lone calls reuse the buffer their announcement is written into; one too large for MPI to
    # send at once (allowed to ride with its announcement here) may still be on its way when the next
    # call starts, and that call must not write its data over it: each step's values differ, and each
    # result must be MPI's sum of that step's. (At 2 ranks MPICH has sent each before the next call
    # here: the 3- and 4-rank runs are the ones that catch a buffer written over.)
    current = engine.current().engine
    monkeypatch.setattr(current, "settings", dataclasses.replace(current.settings, local_bytes=4 << 20))
    inputs = [_values((1 << 18,), step * SIZE + RANK) for step in range(40)]
    results = [reduce(a.copy(), name="big", op=engine.Sum, out=None).copy() for a in inputs]  # (back to back)
    everyone = COMM.allgather(inputs)
    for step, result in enumerate(results):
        np.testing.assert_array_equal(result, np.sum([e[step] for e in everyone], 0), err_msg=f"step {step}")


@pytest.mark.mpi
@BLOCKING
def test_a_members_next_lone_call_that_comes_before_a_third_members_current_one_waits_its_turn(reduce,
                                                                                             monkeypatch):
    # The last rank's lone announcements reach rank 1 late, so rank 0, done with a step, announces its
    # next one before rank 1 has the last rank's share of this one: that must not be read where rank 0's
    # current share still lies. Each step's values differ; each result must be MPI's sum of that step's.
    if SIZE < 3:
        pytest.skip("needs a third member whose announcement comes late")
    if RANK == SIZE - 1:
        protocol = engine.current().engine.channels[0].protocol
        monkeypatch.setattr(protocol, "control", LateTo(protocol.control, 1, 0.002))
    inputs = [_values((8,), step * SIZE + RANK) for step in range(60)]
    results = [reduce(a.copy(), name="next", op=engine.Sum, out=None).copy() for a in inputs]
    everyone = COMM.allgather(inputs)
    for step, result in enumerate(results):
        np.testing.assert_array_equal(result, np.sum([e[step] for e in everyone], 0), err_msg=f"step {step}")


def _new_records_on_rank_1_until(ready, rows):
    """Allgathers of ever-new shapes on rank 1 (new records, new ids) until ``ready()`` there (every rank
    learns it by a broadcast); returns the next row count."""
    for _ in range(200):
        engine.synchronize(engine.allgather_async(np.zeros((rows if RANK == 1 else 1, 2), np.float32), name="g"))
        rows += 1
        if COMM.bcast(RANK == 1 and ready(), root=1):
            return rows
    raise AssertionError("rank 1's record ids never reached the state the test needs")


@pytest.mark.mpi
@BLOCKING
def test_a_members_record_id_given_to_another_record_after_its_ids_start_again_is_still_a_mismatch(reduce,
                                                                                                   monkeypatch):
    # Rank 1's ids start again (it keeps few here) while the others' do not, and the id its lone "loss"
    # (a sum) was announced under goes to its next "loss", an average: a member that kept how rank 1's
    # announcements of the sum began must not take the average's for it, on any call.
    if SIZE == 1:
        pytest.skip("one rank cannot disagree with itself")
    from ringtrain.engine import ops as engine_ops, protocol as protocol_module
    protocol = engine.current().engine.channels[0].protocol
    if RANK == 1:
        monkeypatch.setattr(protocol_module, "RECORD_IDS", 8)
    kept = [len(protocol._record_ids)]

    def started_again():
        kept.append(len(protocol._record_ids))
        return kept[-1] < kept[-2]
    rows = _new_records_on_rank_1_until(started_again, 2)  # (so the sum's id, given next, is below 8)
    summed = np.ones(2, np.float32)
    for _ in range(3):
        reduce(summed, name="loss", op=engine.Sum, out=None)
    record = engine_ops._host_record(summed, summed, None, engine.global_process_set, engine.Sum, 1.0, 1.0)
    sum_id = protocol._record_ids[id(record)][1] if RANK == 1 else None

    def sum_id_next():  # (ids started again since, and the next new record takes sum_id)
        ids = protocol._record_ids
        return sum_id not in {i for _, i in ids.values()} and (
            protocol._next_record_id == sum_id - 1 if sum_id > 1 else len(ids) >= protocol_module.RECORD_IDS)
    _new_records_on_rank_1_until(sum_id_next, rows)
    op = engine.Average if RANK == 1 else engine.Sum
    for _ in range(3):
        with pytest.raises(engine.CollectiveMismatchError, match="ranks submitted different"):
            reduce(np.full(2, RANK + 1.0, np.float32), name="loss", op=op, out=None)


@pytest.mark.mpi
def test_a_blocking_op_beside_async_ops_in_flight_runs_in_their_turn_and_a_name_in_flight_is_refused():
    # With ops in flight the blocking call cannot run alone: it is queued behind them, and the name of
    # one in flight is refused on this rank (every rank here), the op in flight going on unharmed.
    warm = np.ones(4, np.float32)
    for _ in range(20):
        engine.allreduce(warm, name="first", op=engine.Sum, out=warm.copy())
    first, second = _values((4,), RANK), _values((4,), RANK + 50)
    handle = engine.allreduce_async(first, name="first", op=engine.Sum)
    with pytest.raises(engine.DuplicateNameError, match="already in flight"):
        engine.allreduce(first, name="first", op=engine.Sum)
    got_second = engine.allreduce(second, name="second", op=engine.Sum)
    got_first = engine.synchronize(handle)
    np.testing.assert_array_equal(got_first, _everyone(first).sum(0))
    np.testing.assert_array_equal(got_second, _everyone(second).sum(0))


@pytest.mark.mpi
def test_names_that_do_not_fit_a_raw_announcement_still_reduce():
    # A name with a lone surrogate (as os.fsdecode makes of an undecodable byte) and one too long for the
    # raw announcement's length field: a loop of each must give MPI's sums, whichever path it takes.
    for name in ("path-\udcff", "n" * 20000):
        for step in range(5):
            a = _values((8,), step * SIZE + RANK)
            got = engine.synchronize(engine.allreduce_async(a.copy(), name=name, op=engine.Sum))
            np.testing.assert_array_equal(got, _everyone(a).sum(0), err_msg=f"{name[:8]} step {step}")


@pytest.mark.mpi
def test_two_threads_of_one_name_never_get_each_others_sums():
    # Two live threads called alike loop unnamed blocking small allreduces, each with values of its own and
    # at moments of its own on each rank: each result must be its own thread's sum.
    import threading

    got, ready = {}, threading.Barrier(2, timeout=60)

    def loop(k):
        rng = np.random.default_rng(10 * RANK + k)
        ready.wait()  # (both alive before either submits)
        try:
            got[k] = []
            for step in range(200):
                if rng.random() < 0.1:
                    time.sleep(0.001)  # (a moment's jitter, not the same on every rank)
                got[k].append(float(engine.allreduce(np.full(4, 1000.0 * k + step, np.float32), op=engine.Sum)[0]))
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            got[k] = repr(exc)
        ready.wait()  # (and both alive until both are done)

    threads = [threading.Thread(target=loop, args=(k,), name="worker") for k in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(100)
    assert got == {k: [SIZE * (1000.0 * k + step) for step in range(200)] for k in (1, 2)}


@pytest.mark.mpi
def test_objects_are_broadcast_and_gathered_and_ranks_naming_different_roots_fail_on_every_rank():
    got = engine.broadcast_object({"from": RANK, "pad": "x" * (RANK * 13)}, root_rank=SIZE - 1)
    everyone = engine.allgather_object(("rank", RANK, "y" * RANK))
    failed = None
    if SIZE > 1:
        try:
            engine.broadcast_object(RANK, root_rank=RANK % 2)  # (rank 0 names itself, rank 1 itself)
        except Exception as exc:  # noqa: BLE001 - its kind is checked below
            failed = exc
    after = engine.broadcast_object(RANK + 100, root_rank=0)
    assert got == {"from": SIZE - 1, "pad": "x" * ((SIZE - 1) * 13)}
    assert everyone == [("rank", r, "y" * r) for r in range(SIZE)]
    assert SIZE == 1 or (isinstance(failed, engine.CollectiveMismatchError) and "root" in str(failed)), repr(failed)
    assert after == 100


@pytest.mark.mpi
def test_an_op_that_fails_while_it_runs_names_the_op_on_every_rank():
    out = np.zeros(4, np.float32)
    out.flags.writeable = False
    with pytest.raises(engine.HorovodInternalError, match=r"allreduce 'ro': ValueError: .*read-only"):
        engine.allreduce(np.ones(4, np.float32), name="ro", op=engine.Sum, out=out)
    np.testing.assert_array_equal(engine.allreduce(np.ones(2), name="after", op=engine.Sum), np.full(2, SIZE))

"""The pure parts of ringtrain's engine, without MPI: verdicts, the board, names, stalls, argument checks."""

import math
import struct
import threading

import numpy as np
import pytest

from ringtrain.engine import arrays, kernels
from ringtrain.engine.alone import parse_alone, same_call
from ringtrain.engine.negotiation import (FAIL, JOINED, LOCAL, ORDERED, Allgather, Allreduce, Alltoall, Announcement,
                                          Barrier, Board, Broadcast, Call, Grouped, Names, Reducescatter, Refused,
                                          conflicts, first_difference, join_blocks, same_value, stall_report,
                                          thread_label, verdict)
from ringtrain.engine.ops import alltoall_splits

MEMBERS = (0, 1, 2)


def reduction(shape=(4,), dtype="float32", op="sum", prescale=1.0, kind="allreduce"):
    return {"allreduce": Allreduce, "reducescatter": Reducescatter}[kind](dtype, shape, op, prescale, 1.0, "cpu")


def announced(*records, data=None):
    return {r: Announcement(m, None, data) for r, m in zip(MEMBERS, records)}


def test_every_rank_reaches_the_same_verdict_and_the_first_field_that_differs_is_named():
    v = verdict("allreduce.x", MEMBERS, announced(reduction(), reduction(), reduction(shape=(5,))))
    assert v.action == FAIL and v.mismatch
    assert v.error == ("allreduce 'x': ranks submitted different shape: (4,) and (5,); every rank must submit the "
                       "same op under one name")
    assert "dtype: float32 and float64" in verdict("allreduce.x", MEMBERS, announced(
        reduction(), reduction(dtype="float64"), reduction())).error


def test_ranks_that_all_pass_nan_agree_and_nan_against_a_number_does_not():
    nan = float("nan")
    assert verdict("allreduce.x", MEMBERS, announced(*[reduction(prescale=float("nan")) for _ in MEMBERS])).action \
        == ORDERED
    assert same_value(nan, float("nan")) and same_value((1, (nan,)), (1, (float("nan"),)))
    assert not same_value(nan, 1.0)
    assert first_difference([reduction(prescale=nan), reduction(prescale=2.0)]) == "prescale: nan and 2.0"


def test_small_ops_whose_data_came_with_them_are_computed_on_the_spot_and_the_rest_are_ordered():
    meta = reduction()
    assert verdict("allreduce.x", MEMBERS, announced(meta, meta, meta, data=b"1234")).action == LOCAL
    assert verdict("allreduce.x", MEMBERS, announced(meta, meta, meta)).action == ORDERED
    barrier = Barrier()
    assert verdict("barrier.b", MEMBERS, announced(barrier, barrier, barrier)).action == LOCAL
    bcast = Broadcast("float32", (2,), 2, "cpu")
    by_rank = announced(bcast, bcast, bcast)
    assert verdict("broadcast.b", MEMBERS, by_rank).action == ORDERED
    by_rank[2] = Announcement(bcast, None, b"12345678")  # the root's data came with its announcement
    assert verdict("broadcast.b", MEMBERS, by_rank).action == LOCAL


def test_a_refusal_and_a_joined_rank_decide_the_verdict_for_everyone():
    refused = Refused("alltoall", "alltoall: splits must hold 3 counts")
    meta = Alltoall("float32", (), "cpu")
    v = verdict("alltoall.x", MEMBERS, announced(meta, refused, meta))
    assert v.action == FAIL and v.error == "alltoall 'x': rank 1 refused it: alltoall: splits must hold 3 counts"
    v = verdict("allreduce.x", MEMBERS, announced(reduction(), JOINED, reduction(), data=b"data"))
    assert v.action == LOCAL and v.joined == (1,)
    v = verdict("allgather.x", MEMBERS, announced(meta, JOINED, meta))
    assert v.action == FAIL and "rank(s) [1] have joined" in v.error


def test_grouped_ops_differ_by_length_then_by_tensor():
    one = Grouped("allreduce", (reduction(), reduction()))
    three = Grouped("allreduce", (reduction(), reduction(), reduction()))
    assert first_difference([one, three]) == "grouped length: 2 and 3"
    other = Grouped("allreduce", (reduction(), reduction(shape=(9,))))
    assert first_difference([one, other]) == "tensor 1 shape: (4,) and (9,)"
    # A group of two against one tensor (a variable only one rank's tape has) says so, not "allreduce and allreduce".
    assert first_difference([one, reduction()]) == "kind: grouped allreduce of 2 tensor(s) and allreduce"


def test_an_engine_change_the_ranks_disagree_on_is_named_by_what_it_is_not_by_its_counter():
    v = verdict("call.noname.0", (0, 1), announced(Call("add_process_set", (0, 1)), Call("add_process_set", (0, 1, 2))))
    assert v.action == FAIL and v.mismatch
    assert v.error.startswith("add_process_set: ranks submitted different arguments: (0, 1) and (0, 1, 2)"), v.error


def test_the_board_completes_an_op_when_every_member_has_announced_it_and_queues_the_next_of_that_name():
    board = Board(MEMBERS)
    assert not board.add(0, "allreduce.x", ("m", None, None), now=0.0)
    assert not board.add(1, "allreduce.x", ("m", None, None), now=1.0)
    # Rank 1 has finished this op already (a small op) and announces the name again: it waits its turn.
    assert not board.add(1, "allreduce.x", ("second", None, None), now=2.0)
    assert board.waiting(now=5.0) == [("allreduce.x", 5.0, [2])]
    assert board.add(2, "allreduce.x", ("m", None, None), now=3.0)
    assert [a[0] for a in board.announcements("allreduce.x").values()] == ["m", "m", "m"]
    assert not board.take("allreduce.x", now=4.0)
    assert board.announcements("allreduce.x") == {1: ("second", None, None)}


def test_an_op_failed_unmatched_takes_only_the_announcements_its_leader_had_the_rest_wait_for_the_next():
    # The leader failed allreduce 'x' with rank 0 announced (ranks 1 and 2 had submitted it on another set).
    # Here rank 2's next 'x' came before the leader's order, and landed in the failed op: it is kept.
    board = Board(MEMBERS)
    board.add(0, "allreduce.x", ("old", None, None), now=0.0)
    board.add(2, "allreduce.x", ("next", None, None), now=1.0)
    board.add(0, "allreduce.x", ("next", None, None), now=1.0)
    assert not board.take("allreduce.x", now=2.0, ranks=(0,))
    assert board.partial("allreduce.x") == {2: ("next", None, None), 0: ("next", None, None)}
    assert board.add(1, "allreduce.x", ("next", None, None), now=3.0)


def test_unnamed_ops_are_counted_per_process_set_and_kind():
    names = Names()
    assert [names.next(0, "allreduce"), names.next(0, "allreduce"), names.next(1, "allreduce"),
            names.next(0, "broadcast")] == ["noname.0", "noname.1", "noname.0", "noname.0"]


def test_each_threads_unnamed_ops_are_named_apart_so_two_threads_never_pair():
    names = Names()
    seen = {}

    def submit():
        label = thread_label(threading.current_thread())
        seen[label] = [names.next(0, "allreduce", label) for _ in range(2)]

    for name in ("loader", "trainer"):
        t = threading.Thread(target=submit, name=name)
        t.start()
        t.join()
    assert thread_label(threading.main_thread()) is None and names.next(0, "allreduce") == "noname.0"
    assert seen == {"loader": ["noname.loader.0", "noname.loader.1"],
                    "trainer": ["noname.trainer.0", "noname.trainer.1"]}


def test_two_live_threads_of_one_name_are_labelled_apart_in_the_order_they_started():
    labels, go, done = {}, threading.Event(), threading.Barrier(3, timeout=10)

    def label(k):
        go.wait(10)  # (every one alive while they ask)
        labels[k] = thread_label(threading.current_thread())
        done.wait()

    threads = [threading.Thread(target=label, args=(k,), name="worker") for k in range(3)]
    for t in threads:
        t.start()
    go.set()
    for t in threads:
        t.join()
    assert labels == {0: "worker", 1: "worker#1", 2: "worker#2"}


def test_a_thread_started_after_its_twin_ended_never_takes_a_live_threads_label():
    labels, both, hold = {}, threading.Barrier(2, timeout=10), threading.Event()

    def label(k):
        if k < 2:
            both.wait()  # (the first two alive together when they ask)
        labels[k] = thread_label(threading.current_thread())
        if k == 1:
            hold.wait(10)

    first, second = (threading.Thread(target=label, args=(k,), name="w") for k in (0, 1))
    first.start(), second.start()
    first.join()  # ("w" has ended; "w#1" lives on)
    third = threading.Thread(target=label, args=(2,), name="w")
    third.start(), third.join()
    hold.set()
    second.join()
    assert labels[0] == "w" and labels[1] == "w#1" and labels[2] != "w#1", labels


def test_an_op_a_missing_rank_submitted_as_another_kind_or_on_another_set_is_a_conflict_once_it_lingers():
    waiting = [("allreduce.x", 2.0, [1]), ("allreduce.y", 2.0, [1]), ("allreduce.z", 0.1, [1])]
    reports = {1: [(0, "allgather.x", 5.0), (3, "allreduce.y", 6.0), (0, "allgather.z", 7.0)]}
    found = {key: (error, partner) for key, error, partner in conflicts(0, [0, 1], waiting, reports, 1.0).failed}
    assert set(found) == {"allreduce.x", "allreduce.y"}  # z has not waited long enough to tell
    assert "rank 1 submitted it as allgather on process set 0" in found["allreduce.x"][0]
    why = found["allreduce.y"][0]
    assert "rank 1 submitted it as allreduce on process set 3, not allreduce on process set 0" in why
    assert found["allreduce.x"][1] is None and found["allreduce.y"][1] == (3, "allreduce.y")


def test_both_ops_of_a_conflict_on_one_set_fail_together_whatever_the_reports_say_so_far():
    # Rank 1 submitted allgather 'x' where rank 0 submitted allreduce 'x'; only rank 1's report has arrived.
    # Failing one alone would let its rank go on, and its next allreduce 'x' pair with the one left waiting.
    waiting = [("allreduce.x", 2.0, [1]), ("allgather.x", 0.2, [0])]
    found = conflicts(0, [0, 1], waiting, {1: [(0, "allgather.x", 5.0)]}, probe_s=1.0)
    failed = {key: error for key, error, _ in found.failed}
    assert set(failed) == {"allreduce.x", "allgather.x"} and found.elsewhere == []
    assert failed["allgather.x"].startswith("allgather 'x': rank 0 submitted it as allreduce on process set 0")


def test_a_partner_on_another_set_is_withdrawn_by_each_rank_that_submitted_that_very_op():
    # Set 0 is ranks 0-3. Ranks 2 and 3 submitted allreduce 'x' on set 4 instead (the ones they submitted at
    # 5.0 and 6.0 on their clocks); rank 2 also reports an allgather 'x' on set 0, which is not this partner.
    waiting = [("allreduce.x", 2.0, [2, 3])]
    reports = {2: [(4, "allreduce.x", 5.0), (0, "allgather.x", 9.0)], 3: [(4, "allreduce.x", 6.0)]}
    found = conflicts(0, [0, 1, 2, 3], waiting, reports, probe_s=1.0)
    assert [(key, partner) for key, _, partner in found.failed] == [("allreduce.x", (4, "allreduce.x"))]
    why = ("allreduce 'x': ranks [0, 1] submitted it as allreduce on process set 0, not allreduce on process "
           "set 4; every rank must submit the same op under one name")
    assert found.elsewhere == [(2, 4, "allreduce.x", 5.0, why, (0, "allreduce.x", (0, 1))),
                               (3, 4, "allreduce.x", 6.0, why, (0, "allreduce.x", (0, 1)))]


def test_an_op_only_a_late_rank_is_missing_from_is_not_failed_with_its_partner():
    # Ranks 0 and 1 submitted both kinds of 'x', rank 2 only the allgather, rank 3 nothing yet: the
    # allreduce conflicts with rank 2's allgather, but the allgather waits only for rank 3, rightly.
    waiting = [("allreduce.x", 2.0, [2, 3]), ("allgather.x", 2.0, [3])]
    found = conflicts(0, [0, 1, 2, 3], waiting, {2: [(0, "allgather.x", 5.0)]}, probe_s=1.0)
    assert [key for key, _, _ in found.failed] == ["allreduce.x"] and found.elsewhere == []


def test_unnamed_ops_of_two_sets_or_kinds_are_two_ops_not_a_conflict():
    waiting = [("barrier.noname.0", 5.0, [0, 2])]
    assert conflicts(0, [0, 1, 2], waiting, {2: [(1, "barrier.noname.0", 1.0)]}, probe_s=1.0) == ([], [])


def test_only_allreduces_wait_for_a_rank_that_has_joined():
    gather = Announcement(Allgather("float32", (), "cpu"))
    assert join_blocks("allgather.x", [1], {0: gather}) == [1]  # rank 1 never will
    assert join_blocks("allgather.x", [1], {0: gather, 1: gather}) is None
    assert join_blocks("allreduce.x", [1], {0: Announcement(reduction())}) is None  # rank 1 adds zeros
    assert join_blocks("allgather.x", [], {0: gather}) is None


def test_horovods_stall_warning_names_the_missing_ranks_and_marks_those_past_the_shutdown_time():
    waiting = [("allreduce.a", 3.0, [2]), ("allreduce.b", 7.0, [1, 2]), ("allreduce.c", 0.5, [1])]
    message, shut_down = stall_report(0, MEMBERS, waiting, warn_s=2.0, shutdown_s=0.0)
    assert not shut_down and "Missing ranks:\n1: [allreduce.b]\n2: [allreduce.a, allreduce.b]" in message
    message, shut_down = stall_report(0, MEMBERS, waiting, warn_s=2.0, shutdown_s=5.0)
    assert shut_down and "1!: [allreduce.b]" in message and "Will shutdown" in message
    assert stall_report(0, MEMBERS, waiting[2:], warn_s=2.0, shutdown_s=5.0) == (None, False)


def test_alltoall_splits_are_checked_on_the_rank_that_passes_them():
    assert alltoall_splits(6, None, 3) == [2, 2, 2]
    assert alltoall_splits(6, np.array([0, 5, 1], dtype=np.int32), 3) == [0, 5, 1]
    assert alltoall_splits(6, [1, 1, 0], 3) == [1, 1, 0]  # rows left over stay behind
    for rows, splits, message in [(7, None, "not a multiple"), (6, np.ones(3), "int32"),
                                  (6, [1, 1], "3 counts of at least 0"), (6, [-1, 1, 1], "3 counts"),
                                  (2, [1, 1, 1], "more than the first dimension")]:
        with pytest.raises(ValueError, match=message):
            alltoall_splits(rows, splits, 3)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, np.int32, np.int8, np.uint8, np.bool_])
@pytest.mark.parametrize("op", ["sum", "average", "min", "max", "product"])
def test_a_small_op_computed_on_the_spot_matches_a_numpy_reduction(dtype, op):
    rng = np.random.default_rng(3)
    values = [rng.integers(0 if dtype in (np.uint8, np.bool_) else -3, 4, size=5) for _ in range(3)]
    inputs = [v.astype(dtype) for v in values]
    out = np.empty(5, dtype)
    # Rank 1's input arrives as raw bytes, as it would from another rank (and as a view of a received buffer).
    for theirs in (kernels.raw_bytes(inputs[1]), memoryview(bytearray(kernels.raw_bytes(inputs[1])))):
        got = kernels.reduce_locally(reduction(shape=(5,), dtype=np.dtype(dtype).name, op=op),
                                     [inputs[0], theirs, inputs[2]], out)
        assert got is out
        stacked = np.stack([v.astype(np.float64) for v in values])
        if dtype == np.bool_:
            want = stacked.any(0) if op in ("sum", "average", "max") else stacked.all(0)
        else:
            want = {"sum": stacked.sum(0), "min": stacked.min(0), "max": stacked.max(0), "product": stacked.prod(0),
                    "average": stacked.sum(0) / 3}[op]
            if op == "average" and np.dtype(dtype).kind != "f":
                want = np.trunc(want)  # integers are averaged in float64 and truncated, as Horovod does
            if op == "average" and dtype in (np.float32, np.float64):
                want = stacked.sum(0).astype(dtype) / dtype(3)  # the sum, then one division in the dtype
        # Half precision sums, then multiplies by 1/3 (as Horovod): equal to about its precision.
        np.testing.assert_allclose(got.astype(np.float64), want, rtol=1e-2 if dtype == np.float16 else 0)


def test_the_fast_sum_gives_the_bits_of_summing_in_member_order():
    rng = np.random.default_rng(0)
    views = [rng.standard_normal(64).astype(np.float32) for _ in range(4)]
    want = (((views[0] + views[1]) + views[2]) + views[3]) / np.float32(4)
    # In place, in the middle: its own value must be read before it is overwritten.
    got = kernels.reduce_locally(reduction(shape=(64,), op="average"), views, views[2])
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("op", ["sum", "average"])
@pytest.mark.parametrize("mine_first", [True, False])
def test_a_lone_ops_two_inputs_its_own_and_a_peers_bytes_give_numpys_result_in_place(op, mine_first):
    # The lone lane's case at 2 ranks: this rank's array is the output, the peer's comes as received bytes.
    rng = np.random.default_rng(1)
    mine, theirs = (rng.standard_normal((4, 8)).astype(np.float32) for _ in range(2))
    want = (mine + theirs) / np.float32(2) if op == "average" else mine + theirs
    out = mine.copy()
    received = memoryview(bytearray(theirs.tobytes()))
    inputs = [out, received] if mine_first else [received, out]
    got = kernels.reduce_locally(reduction(shape=(4, 8), op=op), inputs, out)
    assert got is out
    np.testing.assert_array_equal(got, want)


def test_an_array_of_strings_is_refused_naming_what_it_holds():
    problem = arrays.check_array(np.array([b"a", b"bc"], dtype=object), "allgather")
    assert problem.startswith("allgather: element type object (strings or Python objects) is not supported; use")


def test_an_array_in_non_native_byte_order_is_refused_naming_the_fix():
    swapped = np.arange(4, dtype=np.dtype(np.int64).newbyteorder())
    problem = arrays.check_array(swapped, "allreduce")
    assert problem.startswith("allreduce: the array's elements are in non-native byte order")
    assert arrays.check_array(swapped.astype(swapped.dtype.newbyteorder("=")), "allreduce") is None


def test_fusion_keys_treat_nan_factors_alike():
    assert reduction(prescale=float("nan")).fuse_key() == reduction(prescale=math.nan).fuse_key()
    assert reduction(shape=(3,)).fuse_key() == reduction(shape=(9,)).fuse_key()


def lone_announcement(rank, record_id, name, data):
    """A raw lone announcement as the wire format says: rank, record id, the name's length (<iiH), the name,
    zeros to a multiple of 8 bytes, the data."""
    fields = struct.pack("<iiH", rank, record_id, len(name)) + name
    return fields + bytes(-len(fields) % 8) + data


def test_a_lone_announcement_is_taken_as_a_members_next_call_only_with_its_rank_record_id_and_name():
    # A member's lone announcement is checked against how its last one of the record began (rank, record
    # id, name's length) and against this rank's name, not decoded: a name of the same length, another
    # member or another record id must each send it to the general path.
    sent = lone_announcement(1, 7, b"loss", b"\x00" * 16)
    assert parse_alone(sent)[:3] == (1, 7, b"loss") and bytes(parse_alone(sent)[3]) == b"\x00" * 16
    fields = sent[:10]
    assert same_call(bytearray(sent), fields, b"loss")
    assert not same_call(bytearray(sent), fields, b"lost")
    assert not same_call(bytearray(lone_announcement(2, 7, b"loss", b"")), fields, b"loss")
    assert not same_call(bytearray(lone_announcement(1, 8, b"loss", b"")), fields, b"loss")
    assert not same_call(bytearray(lone_announcement(1, 7, b"losses", b"")), fields, b"losses")

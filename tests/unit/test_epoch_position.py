"""The position in samples: an epoch cut at any step on N ranks goes on exactly on M ranks (pure, without MPI).

The reference for "exactly" is the dataset: every row, once per epoch (with
padding, the rows each rank repeats to fill its last batch, none more than twice). The rows the
first part trained on are read off the N-rank plans directly, not through
the code under test.
"""

import collections
import itertools

import numpy as np
import pytest

from ringtrain.data.sharding import EpochPart, EpochPlan, shard_bounds
from ringtrain.training.resume import Position, data_position, position_from_meta

ROWS, BATCH, SEED, EPOCH = 103, 4, 5, 2


def plans(ranks, drop_last=False):
    return [EpochPlan(ROWS, ranks, r, BATCH, seed=SEED, drop_last=drop_last) for r in range(ranks)]


def rows_of(schedule, plan, upto=None):
    """Global row numbers a rank trains on from the schedule's first step to ``upto`` (default: the end)."""
    start, _ = shard_bounds(plan.num_samples, plan.num_shards, plan.rank)
    steps = range(schedule.first_step, schedule.steps if upto is None else upto)
    return [start + int(i) for step in steps for i in schedule.batch_indices(step)]


def straight_rows(ranks, steps, drop_last):
    """The rows the first ``steps`` steps of an ordinary epoch train on, from epoch_order itself."""
    out = []
    for plan in plans(ranks, drop_last):
        start, _ = shard_bounds(ROWS, ranks, plan.rank)
        out += [start + int(i) for i in plan.epoch_order(EPOCH)[:steps * BATCH]]
    return out


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("drop_last", [False, True])
def test_a_fresh_epochs_schedule_is_the_ordinary_epoch_bitwise(ranks, drop_last):
    for plan in plans(ranks, drop_last):
        schedule = plan.schedule(EPOCH)
        assert (schedule.first_step, schedule.steps) == (0, plan.steps_per_epoch)
        for step in range(plan.steps_per_epoch):
            np.testing.assert_array_equal(schedule.batch_indices(step), plan.batch_indices(EPOCH, step))


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_a_resume_at_the_same_rank_count_goes_on_with_the_same_batches(ranks):
    for cut in range(plans(ranks)[0].steps_per_epoch + 1):
        for plan in plans(ranks):
            parts = plan.schedule(EPOCH).parts_at(cut)
            assert parts == ((EpochPart(ranks, cut * ranks * BATCH),) if cut else ())
            resumed = plan.schedule(EPOCH, parts)
            assert resumed.first_step == cut and resumed.steps == plan.steps_per_epoch
            for step in range(cut, plan.steps_per_epoch):
                np.testing.assert_array_equal(resumed.batch_indices(step), plan.batch_indices(EPOCH, step))


@pytest.mark.parametrize("n, m", [(n, m) for n, m in itertools.product(range(1, 6), repeat=2) if n != m])
@pytest.mark.parametrize("drop_last", [False, True])
def test_an_epoch_cut_on_n_ranks_goes_on_on_m_with_no_row_skipped_or_repeated(n, m, drop_last):
    for cut in range(1, plans(n, drop_last)[0].steps_per_epoch):
        before = straight_rows(n, cut, drop_last)
        parts = (EpochPart(n, cut * n * BATCH),)
        unseen = set(range(ROWS)) - set(before)
        schedules = [plan.schedule(EPOCH, parts) for plan in plans(m, drop_last)]
        assert len({(s.first_step, s.steps) for s in schedules}) == 1  # every rank runs the same steps
        assert schedules[0].first_step == cut
        after = []
        for plan, schedule in zip(plans(m, drop_last), schedules):
            mine = rows_of(schedule, plan)
            start, stop = shard_bounds(ROWS, m, plan.rank)
            left = unseen & set(range(start, stop))
            # A rank takes its rows left first; padding repeats them once, then rows trained before the cut.
            fresh = min(len(mine), len(left) if drop_last else 2 * len(left))
            assert set(mine[:fresh]) <= left and not set(mine[fresh:]) & left, (n, m, cut, plan.rank)
            after += mine
        if drop_last:
            assert len(set(after)) == len(after) and not set(after) & set(before)
        else:
            assert set(before) | set(after) == set(range(ROWS)), (n, m, cut)
            # As in an ordinary epoch, padding trains no row more than twice, even at a cut in the last batch.
            assert max(collections.Counter(before + after).values()) <= 2, (n, m, cut)
        assert schedules[0].parts_at(schedules[0].steps)[:1] == parts


def test_a_chain_of_rank_counts_in_one_epoch_still_covers_every_row_once():
    first = (EpochPart(2, 3 * 2 * BATCH),)
    second_plans = plans(3)
    middle = [plan.schedule(EPOCH, first) for plan in second_plans]
    cut = middle[0].first_step + 2  # two steps on 3 ranks
    parts = middle[0].parts_at(cut)
    assert parts == (EpochPart(2, 24), EpochPart(3, 24))
    before = straight_rows(2, 3, False) + [r for p, s in zip(second_plans, middle) for r in rows_of(s, p, cut)]
    assert len(set(before)) == len(before) == 48
    last = [(plan, plan.schedule(EPOCH, parts)) for plan in plans(4)]
    after = [r for plan, schedule in last for r in rows_of(schedule, plan)]
    assert last[0][1].first_step == 5 and not set(after) & set(before)
    assert set(before) | set(after) == set(range(ROWS))


@pytest.mark.parametrize("parts, words", [
    ((EpochPart(2, 7),), "not a whole number of steps"),
    ((EpochPart(2, 2 * BATCH * 100),), "longer than the"),
    ((EpochPart(3, 3 * BATCH * 100),), "longer than the"),
])
def test_parts_that_cannot_be_this_epoch_are_refused(parts, words):
    with pytest.raises(ValueError, match=words):
        plans(2)[0].schedule(EPOCH, parts)


# --- the checkpoint's record --------------------------------------------------------------

def meta(**extra):
    return dict({"step": 40, "epoch": 1, "step_in_epoch": 5, "nonfinite_streak": 0, "world_size": 2}, **extra)


def test_an_old_checkpoint_without_the_record_is_the_same_position_in_samples():
    old = position_from_meta(meta(), BATCH, ranks=3)
    assert old == Position(40, 1, 5, 0, (EpochPart(2, 5 * 2 * BATCH),))
    new = position_from_meta(meta(data_position=data_position(1, old.parts)), BATCH, ranks=3)
    assert new == old
    # Older still: no rank count recorded, so the one it is resumed on.
    no_ranks = {k: v for k, v in meta().items() if k != "world_size"}
    assert position_from_meta(no_ranks, BATCH, ranks=3).parts == (EpochPart(3, 5 * 3 * BATCH),)
    assert position_from_meta(meta(step_in_epoch=0), BATCH, ranks=3).parts == ()


def test_the_record_is_plain_json():
    assert data_position(3, (EpochPart(2, 16), EpochPart(3, 24))) == {"epoch": 3, "parts": [[2, 16], [3, 24]]}


@pytest.mark.parametrize("record, words", [
    ({"epoch": 0, "parts": []}, "it is for epoch 0, not 1"),
    ({"epoch": 1}, "expected"),
    ({"epoch": 1, "parts": [[2]]}, "expected"),
    ({"epoch": 1, "parts": [["2", 40]]}, "not a pair of counts"),
    ({"epoch": 1, "parts": [[2, -8]]}, "not a pair of counts"),
    ({"epoch": 1, "parts": [[0, 0]]}, "not a whole number"),
    ({"epoch": 1, "parts": [[2, 41]]}, "not a whole number of steps"),
    ({"epoch": 1, "parts": [[2, 32]]}, "add up to 4 steps and step_in_epoch is 5"),
    ("parts", "expected"),
])
def test_a_damaged_record_is_a_value_error_naming_it(record, words):
    with pytest.raises(ValueError, match=words):
        position_from_meta(meta(data_position=record), BATCH, ranks=2)

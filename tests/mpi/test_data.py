"""Sharded loading at every size, checked against a single-process load of the same data."""

import os
import shutil
import tempfile

import numpy as np
import pytest
from mpi4py import MPI

from ringtrain import UsageError
from ringtrain.data.sharding import EpochPlan
from ringtrain.data.load import load_sharded
from ringtrain.training.evaluate import reduce_eval, sum_eval

SYNTHETIC = dict(samples=1009, features=7, classes=3, seed=4, test_fraction=0.2)  # 1009 is prime


@pytest.fixture
def shared_dir():
    """Rank 0 makes a directory and every rank gets its name; removed when all are done.

    Not pytest's tmp_path: each rank is its own pytest process, and their
    clean-ups of old temporary directories race with one another.
    """
    comm = MPI.COMM_WORLD
    path = comm.bcast(tempfile.mkdtemp(prefix="ringtrain-test-") if comm.Get_rank() == 0 else None)
    yield path
    comm.Barrier()
    if comm.Get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)


def _written(comm, directory, write):
    """Rank 0 writes files with ``write(directory)``; the others wait for them."""
    if comm.Get_rank() == 0:
        write(directory)
    comm.Barrier()
    return directory


def _id_dataset(directory, rows=211, features=4):  # 211 is prime
    # Column 0 is the row number, so rows can be told apart after sharding.
    x = np.random.default_rng(1).normal(size=(rows, features))
    x[:, 0] = np.arange(rows)
    np.save(os.path.join(directory, "x.npy"), x)
    np.save(os.path.join(directory, "y.npy"), np.arange(rows) % 5)


@pytest.mark.mpi
def test_synthetic_shards_are_the_dataset_in_order():
    comm = MPI.COMM_WORLD
    shard = load_sharded("synthetic", comm, **SYNTHETIC)
    whole = load_sharded("synthetic", MPI.COMM_SELF, **SYNTHETIC)
    pieces = comm.allgather((shard.x, shard.y, shard.x_test, shard.y_test, shard.train_bounds, shard.test_bounds))
    xs, ys, xts, yts, train_bounds, test_bounds = zip(*pieces)
    # Every assertion after the last collective.
    assert np.array_equal(np.concatenate(xs), whole.x) and np.array_equal(np.concatenate(ys), whole.y)
    assert np.array_equal(np.concatenate(xts), whole.x_test) and np.array_equal(np.concatenate(yts), whole.y_test)
    for bounds, total in ((train_bounds, whole.num_train), (test_bounds, whole.num_test)):
        assert bounds[0][0] == 0 and bounds[-1][1] == total
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))  # contiguous and disjoint
        assert max(b - a for a, b in bounds) - min(b - a for a, b in bounds) <= 1
    assert (shard.num_train, shard.num_test, shard.num_classes) == (whole.num_train, whole.num_test, 3)


@pytest.mark.mpi
def test_memory_mapped_rows_are_each_read_by_exactly_one_rank(shared_dir):
    comm = MPI.COMM_WORLD
    directory = _written(comm, shared_dir, _id_dataset)
    shard = load_sharded(directory, comm, seed=3, test_fraction=0.25)
    train_ids = np.concatenate(comm.allgather(shard.x[:, 0]))
    test_ids = np.concatenate(comm.allgather(shard.x_test[:, 0]))
    assert len(train_ids) == shard.num_train and len(test_ids) == shard.num_test
    ids = np.concatenate([train_ids, test_ids])
    assert np.array_equal(np.sort(ids), np.arange(211))  # union is the file, nothing twice
    assert np.all(np.diff(train_ids) > 0)  # training rows in file order
    assert shard.num_classes == 5 and np.array_equal(shard.y, shard.x[:, 0].astype(np.int64) % 5)


@pytest.mark.mpi
@pytest.mark.parametrize("drop_last", [False, True])
def test_every_rank_runs_the_same_steps_and_the_same_seed_the_same_batches(drop_last):
    comm = MPI.COMM_WORLD
    shard = load_sharded("synthetic", comm, batch_size=8, **SYNTHETIC)
    plan = EpochPlan.for_shard(shard, comm, batch_size=8, seed=11, drop_last=drop_last)
    again = EpochPlan(shard.num_train, comm.Get_size(), comm.Get_rank(), 8, seed=11, drop_last=drop_last)
    epoch0 = [b for _, b in plan.batches(0)]
    epoch1 = [b for _, b in plan.batches(1)]
    steps = comm.allgather(plan.steps_per_epoch)
    # The global rows this rank trains on in epoch 0, as row numbers.
    seen = np.concatenate(comm.allgather(shard.train_bounds[0] + np.concatenate(epoch0)))
    assert len(set(steps)) == 1 and steps[0] >= 1
    assert all(np.array_equal(a, b) for a, b in zip(epoch0, (b for _, b in again.batches(0)), strict=True))
    assert not all(np.array_equal(a, b) for a, b in zip(epoch0, epoch1))
    counts = np.bincount(seen, minlength=shard.num_train)
    if drop_last:
        assert counts.max() == 1 and counts.sum() == steps[0] * 8 * comm.Get_size()
    else:
        assert counts.min() >= 1 and counts.max() <= 2


class _Linear:
    """A fixed linear classifier with the model protocol's ``evaluate``."""

    def __init__(self, features, classes):
        self.weights = np.random.default_rng(0).normal(size=(features, classes))

    def evaluate(self, x, y):
        logits = x.astype(np.float64) @ self.weights
        logits -= logits.max(axis=1, keepdims=True)
        losses = np.log(np.exp(logits).sum(axis=1)) - logits[np.arange(len(y)), y]
        return float(losses.sum()), int((logits.argmax(axis=1) == y).sum())


@pytest.mark.mpi
def test_evaluation_sums_equal_a_single_process_evaluation():
    comm = MPI.COMM_WORLD
    shard = load_sharded("synthetic", comm, **SYNTHETIC)
    whole = load_sharded("synthetic", MPI.COMM_SELF, **SYNTHETIC)
    model = _Linear(7, 3)
    # Small batches, so ranks run different numbers of them.
    totals = reduce_eval(model, shard, comm, batch_size=16)
    by_hand = sum_eval(*model.evaluate(shard.x_test, shard.y_test), len(shard.y_test), comm=comm)
    loss_sum, correct = model.evaluate(whole.x_test, whole.y_test)
    count = len(whole.y_test)
    for result in (totals, by_hand):
        assert (result.correct, result.count) == (correct, count)
        assert result.accuracy == correct / count
        assert result.loss_sum == pytest.approx(loss_sum, rel=1e-12)


@pytest.mark.mpi
def test_bad_row_on_one_rank_is_an_error_on_every_rank(shared_dir):
    comm = MPI.COMM_WORLD
    last = comm.Get_size() - 1

    def write(directory):
        _id_dataset(directory)
        x = np.load(os.path.join(directory, "x.npy"))
        x[210, 2] = np.nan  # the last training row: only the last rank reads it
        np.save(os.path.join(directory, "x.npy"), x)

    directory = _written(comm, shared_dir, write)
    caught = None
    try:
        load_sharded(directory, comm, test_fraction=0.0)
    except UsageError as exc:
        caught = exc
    messages = comm.allgather(str(caught) if caught else None)
    assert caught is not None and caught.everywhere
    assert len(set(messages)) == 1
    prefix = f"rank {last}: " if comm.Get_size() > 1 else ""
    assert str(caught) == f"{prefix}{directory}: x.npy has a non-finite value (NaN, inf or beyond float32) in row 210"


@pytest.mark.mpi
def test_missing_file_on_one_rank_only_is_an_error_on_every_rank(shared_dir):
    comm = MPI.COMM_WORLD
    directory = _written(comm, shared_dir, _id_dataset)
    # Only rank 0 is given a path that does not exist.
    path = os.path.join(directory, "gone") if comm.Get_rank() == 0 else directory
    caught = None
    try:
        load_sharded(path, comm)
    except UsageError as exc:
        caught = exc
    messages = comm.allgather(str(caught) if caught else None)
    assert caught is not None and caught.everywhere and len(set(messages)) == 1
    assert str(caught).endswith(f"{directory}/gone: no such file or directory "
                                "(expected a .npz file or a directory of .npy files)")


@pytest.mark.mpi
def test_dataset_too_small_for_ranks_times_batch_is_refused_everywhere():
    comm = MPI.COMM_WORLD
    caught = None
    try:
        load_sharded("synthetic", comm, samples=40, features=2, classes=2, test_fraction=0.0,
                     batch_size=40 // comm.Get_size() + 1)
    except UsageError as exc:
        caught = exc
    comm.Barrier()
    assert caught is not None and caught.everywhere and "too few" in str(caught)

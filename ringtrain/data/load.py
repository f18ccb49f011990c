"""Datasets, loaded so that each rank holds only its own shard.

:func:`load_sharded` is the one entry point: every rank calls it, and every
rank gets back a :class:`Shard` with its own training and evaluation rows
plus the global counts. The index maths (which rows are whose, the per-epoch
shuffles, equal steps per rank) is in :mod:`ringtrain.data.sharding`.

The sources, and how each is read and checked, are in :mod:`ringtrain.data.sources`.
"""

import dataclasses
import os

import numpy as np

from .sharding import check_batch_size, shard_bounds
from .sources import open_source, read_rows
from ..errors import MismatchError, UsageError
from ..failure import agree
from ..io.safeio import human_bytes, physical_memory

__all__ = ["Shard", "load_sharded"]


@dataclasses.dataclass(frozen=True, eq=False)
class Shard:
    """One rank's part of a dataset: a plain, frozen record.

    Attributes:
        x: this rank's training rows, float32, (rows, num_features).
        y: their labels, int64 in [0, num_classes).
        x_test: this rank's evaluation rows (no padding; may be empty).
        y_test: their labels.
        num_train: training rows over all ranks.
        num_test: evaluation rows over all ranks.
        num_features: features per row.
        num_classes: number of classes.
        name: the dataset name or path as given.
        rank: the rank this shard belongs to.
        size: number of ranks it was split over.
        train_bounds: ``(start, stop)`` of this shard among the training rows.
        test_bounds: ``(start, stop)`` of this shard among the evaluation rows.
        image_shape: ``(channels, height, width)`` of one row when the rows
            are images (digits, mnist5k, image arrays), else None.
        scaling: the :class:`ringtrain.data.standardize.Scaling` that
            ``x`` and ``x_test`` were standardised with, or None (as read).
    """

    x: np.ndarray
    y: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_train: int
    num_test: int
    num_features: int
    num_classes: int
    name: str
    rank: int = 0
    size: int = 1
    train_bounds: tuple = (0, 0)
    test_bounds: tuple = (0, 0)
    image_shape: tuple = None
    scaling: object = None


def load_sharded(name_or_path, comm=None, *, seed=0, test_fraction=0.2, batch_size=None, num_classes=None,
                 samples=10_000, features=20, classes=10, separation=1.0):
    """Load this rank's shard of a dataset, with errors agreed by every rank.

    Collective: every rank of ``comm`` must call it, with the same arguments.
    It makes four collectives (two :func:`ringtrain.failure.agree` calls, an
    allgather comparing the dataset's shape across ranks and, when the class
    count is inferred, one allreduce), so a problem found by
    any rank is raised on all of them, before any training collective.

    Args:
        name_or_path: ``digits``, ``mnist5k``, ``synthetic``, a ``.npz`` file
            or a directory holding ``x.npy`` and ``y.npy``.
        comm: communicator to shard over (default ``MPI.COMM_WORLD``).
        seed: data seed: picks the held-out rows and generates ``synthetic``.
            The per-epoch shuffles are seeded separately (see
            :class:`ringtrain.data.sharding.EpochPlan`).
        test_fraction: share of rows held out when there are no test arrays,
            in [0, 1).
        batch_size: if given, check that every rank can fill one batch.
        num_classes: for user data, the number of classes (default: largest
            label plus one).
        samples, features, classes, separation: size and difficulty of the
            ``synthetic`` dataset (rows including held-out ones, features per
            row, classes, spread of the class centres); ignored otherwise.

    Returns:
        A :class:`Shard`.

    Raises:
        UsageError: on every rank (``everywhere=True``), one line naming the
            file or dataset and the problem.
    """
    if comm is None:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()

    problem, source = None, None
    try:
        source = open_source(name_or_path, seed=seed, test_fraction=test_fraction, num_classes=num_classes,
                       samples=samples, features=features, classes=classes, separation=separation)
    except UsageError as exc:
        problem = str(exc)
    agree(comm, problem)
    _check_same_data(comm, source, name_or_path)

    # The counts are the same on every rank, so this verdict is too.
    if batch_size is not None:
        check_batch_size(source.train.count, size, batch_size)

    train_bounds = shard_bounds(source.train.count, size, rank)
    test_bounds = shard_bounds(source.test.count, size, rank)
    problem, arrays = None, None
    try:
        _check_memory(source, train_bounds, test_bounds, rank)
        arrays = (read_rows(source, source.train, train_bounds),
                  read_rows(source, source.test, test_bounds))
    except UsageError as exc:
        problem = str(exc)
    agree(comm, problem)
    (x, y), (x_test, y_test) = arrays

    num_classes = source.num_classes
    if num_classes is None:
        from mpi4py import MPI

        local = max([int(labels.max()) for labels in (y, y_test) if labels.size] + [-1])
        num_classes = comm.allreduce(local, op=MPI.MAX) + 1
        if num_classes < 2:
            raise UsageError(f"{source.label}: y holds a single class; a classifier needs at least 2",
                             everywhere=True)
    return Shard(x=x, y=y, x_test=x_test, y_test=y_test, num_train=source.train.count,
                 num_test=source.test.count, num_features=source.num_features, num_classes=int(num_classes),
                 name=str(name_or_path), rank=rank, size=size, train_bounds=train_bounds,
                 test_bounds=test_bounds, image_shape=source.image_shape)


def _check_same_data(comm, source, name):
    """Raise MismatchError on every rank unless every rank sees a dataset of the same shape.

    Ranks that read different files under one name (a data directory that is
    not shared between hosts, a file copied at different times) would
    otherwise shard different row counts and train on a silent mix.
    """
    mine = (source.train.count, source.test.count, source.num_features, source.num_classes)
    everyone = comm.allgather(mine)
    for rank, theirs in enumerate(everyone):
        if theirs != everyone[0]:
            what = ("training rows", "test rows", "features", "classes")
            i = next(i for i in range(len(mine)) if theirs[i] != everyone[0][i])
            raise MismatchError(f"ranks disagree on dataset {os.fspath(name)!r}: rank 0 has {everyone[0][i]} "
                                f"{what[i]}, rank {rank} has {theirs[i]}; every rank must read the same data")


def _check_memory(source, train_bounds, test_bounds, rank):
    """Refuse, before reading a row, a shard that cannot fit in this machine's memory."""
    memory = physical_memory()
    if memory is None:
        return
    rows = (train_bounds[1] - train_bounds[0]) + (test_bounds[1] - test_bounds[0])
    need = rows * (source.num_features * 4 + 8)  # float32 features, int64 label
    if source.label == "synthetic":  # the class centres, float64, made on every rank
        need += (source.num_classes or 0) * source.num_features * 8
    if need > memory:
        raise UsageError(f"{source.label}: rank {rank}'s shard would take {human_bytes(need)} of memory and this "
                         f"machine has {human_bytes(memory)}; use more ranks or a smaller dataset")

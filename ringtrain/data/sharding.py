"""Shard bounds, per-epoch shuffles and batch schedules: pure index maths.

Nothing here talks to MPI, so all of it is tested without ``mpirun``; the
loaders and the collective entry point live in :mod:`ringtrain.data.load`.

The rule, after TensorLayer: **shard first, then shuffle**. The training rows
are cut into contiguous blocks, one per rank (:func:`shard_bounds`), and each
rank then shuffles only its own block, afresh every epoch, from a generator
seeded by ``(seed, epoch, rank)`` (:func:`epoch_permutation`). Shards never
overlap, and an epoch's order is reproducible across runs and across resumes.

Every rank must run the same number of equal-size batches per epoch, because
an allreduce that one rank skips leaves the others waiting forever. Shards
differ in size by at most one sample, so :class:`EpochPlan` evens them out:

* **Padding (the default).** ``steps_per_epoch = ceil(largest shard /
  batch_size)``. A rank walks its shuffled order and, when it runs out, wraps
  around to the start of that same order. So in one epoch every sample of the
  rank's shard is seen at least once, and the first ``k`` samples of the
  shuffled order are seen twice, where ``k = steps_per_epoch * batch_size -
  shard size``. ``k`` is at most the batch size, and
  :func:`check_batch_size` makes every shard hold at least one batch, so no
  sample is seen more than twice. The samples seen twice change from epoch
  to epoch with the shuffle. Even on one
  rank the last batch is filled this way, so every batch has the same size.
* **drop_last.** ``steps_per_epoch = smallest shard // batch_size``. Each
  rank takes only the first ``steps_per_epoch * batch_size`` samples of its
  shuffled order: no sample is seen twice, and the remaining samples of the
  shard (fewer than a batch, plus one on the ranks with the larger shards)
  are skipped that epoch. Which ones are skipped changes with every epoch's
  shuffle, so over many epochs every sample is used.

**Changing the rank count mid-epoch.** The order above depends on the rank
count, so a run resumed on M ranks from a checkpoint written mid-epoch by N
ranks cannot simply go on at the same step. A checkpoint records where the
epoch stands as a list of :class:`EpochPart` records: the rank count of each
stretch and how many samples of its order it consumed. The M ranks work out
which rows the earlier parts already trained on (pure arithmetic over every
rank's shuffle, :meth:`EpochPlan.schedule`), and each takes the rows of its own
shard that are left, in its own shuffled order, for the rest of the epoch: no
row of the epoch is skipped or repeated, apart from the padding that gives
every rank the same number of full batches (drawn, as always, from the rank's
own rows: its unseen rows once more, then rows the epoch already trained on,
so no row is trained more than twice in the epoch). The next epoch is an ordinary M-rank epoch. Only a resume at the
same rank count reproduces the uninterrupted run's batches bitwise.

Evaluation data are sharded the same way but never padded
(:func:`eval_batches`); their results are reduced as sums, once, after the
last batch (see :func:`ringtrain.training.evaluate.reduce_eval`), so ranks may run
different numbers of evaluation batches.
"""

import dataclasses
import math

import numpy as np

from ..errors import UsageError

__all__ = [
    "shard_bounds",
    "shard_sizes",
    "epoch_permutation",
    "check_batch_size",
    "EpochPlan",
    "EpochPart",
    "EpochSchedule",
    "stretch_rows",
    "unseen_after",
    "eval_batches",
    "complement_positions",
]


def shard_bounds(num_samples, num_shards, index):
    """Return the ``[start, stop)`` rows of one contiguous shard.

    The first ``num_samples % num_shards`` shards hold one sample more than
    the others, so sizes differ by at most one and every sample lies in
    exactly one shard (ChainerMN's ``_scatter_index`` rule).

    Args:
        num_samples: rows to split, at least 0.
        num_shards: number of shards (ranks), at least 1.
        index: which shard, ``0 <= index < num_shards``.

    Returns:
        ``(start, stop)`` as ints.
    """
    if num_shards < 1:
        raise ValueError(f"number of shards must be at least 1, got {num_shards}")
    if not 0 <= index < num_shards:
        raise ValueError(f"shard index must be in [0, {num_shards}), got {index}")
    if num_samples < 0:
        raise ValueError(f"number of samples must be at least 0, got {num_samples}")
    base, extra = divmod(num_samples, num_shards)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def shard_sizes(num_samples, num_shards):
    """Every shard's size, indexed by shard: a tuple of ints."""
    return tuple(stop - start for start, stop in
                 (shard_bounds(num_samples, num_shards, i) for i in range(num_shards)))


def epoch_permutation(shard_size, seed, epoch, rank):
    """Return this epoch's order of one rank's shard (indices into the shard).

    The generator is seeded by the triple ``(seed, epoch, rank)`` through
    NumPy's ``SeedSequence``, so the order depends on nothing else: not on
    how many epochs ran before, nor on whether the run was resumed.

    Args:
        shard_size: rows in the rank's shard.
        seed, epoch, rank: non-negative integers.

    Returns:
        An int64 permutation of ``range(shard_size)``.
    """
    for what, value in (("seed", seed), ("epoch", epoch), ("rank", rank)):
        if int(value) < 0:
            raise ValueError(f"{what} must be at least 0, got {value}")
    rng = np.random.default_rng([int(seed), int(epoch), int(rank)])
    return rng.permutation(int(shard_size)).astype(np.int64, copy=False)


def check_batch_size(num_samples, num_shards, batch_size):
    """Raise unless every shard can fill at least one batch.

    Every rank computes the same verdict from the same global numbers, so the
    error is raised on every rank (``everywhere=True``) without a collective.

    Args:
        num_samples: global number of training rows.
        num_shards: number of ranks.
        batch_size: rows per batch on each rank.

    Raises:
        UsageError: batch size below 1, or fewer rows than ranks x batch size.
    """
    if batch_size < 1:
        raise UsageError(f"batch size must be at least 1, got {batch_size}", everywhere=True)
    if num_samples < num_shards * batch_size:
        raise UsageError(
            f"dataset has {num_samples} training samples, too few for {num_shards} ranks x batch size "
            f"{batch_size} = {num_shards * batch_size}; use a smaller batch size or fewer ranks",
            everywhere=True,
        )


@dataclasses.dataclass(frozen=True)
class EpochPart:
    """One stretch of an epoch trained at one rank count: a plain record for checkpoints.

    Attributes:
        ranks: the rank count that trained this stretch.
        samples: how many samples of that stretch's order it consumed
            (``steps x ranks x batch_size``, padding included).
    """

    ranks: int
    samples: int


@dataclasses.dataclass(frozen=True, eq=False)
class EpochSchedule:
    """One rank's batches for (the rest of) one epoch, from :meth:`EpochPlan.schedule`.

    Steps are numbered within the epoch, earlier parts included: the loop
    runs ``first_step <= step < steps``.

    Attributes:
        epoch: the epoch.
        earlier: the :class:`EpochPart` records trained before this rank count took over.
        first_step: the step this schedule starts at (a resume's position).
        steps: the step the epoch ends at.
        ranks, batch_size: this run's rank count and batch size.
        order: this rank's rows (indices into its shard) for every step from
            ``steps_before``, ``batch_size`` per step, read-only.
    """

    epoch: int
    earlier: tuple
    first_step: int
    steps: int
    ranks: int
    batch_size: int
    order: np.ndarray

    @property
    def steps_before(self):
        """The steps the earlier parts took."""
        return sum(part.samples // (part.ranks * self.batch_size) for part in self.earlier)

    def batch_indices(self, step):
        """Indices into this rank's shard for one step: a fresh, writeable int64 array."""
        if not self.first_step <= step < self.steps:
            raise ValueError(f"step must be in [{self.first_step}, {self.steps}), got {step}")
        at = (step - self.steps_before) * self.batch_size
        return self.order[at:at + self.batch_size].copy()

    def parts_at(self, step):
        """Where the epoch stands once ``step`` steps of it are done, as :class:`EpochPart` records (pure).

        What a checkpoint records; empty at the epoch's start.
        """
        own = (step - self.steps_before) * self.ranks * self.batch_size
        return self.earlier + ((EpochPart(self.ranks, own),) if own > 0 else ())


class EpochPlan:
    """One rank's batch schedule: which rows of its shard each step uses.

    Every rank builds its plan from the same global numbers, so all plans
    agree on :attr:`steps_per_epoch`. Batches are indices into the rank's own
    shard (``shard.x[indices]``), a pure function of ``(seed, epoch, step,
    rank)``: a run resumed at ``(epoch, step)`` sees exactly the batches the
    uninterrupted run would have. See the module docstring for how padding
    and ``drop_last`` decide which samples are seen how often.

    Args:
        num_samples: global number of training rows.
        num_shards: number of ranks.
        rank: this rank.
        batch_size: rows per batch on each rank.
        seed: shuffle seed, the same on every rank.
        drop_last: cut every rank to the smallest shard instead of padding.

    Raises:
        UsageError: (on every rank) if a shard cannot fill one batch.
    """

    def __init__(self, num_samples, num_shards, rank, batch_size, *, seed=0, drop_last=False):
        check_batch_size(num_samples, num_shards, batch_size)
        self.num_samples = int(num_samples)
        self.num_shards = int(num_shards)
        self.rank = int(rank)
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        start, stop = shard_bounds(self.num_samples, self.num_shards, self.rank)
        self.shard_size = stop - start
        sizes = shard_sizes(self.num_samples, self.num_shards)
        if self.drop_last:
            self.steps_per_epoch = min(sizes) // self.batch_size
        else:
            self.steps_per_epoch = math.ceil(max(sizes) / self.batch_size)
        self._cached = (None, None)

    @classmethod
    def for_shard(cls, shard, comm=None, *, batch_size, seed=0, drop_last=False):
        """The plan for a :class:`ringtrain.data.load.Shard`'s rank and size.

        Not collective: every rank derives the same steps from the same
        global counts. ``comm``, if given, must be the communicator the shard
        was loaded over (checked, because a mismatch would desynchronise the
        ranks' step counts).
        """
        if comm is not None and (comm.Get_rank(), comm.Get_size()) != (shard.rank, shard.size):
            raise ValueError(f"shard was loaded for rank {shard.rank} of {shard.size}, "
                             f"not rank {comm.Get_rank()} of {comm.Get_size()}")
        return cls(shard.num_train, shard.size, shard.rank, batch_size, seed=seed, drop_last=drop_last)

    @property
    def samples_per_epoch(self):
        """Rows this rank trains on per epoch, repeats included."""
        return self.steps_per_epoch * self.batch_size

    def epoch_order(self, epoch):
        """All of this epoch's indices, in order: ``steps_per_epoch * batch_size`` of them."""
        if self._cached[0] == epoch:
            return self._cached[1]
        perm = epoch_permutation(self.shard_size, self.seed, epoch, self.rank)
        length = self.samples_per_epoch
        # Padding wraps around the rank's own shuffled order, so a short
        # shard repeats its own first samples, never a peer's.
        order = perm[:length] if self.drop_last else perm[np.arange(length) % self.shard_size]
        order.setflags(write=False)
        self._cached = (epoch, order)
        return order

    def batch_indices(self, epoch, step):
        """Indices into this rank's shard for one ``(epoch, step)``: a fresh, writeable int64 array.

        A copy (``batch_size`` integers), not a view of the cached, read-only
        :meth:`epoch_order`: ``torch.as_tensor``/``from_numpy`` and indexing a
        tensor with it warn about a non-writeable array otherwise.
        """
        if not 0 <= step < self.steps_per_epoch:
            raise ValueError(f"step must be in [0, {self.steps_per_epoch}), got {step}")
        order = self.epoch_order(epoch)
        return order[step * self.batch_size:(step + 1) * self.batch_size].copy()


    def batches(self, epoch, start_step=0):
        """Yield ``(step, indices)`` for one epoch, from ``start_step`` (to resume mid-epoch)."""
        for step in range(start_step, self.steps_per_epoch):
            yield step, self.batch_indices(epoch, step)

    def schedule(self, epoch, parts=()):
        """This rank's batches for epoch ``epoch`` after ``parts`` of it were trained (pure).

        ``parts`` (:class:`EpochPart` records, as a checkpoint holds them) may
        come from runs at other rank counts. When the last part ran at this
        plan's rank count, its order simply goes on, which is exactly the
        uninterrupted run's. Otherwise the rows the parts trained on are
        worked out from every rank's shuffle at their rank counts, and this
        rank takes the rows of its shard that are left, in its own shuffled
        order, padded (or cut, with ``drop_last``) so every rank runs the same
        number of full batches. Every rank computes the same step counts.

        Raises:
            ValueError: parts that cannot come from this data and batch size
                (a damaged checkpoint).
        """
        parts = tuple(p for p in parts if p.samples)
        for part in parts:
            if part.ranks < 1 or part.samples < 0 or part.samples % (part.ranks * self.batch_size):
                raise ValueError(f"epoch part {part} is not a whole number of steps of {part.ranks} "
                                 f"rank(s) x batch size {self.batch_size}")
        ongoing = parts[-1] if parts and parts[-1].ranks == self.num_shards else None
        earlier = parts[:-1] if ongoing else parts
        order_of = dict(num_samples=self.num_samples, batch_size=self.batch_size, seed=self.seed, epoch=epoch,
                        drop_last=self.drop_last)
        unseen = unseen_after(earlier, **order_of)
        rows, steps = stretch_rows(self.num_shards, self.rank, unseen, **order_of)
        start, _ = shard_bounds(self.num_samples, self.num_shards, self.rank)
        order = rows - start
        order.setflags(write=False)
        before = sum(p.samples // (p.ranks * self.batch_size) for p in earlier)
        done = ongoing.samples // (self.num_shards * self.batch_size) if ongoing else 0
        if done > steps:
            raise ValueError(f"epoch part {ongoing} is longer than the {steps} steps left in epoch {epoch}")
        return EpochSchedule(epoch, earlier, before + done, before + steps, self.num_shards, self.batch_size, order)

    def __repr__(self):
        return (f"EpochPlan(num_samples={self.num_samples}, num_shards={self.num_shards}, rank={self.rank}, "
                f"batch_size={self.batch_size}, seed={self.seed}, drop_last={self.drop_last}, "
                f"steps_per_epoch={self.steps_per_epoch})")


def stretch_rows(ranks, rank, unseen, *, num_samples, batch_size, seed, epoch, drop_last):
    """One rank's rows (global row numbers) for a stretch of an epoch at ``ranks`` ranks, and its step count (pure).

    Without ``unseen`` this is the ordinary epoch (:meth:`EpochPlan.epoch_order`
    plus the shard's start): the rank's shard in its shuffled order, padded
    by wrapping around, or cut with ``drop_last``. With ``unseen`` (a mask
    over every row), the unseen rows of the shard, in the same shuffled
    order, padded with those rows once more and then with the shard's rows
    the epoch already trained on (in the same order): so, as in an ordinary
    epoch, no row is trained more than twice in it. (Padded with its few
    unseen rows alone, a rank with a handful left beside one with a batch
    left would train one row up to a batch's worth of times.) The step count
    depends on every rank's count, so every rank gets the same.
    """
    start, stop = shard_bounds(num_samples, ranks, rank)
    rows = start + epoch_permutation(stop - start, seed, epoch, rank)
    if unseen is None:
        counts = shard_sizes(num_samples, ranks)
    else:
        counts = [int(unseen[a:b].sum()) for a, b in (shard_bounds(num_samples, ranks, r) for r in range(ranks))]
        fresh = rows[unseen[rows]]
        rows = fresh if drop_last else np.concatenate([fresh, fresh, rows[~unseen[rows]]])
    steps = min(counts) // batch_size if drop_last else math.ceil(max(counts) / batch_size)
    length = steps * batch_size
    return (rows[:length] if drop_last else rows[np.arange(length) % rows.size]), steps


def unseen_after(parts, *, num_samples, batch_size, seed, epoch, drop_last):
    """A mask of the rows that no part of ``parts`` trained on in ``epoch``, or None when there are none (pure).

    Each part's order is worked out from every one of its ranks' shuffles,
    over the rows the parts before it left. Costs one pass over every row
    per part; parts come only from changes of the rank count within an epoch.
    """
    unseen = None
    for part in parts:
        after = np.ones(num_samples, bool) if unseen is None else unseen.copy()
        taken = part.samples // part.ranks
        for rank in range(part.ranks):
            rows, steps = stretch_rows(part.ranks, rank, unseen, num_samples=num_samples, batch_size=batch_size,
                                       seed=seed, epoch=epoch, drop_last=drop_last)
            if taken > steps * batch_size:
                raise ValueError(f"epoch part {part} is longer than the {steps} steps it had in epoch {epoch}")
            after[rows[:taken]] = False
        unseen = after
    return unseen


def eval_batches(num_rows, batch_size):
    """Split a rank's evaluation shard into slices, in order, without padding.

    The last slice may be short and a rank with no evaluation rows gets no
    slices: evaluation makes no collective per batch, only one reduction of
    the sums at the end, so ranks need not agree on the number of batches.
    """
    if batch_size < 1:
        raise ValueError(f"batch size must be at least 1, got {batch_size}")
    return [slice(start, min(start + batch_size, num_rows)) for start in range(0, num_rows, batch_size)]


def complement_positions(excluded, positions):
    """Map positions in the list of rows *not* excluded to row numbers.

    With ``excluded`` the sorted held-out rows, the training rows are the
    others in order; this returns the row number of each training position
    without building that list, so a rank's cost grows with its own shard and
    the held-out count, not with the dataset.

    Args:
        excluded: sorted, distinct int64 row numbers.
        positions: int array of positions among the remaining rows.

    Returns:
        int64 row numbers, same shape as ``positions``.
    """
    excluded = np.asarray(excluded, dtype=np.int64)
    positions = np.asarray(positions, dtype=np.int64)
    # excluded[j] - j counts the kept rows before excluded[j]; a position p
    # is shifted past every excluded row with at most p kept rows before it.
    kept_before = excluded - np.arange(excluded.size, dtype=np.int64)
    return positions + np.searchsorted(kept_before, positions, side="right")

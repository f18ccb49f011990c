"""Horovod's ``ElasticSampler``: each rank's share of an epoch, carried exactly across a reset or a restart.

Every rank shuffles the whole dataset the same way for each epoch (Python's
``random.Random(seed + epoch)``, as Horovod does) and takes every R-th
index of what is left, from its rank on, so after each rank has taken k
samples the ranks together have taken exactly the first R*k of the order.
The sampler counts this rank's samples since the last partition
(``record_batch``); a sync (every rank adds its count to the position)
or a commit turns the counts into one position in the epoch's order, and
the next partition starts there, at whatever size the job now has: no
sample is skipped, and none is taken twice, across a reset or a restart.
As in Horovod and ``DistributedSampler``, the last indices of an epoch are
padded from its start so that every rank gets as many.

:func:`partition` is the pure index maths, tested without MPI.
"""

import math
import random

import torch.utils.data

from ..runtime import rank, size

__all__ = ["ElasticSampler", "epoch_order", "partition"]


def epoch_order(length, seed, epoch, shuffle):
    """The order of an epoch's indices (pure): shuffled with ``random.Random(seed + epoch)``, as Horovod's."""
    order = list(range(length))
    if shuffle:
        random.Random(seed + epoch).shuffle(order)
    return order


def partition(order, done, replicas, rank_):
    """Rank ``rank_``'s indices of ``order`` after its first ``done`` were taken, padded evenly (pure).

    Returns ``(indices, per_rank)``: every ``replicas``-th index of what is
    left, from ``rank_`` on, and how many each rank gets. What is left is
    padded by repeating it from its start until the ranks get as many each.
    """
    remaining = order[min(done, len(order)):]
    per_rank = math.ceil(len(remaining) / replicas) if remaining else 0
    padded = list(remaining)
    while len(padded) < per_rank * replicas:
        padded += remaining[:per_rank * replicas - len(padded)]
    return padded[rank_:per_rank * replicas:replicas], per_rank


class ElasticSampler(torch.utils.data.Sampler):
    """Partitions a dataset across ranks, and again from the same position after every reset.

    Use it as Horovod says: put it in the :class:`TorchState`, call
    :meth:`record_batch` after each batch, and :meth:`set_epoch` at the end
    of each epoch (not the start, or a restarted epoch would be done again).

    Args:
        dataset: the dataset (of a fixed length).
        shuffle: shuffle each epoch (default True).
        seed: the shuffle's seed, the same on every rank.

    Attributes:
        processed_num: samples of this epoch's order taken: by all ranks up
            to the last partition, plus this rank's since (after a sync, all
            ranks' since). Horovod's name and, at one rank, its value.
    """

    def __init__(self, dataset, shuffle=True, seed=0):
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_indices = set()  # Horovod keeps the name; positions are counts here
        self.global_done = 0  # the epoch's samples taken by all ranks before the current partition
        self.local_done = 0  # this rank's samples since
        self.num_replicas = 0
        self.rank = 0
        self.remaining_indices = []
        self.indices = []
        self.num_samples = 0
        self.total_size = 0
        self.reset()

    @property
    def processed_num(self):
        return self.global_done + self.local_done

    @processed_num.setter
    def processed_num(self, value):
        self.global_done, self.local_done = int(value), 0

    def set_epoch(self, epoch):
        """Start epoch ``epoch`` from its first sample (call it at the end of the previous one)."""
        self.epoch = epoch
        self.global_done = self.local_done = 0
        self.reset()

    def record_batch(self, batch_idx, batch_size):
        """Count a batch of ``batch_size`` samples this rank has processed."""
        self.local_done += batch_size

    def state_dict(self):
        return {"epoch": self.epoch, "processed_num": self.processed_num, "global_done": self.global_done,
                "local_done": self.local_done}

    def load_state_dict(self, state_dict):
        """Go to a saved position (Horovod's ``{"epoch", "processed_num"}`` is read too) and partition from it."""
        self.epoch = state_dict["epoch"]
        if "global_done" in state_dict:
            self.global_done, self.local_done = state_dict["global_done"], state_dict["local_done"]
        else:
            self.global_done, self.local_done = state_dict["processed_num"], 0
        self.reset()

    @staticmethod
    def merged(state_dict, local_counts):
        """``state_dict`` with every rank's count since the partition added into its position (pure)."""
        base = state_dict.get("global_done", state_dict["processed_num"] - state_dict.get("local_done", 0))
        done = base + sum(local_counts)
        return dict(state_dict, processed_num=done, global_done=done, local_done=0)

    def reset(self):
        """Partition what is left of the epoch among the ranks the job has now."""
        self.num_replicas, self.rank = size(), rank()
        order = epoch_order(len(self.dataset), self.seed, self.epoch, self.shuffle)
        self.remaining_indices = order[min(self.global_done, len(order)):]
        mine, per_rank = partition(order, self.global_done, self.num_replicas, self.rank)
        # After a restore on the same ranks, this rank's first local_done were taken already.
        self.indices = mine[self.local_done:]
        self.num_samples = len(self.indices)
        self.total_size = per_rank * self.num_replicas

    def __iter__(self):
        return iter(list(self.indices))

    def __len__(self):
        return self.num_samples

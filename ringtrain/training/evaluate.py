"""Evaluation across ranks: each rank evaluates its own held-out rows, and one sum gives the global result.

Sums, not per-rank means, are reduced, so the accuracy is exactly the
global one whatever the number of ranks and however unevenly the rows fall.
"""

import typing

import numpy as np

from ..data.sharding import eval_batches

__all__ = ["EvalTotals", "sum_eval", "reduce_eval"]


class EvalTotals(typing.NamedTuple):
    """Evaluation results summed over every rank; unpacks as ``(loss_sum, correct, count)``.

    Attributes:
        loss_sum: sum of the per-row losses.
        correct: correct predictions.
        count: rows evaluated.
    """

    loss_sum: float
    correct: int
    count: int

    @property
    def accuracy(self):
        """Share of rows predicted correctly (NaN with no rows)."""
        return self.correct / self.count if self.count else float("nan")

    @property
    def mean_loss(self):
        """Mean loss per row (NaN with no rows)."""
        return self.loss_sum / self.count if self.count else float("nan")


def sum_eval(loss_sum, correct, count, comm=None):
    """Sum this rank's evaluation results with every other rank's.

    Collective: every rank of ``comm`` must call it once per evaluation, even
    a rank with no evaluation rows (pass zeros). Because sums, not per-rank
    means, are reduced, the accuracy is exactly the global one whatever the
    number of ranks and however unevenly the rows fall.

    Args:
        loss_sum: this rank's sum of per-row losses.
        correct: this rank's correct predictions.
        count: this rank's rows evaluated.
        comm: communicator (default ``MPI.COMM_WORLD``).

    Returns:
        An :class:`EvalTotals`, the same on every rank.
    """
    from mpi4py import MPI

    comm = comm if comm is not None else MPI.COMM_WORLD
    # One float64 message: counts below 2**53 add exactly, and one call costs
    # one latency instead of two.
    sums = np.array([loss_sum, correct, count], dtype=np.float64)
    comm.Allreduce(MPI.IN_PLACE, sums, op=MPI.SUM)
    return EvalTotals(loss_sum=float(sums[0]), correct=int(sums[1]), count=int(sums[2]))


def reduce_eval(model, shard, comm=None, *, xp=None, batch_size=4096):
    """Evaluate ``model`` on every rank's evaluation rows and sum the results.

    Collective: every rank of ``comm`` must call it at the same point. Each
    rank evaluates its own rows in batches (:func:`ringtrain.data.sharding.eval_batches`,
    no padding, so nothing is counted twice), then one :func:`sum_eval`.

    Args:
        model: has ``evaluate(x, y) -> (loss_sum, correct)``.
        shard: this rank's :class:`Shard`.
        comm: communicator (default ``MPI.COMM_WORLD``).
        xp: array module the model computes with (default NumPy).
        batch_size: rows per evaluation batch, to bound memory.

    Returns:
        An :class:`EvalTotals` ``(loss_sum, correct, count)``, the same on every rank.
    """
    xp = np if xp is None else xp
    loss_sum, correct = 0.0, 0
    for rows in eval_batches(len(shard.y_test), batch_size):
        batch_loss, batch_correct = model.evaluate(xp.asarray(shard.x_test[rows]), xp.asarray(shard.y_test[rows]))
        loss_sum += float(batch_loss)
        correct += int(batch_correct)
    return sum_eval(loss_sum, correct, len(shard.y_test), comm)

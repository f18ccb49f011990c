"""The trainer: configuration, the strategy chosen once, the loop, resume, evaluation and the run's records.

* :mod:`~ringtrain.training.config`: :class:`TrainConfig`, its three sources and its checks;
* :mod:`~ringtrain.training.strategy`: how a step averages (allreduce, overlapped, sharded), chosen once;
* :mod:`~ringtrain.training.sharded`: the sharded optimizer step (ZeRO stage 1);
* :mod:`~ringtrain.training.loop`: :func:`train`, the loop itself;
* :mod:`~ringtrain.training.startup`: everything before the first step, as one ``Start`` record;
* :mod:`~ringtrain.training.saving`: checkpoints worth resuming (never a non-finite state), and ``Diverged``;
* :mod:`~ringtrain.training.resume`, :mod:`~ringtrain.training.evaluate`,
  :mod:`~ringtrain.training.replicas`: resuming, evaluation, and the checks that replicas agree;
* :mod:`~ringtrain.training.runlog`, :mod:`~ringtrain.training.metrics`,
  :mod:`~ringtrain.training.progress`, :mod:`~ringtrain.training.timeline`: what rank 0 writes and prints;
* :mod:`~ringtrain.training.stopping`: a signal stops every rank at the same step, with a checkpoint;
* :mod:`~ringtrain.data.standardize`: ``--standardize``'s exact global feature statistics.
"""

from .config import TrainConfig
from .evaluate import EvalTotals, reduce_eval, sum_eval
from .loop import TrainResult, train
from .sharded import ShardedStep

__all__ = ["TrainConfig", "TrainResult", "train", "ShardedStep", "EvalTotals", "reduce_eval", "sum_eval"]

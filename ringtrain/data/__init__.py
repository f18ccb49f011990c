"""Data: shard first, then shuffle.

* :mod:`~ringtrain.data.sharding`: pure index maths (which rows are a rank's, each epoch's order);
* :mod:`~ringtrain.data.load`: the collective sharded load (:func:`load_sharded`, :class:`Shard`) and the sources;
* :mod:`~ringtrain.data.standardize`: exact global feature statistics for ``--standardize``.
"""

from .load import DATASETS, Shard, load_sharded
from .sharding import EpochPlan, shard_bounds

__all__ = ["DATASETS", "Shard", "load_sharded", "EpochPlan", "shard_bounds"]

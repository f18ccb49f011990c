"""Data: shard first, then shuffle.

* :mod:`~ringtrain.data.sharding`: pure index maths (which rows are a rank's, each epoch's order);
* :mod:`~ringtrain.data.sources`: the datasets (digits, mnist5k, synthetic, ``.npz``, a ``.npy`` directory),
  described without reading their rows, then read and checked by position;
* :mod:`~ringtrain.data.load`: the collective sharded load (:func:`load_sharded`, :class:`Shard`);
* :mod:`~ringtrain.data.standardize`: exact global feature statistics for ``--standardize``.
"""

from .load import Shard, load_sharded
from .sharding import EpochPlan, shard_bounds
from .sources import DATASETS

__all__ = ["DATASETS", "Shard", "load_sharded", "EpochPlan", "shard_bounds"]

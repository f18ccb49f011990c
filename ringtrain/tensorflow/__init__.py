"""Horovod's TensorFlow API on TensorFlow 2.x: ``import ringtrain.tensorflow as hvd``.

Eager and inside ``tf.function`` (and TF1 graphs); every op's gradient is
registered as Horovod registers it. The modules, one idea each:

* :mod:`.collectives`: the op layer (NumPy arrays; the engine's names);
* :mod:`.mpi_ops`: the ops on tensors, their gradients, the rank family;
* :mod:`.reduce`: ``allreduce`` and friends with compression and ``IndexedSlices``;
* :mod:`.gradients`: ``DistributedGradientTape``, the TF1 ``DistributedOptimizer``;
* :mod:`.functions`: broadcasts of variables and objects;
* :mod:`.sync_batch_norm`, :mod:`.compression`, :mod:`.elastic`.

Keras (``DistributedOptimizer`` for Keras optimizers, callbacks): :mod:`ringtrain.keras`.
"""

try:
    import tensorflow
except ModuleNotFoundError as exc:  # one line that names the fix, not a traceback through five modules
    raise ModuleNotFoundError("ringtrain.tensorflow needs tensorflow, which is not installed: pip install "
                              "tensorflow-cpu==2.21.0 (or the [tensorflow] extra)", name="tensorflow") from exc

from . import elastic, mpi_ops, util
from .collectives import CollectiveMismatchError, HorovodInternalError
from .compression import Compression
from .functions import (allgather_object, broadcast_global_variables, broadcast_object, broadcast_object_fn,
                        broadcast_variables)
from . import gradients, keras_optimizer
from .gradients import DistributedGradientTape, PartialDistributedGradientTape
from .mpi_ops import (Adasum, Average, Max, Min, Product, ProcessSet, Sum, add_process_set, allgather, alltoall,
                      barrier, broadcast, broadcast_, ccl_built, check_num_rank_power_of_2, cross_rank, cross_size,
                      cuda_built, ddl_built, global_process_set, gloo_built, gloo_enabled, grouped_allgather,
                      handle_average_backwards_compatibility, init, is_homogeneous, is_initialized, join,
                      local_rank, local_rank_op, local_size, local_size_op, mpi_built, mpi_enabled,
                      mpi_threads_supported, nccl_built, process_set_included_op, rank, rank_op, remove_process_set,
                      rocm_built, shutdown, size, size_op, start_timeline, stop_timeline)
from .reduce import allreduce, grouped_allreduce, grouped_reducescatter, reducescatter
from .sync_batch_norm import SyncBatchNormalization



def DistributedOptimizer(optimizer, *args, **kwargs):  # noqa: N802 - Horovod's name
    """Horovod's ``DistributedOptimizer``: a TF1 optimizer (:mod:`.gradients`) or a Keras one (:mod:`.keras_optimizer`).

    Takes Horovod's arguments (``compression``, ``sparse_as_dense``, ``op``,
    ``gradient_predivide_factor``, ``process_set``...) and returns an
    optimizer whose gradients are averaged across the process set.
    """
    if isinstance(optimizer, tensorflow.compat.v1.train.Optimizer):
        return gradients.DistributedOptimizer(optimizer, *args, **kwargs)
    kwargs.pop("use_locking", None)
    return keras_optimizer.DistributedOptimizer(optimizer, *args, **kwargs)


# Horovod's private names that its tests and keras layers reach for.
_allreduce = mpi_ops.allreduce_op
_grouped_allreduce = mpi_ops.grouped_allreduce_op
_reducescatter = mpi_ops.reducescatter_op
_grouped_reducescatter = mpi_ops.grouped_reducescatter_op
_executing_eagerly = util._executing_eagerly

__all__ = ["CollectiveMismatchError", "HorovodInternalError", "Compression", "allgather_object",
           "broadcast_global_variables", "broadcast_object", "broadcast_object_fn", "broadcast_variables",
           "DistributedGradientTape", "DistributedOptimizer", "PartialDistributedGradientTape", "Adasum", "Average",
           "Max", "Min", "Product", "ProcessSet", "Sum", "add_process_set", "allgather", "alltoall", "barrier",
           "broadcast", "broadcast_", "ccl_built", "check_num_rank_power_of_2", "cross_rank", "cross_size",
           "cuda_built", "ddl_built", "global_process_set", "gloo_built", "gloo_enabled", "grouped_allgather",
           "handle_average_backwards_compatibility", "init", "is_homogeneous", "is_initialized", "join",
           "local_rank", "local_rank_op", "local_size", "local_size_op", "mpi_built", "mpi_enabled",
           "mpi_threads_supported", "nccl_built", "process_set_included_op", "rank", "rank_op",
           "remove_process_set", "rocm_built", "shutdown", "size", "size_op", "start_timeline", "stop_timeline",
           "allreduce", "grouped_allreduce", "grouped_reducescatter", "reducescatter", "SyncBatchNormalization",
           "mpi_ops", "util", "elastic"]

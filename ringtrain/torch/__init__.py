"""The PyTorch face: the only part of ringtrain that touches torch.

Horovod's PyTorch API (``import ringtrain.torch as hvd``) over the
framework-neutral engine (:mod:`ringtrain.engine`): the face turns tensors
into zero-copy arrays and back, and keeps autograd and in-place semantics.

* :mod:`ringtrain.torch.interop`: zero-copy views between tensors and
  ringtrain arrays, parameter broadcast and gradient averaging;
* :class:`ringtrain.torch.TorchModel`: any ``nn.Module`` through the trainer.
"""

try:
    import torch  # noqa: F401 - every module below but interop and model imports it at the top
except ModuleNotFoundError as exc:  # one line that names the fix, not a traceback through five modules
    raise ModuleNotFoundError("ringtrain.torch needs torch, which is not installed: pip install torch==2.13.0 "
                              "(or the [torch] extra)", name="torch") from exc

from . import interop
from .model import TorchModel

# Horovod's basics: init, ranks, op constants, errors (import ringtrain.torch as hvd).
from .errors import HorovodInternalError, HostsUpdatedInterrupt
from ..engine.reduce_ops import Adasum, Average, Max, Min, Product, Sum
from .runtime import (ccl_built, communicator, cross_rank, cross_size, cuda_built, ddl_built, gloo_built,
                      gloo_enabled, init, is_homogeneous, is_initialized, local_rank, local_size, mpi_built,
                      mpi_enabled, mpi_threads_supported, nccl_built, rank, rocm_built, shutdown, size)

# Horovod's collectives: matched across each process set's ranks by name (the contract: engine.py).
from .autograd import (allgather, allreduce, allreduce_, alltoall, broadcast, broadcast_, grouped_allgather,
                       grouped_allreduce, grouped_allreduce_, grouped_reducescatter, reducescatter,
                       sparse_allreduce_async)
from ..engine.handles import poll, synchronize
from .ops_async import (allgather_async, allreduce_async, allreduce_async_, alltoall_async, barrier,
                        broadcast_async, broadcast_async_, grouped_allgather_async, grouped_allreduce_async,
                        grouped_allreduce_async_, grouped_reducescatter_async, join, reducescatter_async,
                        start_timeline, stop_timeline)
from ..engine.process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set

# Horovod's training helpers: the distributed optimizer, broadcasts of state, SyncBatchNorm.
from .functions import allgather_object, broadcast_object, broadcast_optimizer_state, broadcast_parameters
from .optimizer import Compression, DistributedOptimizer
from .sync_batch_norm import SyncBatchNorm

__all__ = ["interop", "TorchModel"]
__all__ += ["HorovodInternalError", "HostsUpdatedInterrupt", "Adasum", "Average", "Max", "Min", "Product", "Sum",
            "ccl_built", "communicator", "cross_rank", "cross_size", "cuda_built", "ddl_built", "gloo_built",
            "gloo_enabled", "init", "is_homogeneous", "is_initialized", "local_rank", "local_size", "mpi_built",
            "mpi_enabled", "mpi_threads_supported", "nccl_built", "rank", "rocm_built", "shutdown", "size"]
__all__ += ["allgather", "allreduce", "allreduce_", "alltoall", "broadcast", "broadcast_", "grouped_allgather",
            "grouped_allreduce", "grouped_allreduce_", "grouped_reducescatter", "reducescatter", "poll", "synchronize",
            "allgather_async", "allreduce_async", "allreduce_async_", "alltoall_async", "barrier", "broadcast_async",
            "broadcast_async_", "grouped_allgather_async", "grouped_allreduce_async", "grouped_allreduce_async_",
            "grouped_reducescatter_async", "reducescatter_async", "join", "sparse_allreduce_async", "ProcessSet",
            "add_process_set",
            "global_process_set", "remove_process_set", "start_timeline", "stop_timeline"]

__all__ += ["Compression", "allgather_object", "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters",
            "DistributedOptimizer", "SyncBatchNorm"]
from . import elastic  # noqa: E402,F401 - hvd.elastic: Horovod's elastic API (ringtrain.torch.elastic)

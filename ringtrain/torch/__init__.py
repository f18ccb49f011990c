"""The PyTorch wing: the only part of ringtrain that touches torch.

* :mod:`ringtrain.torch.interop`: zero-copy views between tensors and
  ringtrain arrays, parameter broadcast and gradient averaging;
* :class:`ringtrain.torch.TorchModel`: any ``nn.Module`` through the trainer.
"""

from . import interop
from .model import TorchModel

# Horovod's basics: init, ranks, op constants, errors (import ringtrain.torch as hvd).
from .errors import HorovodInternalError, HostsUpdatedInterrupt
from .reduce_ops import Adasum, Average, Max, Min, Product, Sum
from .runtime import (ccl_built, communicator, cross_rank, cross_size, cuda_built, ddl_built, gloo_built,
                      gloo_enabled, init, is_homogeneous, is_initialized, local_rank, local_size, mpi_built,
                      mpi_enabled, mpi_threads_supported, nccl_built, rank, rocm_built, shutdown, size)

# Horovod's training helpers: the distributed optimizer, broadcasts of state, SyncBatchNorm.
from .compression import Compression
from .functions import allgather_object, broadcast_object, broadcast_optimizer_state, broadcast_parameters
from .optimizer import DistributedOptimizer
from .sync_batch_norm import SyncBatchNorm

__all__ = ["interop", "TorchModel"]
__all__ += ["HorovodInternalError", "HostsUpdatedInterrupt", "Adasum", "Average", "Max", "Min", "Product", "Sum",
            "ccl_built", "communicator", "cross_rank", "cross_size", "cuda_built", "ddl_built", "gloo_built",
            "gloo_enabled", "init", "is_homogeneous", "is_initialized", "local_rank", "local_size", "mpi_built",
            "mpi_enabled", "mpi_threads_supported", "nccl_built", "rank", "rocm_built", "shutdown", "size"]

__all__ += ["Compression", "allgather_object", "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters",
            "DistributedOptimizer", "SyncBatchNorm"]

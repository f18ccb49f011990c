"""Horovod's basics for the torch face: the engine's runtime (:mod:`ringtrain.engine.runtime`), under this name.

``horovod.torch`` scripts and :mod:`ringtrain.torch.elastic` reach ``rank``,
``size`` and the running runtime here; there is one runtime per process,
whichever face started it.
"""

from ..engine.runtime import (ccl_built, communicator, cross_rank, cross_size, cuda_built, current, ddl_built,
                              gloo_built, gloo_enabled, init, is_homogeneous, is_initialized, local_rank, local_size,
                              mpi_built, mpi_enabled, mpi_threads_supported, nccl_built, rank, rocm_built, shutdown,
                              size)

__all__ = ["init", "shutdown", "is_initialized", "size", "rank", "local_size", "local_rank", "cross_size",
           "cross_rank", "is_homogeneous", "mpi_threads_supported", "communicator", "current", "mpi_built",
           "mpi_enabled", "gloo_built", "gloo_enabled", "nccl_built", "ddl_built", "ccl_built", "cuda_built",
           "rocm_built"]

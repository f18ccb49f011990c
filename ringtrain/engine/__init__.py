"""The op engine every framework face shares: negotiation, ordering, fusion, stalls, failures, process sets.

It knows arrays (NumPy on the host, CuPy on a GPU) and op records, never a
framework: ``ringtrain.torch`` and ``ringtrain.tensorflow`` turn their
tensors into arrays that share the tensors' memory and call the functions
below, as Horovod's framework modules call its common core.

* the runtime (:mod:`~ringtrain.engine.runtime`): ``init``, ``shutdown``,
  ``rank``, ``size`` and where this rank sits;
* process sets (:mod:`~ringtrain.engine.process_sets`);
* ops over arrays, each returning a handle (:mod:`~ringtrain.engine.ops`),
  and ``poll`` / ``synchronize``;
* the contract and the failure model (:mod:`~ringtrain.engine.core`): which
  calls are collective, what fails how, :meth:`Engine.helper
  <ringtrain.engine.core.Engine.helper>` for plain collectives run around
  the engine.

Example (two ranks; ``mpirun -np 2 python script.py``)::

    import numpy as np
    from ringtrain import engine

    engine.init()
    x = np.full(4, engine.rank() + 1.0, np.float32)
    handle = engine.allreduce_async(x, name="x", op=engine.Sum, out=x)  # in place
    engine.synchronize(handle)                                          # x is 3.0 everywhere
    engine.shutdown()
"""

from .errors import CollectiveMismatchError, DuplicateNameError, HorovodInternalError, HostsUpdatedInterrupt
from .ops import (allgather_async, allgather_object, allreduce, allreduce_async, alltoall_async, barrier,
                  broadcast_async, broadcast_object, grouped_allgather_async, grouped_allreduce_async,
                  grouped_reducescatter_async, join, poll, reducescatter_async, refused, start_timeline,
                  stop_timeline, synchronize)
from .process_sets import ProcessSet, communicator_of, global_process_set, included, set_rank
from .reduce_ops import Adasum, Average, Max, Min, Product, Sum
from .runtime import (add_process_set, ccl_built, communicator, cross_rank, cross_size, cuda_built, current,
                      ddl_built, gloo_built, gloo_enabled, helper, init, is_homogeneous, is_initialized, local_rank,
                      local_size, mpi_built, mpi_enabled, mpi_threads_supported, nccl_built, rank, remove_process_set,
                      rocm_built, shutdown, size)

__all__ = ["CollectiveMismatchError", "DuplicateNameError", "HorovodInternalError", "HostsUpdatedInterrupt",
           "allgather_async", "allreduce", "allreduce_async", "alltoall_async", "barrier", "broadcast_async",
           "grouped_allgather_async", "grouped_allreduce_async", "grouped_reducescatter_async", "join", "poll",
           "reducescatter_async", "refused", "start_timeline", "stop_timeline", "synchronize", "ProcessSet",
           "add_process_set", "global_process_set", "remove_process_set", "Adasum", "Average", "Max", "Min",
           "Product", "Sum", "cross_rank", "cross_size", "current", "helper", "init", "is_homogeneous",
           "is_initialized", "local_rank", "local_size", "rank", "shutdown", "size", "communicator_of", "included",
           "set_rank", "ccl_built", "communicator", "cuda_built", "ddl_built", "gloo_built", "gloo_enabled",
           "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built", "rocm_built", "broadcast_object",
           "allgather_object"]

"""The op layer under the TensorFlow face: :mod:`ringtrain.engine`, and what the face adds to it.

The face (:mod:`ringtrain.tensorflow.mpi_ops`) turns tensors into NumPy
arrays and calls the engine shared with ``ringtrain.torch`` through this
module only: the runtime (``init``, the rank family), process sets, the
``*_async`` ops and ``synchronize``, ``barrier``, ``join``, the object
helpers (``broadcast_object``, ``allgather_object``) and the failure model
(:mod:`ringtrain.engine.core`'s docstring is the contract). What the
TensorFlow face adds here:

* :func:`default_name`: ops submitted from a graph's Python function carry
  the name the face chose when it built the graph (the n-th collective of
  a TF1 graph, or of a process set's ``tf.function`` collectives), since
  TensorFlow runs them on its own threads, whose unnamed counters would not
  match across ranks;
* :func:`process_set_by_id` and :func:`scatter_rows`, pure look-ups.

Collective: as the engine's contract says, every member of an op's
process set must submit it.
"""

import contextlib
import threading

from ..engine import (Adasum, Average, CollectiveMismatchError, HorovodInternalError, Max, Min, Product,
                      ProcessSet, Sum, add_process_set, allgather_async, allgather_object, allreduce,
                      allreduce_async, alltoall_async, barrier, broadcast_async, broadcast_object, communicator_of,
                      cross_rank, cross_size, current, global_process_set, grouped_allgather_async,
                      grouped_allreduce_async, grouped_reducescatter_async, init, is_homogeneous, is_initialized,
                      join, local_rank, local_size, poll, rank, reducescatter_async, remove_process_set, shutdown,
                      size, synchronize)

__all__ = ["Average", "Sum", "Adasum", "Min", "Max", "Product", "HorovodInternalError", "CollectiveMismatchError",
           "ProcessSet", "global_process_set", "add_process_set", "remove_process_set", "init", "shutdown",
           "is_initialized", "rank", "size", "local_rank", "local_size", "cross_rank", "cross_size",
           "is_homogeneous", "allreduce", "allreduce_async", "grouped_allreduce_async", "allgather_async",
           "grouped_allgather_async", "broadcast_async", "alltoall_async", "reducescatter_async",
           "grouped_reducescatter_async", "barrier", "join", "poll", "synchronize", "scatter_rows",
           "communicator_of", "process_set_by_id", "default_name", "name_or_default", "broadcast_object",
           "allgather_object"]

_local = threading.local()


@contextlib.contextmanager
def default_name(name):
    """Ops submitted without a name in this block, on this thread, take ``name`` (matched by it across ranks)."""
    _local.name = name
    try:
        yield
    finally:
        _local.name = None


def name_or_default(name):
    """``name``, or the :func:`default_name` of this thread's block (None outside one)."""
    return name if name is not None else getattr(_local, "name", None)


def process_set_by_id(set_id):
    """The registered process set of id ``set_id`` (ValueError when there is none, or before ``init``)."""
    ps = current().sets.sets.get(set_id)
    if ps is None:
        raise ValueError(f"process set {set_id} is not registered; call hvd.add_process_set() first")
    return ps


def scatter_rows(rows, nranks):
    """Each member's ``(start, stop)`` rows of a reducescatter: the first ``rows % n`` members one more (pure)."""
    base, extra = divmod(rows, nranks)
    bounds, start = [], 0
    for r in range(nranks):
        stop = start + base + (1 if r < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds

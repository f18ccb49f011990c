"""Sparse allreduce, as Horovod does it: gather every rank's indices and values, then sum on use.

The result is an uncoalesced sparse tensor whose duplicate indices add up
when it is coalesced or used, so it equals the dense allreduce.
"""

import torch

from . import handles
from .ops_async import allgather_async
from .process_sets import global_process_set
from .reduce_ops import Average, Sum

__all__ = ["sparse_allreduce_async"]


def sparse_allreduce_async(tensor, name, op, process_set=global_process_set):
    """Start an allreduce of a sparse COO tensor; returns a function that waits and gives the result.

    Collective over the process set. ``op`` is ``Average`` or ``Sum``.
    """
    if op not in (Average, Sum):
        raise ValueError(f"sparse_allreduce_async: op must be hvd.Average or hvd.Sum, got {op!r}")
    sparse = tensor.coalesce() if not tensor.is_coalesced() else tensor
    # allgather concatenates on the first dimension: indices go as one row per nonzero.
    indices = allgather_async(sparse.indices().t().contiguous(), f"{name}.indices", process_set)
    values = allgather_async(sparse.values().contiguous(), f"{name}.values", process_set)
    ps = global_process_set if process_set is None else process_set

    def result():
        gathered_values = handles.synchronize(values)
        gathered_indices = handles.synchronize(indices)
        if op == Average:
            gathered_values = gathered_values / ps.size()
        return torch.sparse_coo_tensor(gathered_indices.t(), gathered_values, sparse.shape)

    return result

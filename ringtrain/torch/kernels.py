"""What each op does once every rank has agreed to run it: the bytes, moved on the engine's thread.

Every function here is collective over ``comm`` and is called by
:class:`~ringtrain.torch.engine.Engine` on every member rank in the same
order, with arguments the ranks have already compared
(:mod:`ringtrain.torch.negotiation`), so no header check is needed here.

Reductions of the dtypes ringtrain's comm layer takes go through
:func:`ringtrain.comm.allreduce_` (the shared-memory window on one host,
the ring or MPI across hosts; CUDA IPC for CUDA tensors); the others
(8- and 16-bit integers, bool, ``Product``) through MPI's ``Allreduce``;
bfloat16 in float32. Data movement (allgather, broadcast, alltoall) hands
MPI zero-copy byte views of the tensors; CUDA tensors are staged through
host memory for those.
"""

import math

import numpy as np
import torch

from ..comm import allreduce_
from .dtypes import RING_DTYPES, byte_view, host_view, reduces_as
from .interop import as_array

__all__ = ["FUSABLE", "fuse_key", "nbytes", "run", "scatter_rows", "zeros_like_meta"]

FUSABLE = ("allreduce", "reducescatter")


def fuse_key(meta):
    """What reductions fused into one buffer must share: everything but the shape (pure)."""
    return tuple(pair for pair in meta if pair[0] != "shape")


def nbytes(meta):
    """The size in bytes of the tensor an op's ``meta`` describes (pure)."""
    fields = dict(meta)
    return math.prod(fields["shape"]) * getattr(torch, fields["dtype"]).itemsize


def scatter_rows(rows, size):
    """``(start, count)`` of each rank's rows when a reducescatter splits ``rows`` over ``size`` ranks (pure).

    The first ``rows % size`` ranks get one row more, as in Horovod.
    """
    base, extra = divmod(rows, size)
    out, start = [], 0
    for r in range(size):
        count = base + (1 if r < extra else 0)
        out.append((start, count))
        start += count
    return out


def zeros_like_meta(meta):
    """Zeros of the shape, dtype and device kind an op's ``meta`` names: a joined rank's contribution."""
    fields = dict(meta)
    device = torch.device("cuda", torch.cuda.current_device()) if fields["device"] == "cuda" else "cpu"
    return torch.zeros(fields["shape"], dtype=getattr(torch, fields["dtype"]), device=device)


def run(kind, comm, group):
    """Run ``group`` (``[(Ready, Entry)]``, one op or a fused run); return each entry's result."""
    if kind == "call":  # process-set changes: a function every rank runs on the engine's thread
        return [entry.args[0](comm) for _, entry in group]
    return _KERNELS[kind](comm, group)


def _mpi_op(op, dtype):
    from mpi4py import MPI

    if dtype == torch.bool:  # MPI reduces booleans with its logical ops only
        return {"sum": MPI.LOR, "max": MPI.LOR, "min": MPI.LAND, "product": MPI.LAND}[op]
    return {"sum": MPI.SUM, "min": MPI.MIN, "max": MPI.MAX, "product": MPI.PROD}[op]


def _sync(tensor):
    # Work this thread queued on torch's stream must land before MPI or CuPy reads the memory.
    if tensor.is_cuda:
        torch.cuda.current_stream(tensor.device).synchronize()


def reduce_(comm, flat, op):
    """Reduce the contiguous 1-D ``flat`` in place across ``comm`` with ``op`` (sum, min, max, product)."""
    _sync(flat)
    if flat.dtype in RING_DTYPES and op != "product":
        allreduce_(as_array(flat), op=op, comm=comm)
        return flat
    from mpi4py import MPI

    wide = flat.dtype == torch.float16  # MPI has no half type: reduce in float32, as Horovod's CPU path does
    host = flat.cpu() if flat.is_cuda or wide else flat
    work = host.float() if wide else host
    comm.Allreduce(MPI.IN_PLACE, host_view(work), op=_mpi_op(op, work.dtype))
    if work is not flat:
        flat.copy_(work)
    return flat


def scale_(flat, factor, divisor):
    """``flat *= factor / divisor`` in place: integers through float64, then truncated, as Horovod does."""
    if factor == 1.0 and divisor == 1:
        return flat
    if flat.dtype.is_floating_point:
        if factor != 1.0:
            flat.mul_(factor)
        if divisor != 1:
            flat.div_(divisor)
        return flat
    wide = flat.double()
    if factor != 1.0:
        wide.mul_(factor)
    if divisor != 1:
        wide.div_(divisor)
    return flat.copy_(wide)


def _reduce_group(comm, group):
    """Fuse the group's inputs into one buffer, scale, reduce and scale: the flat result and each tensor's span."""
    fields = dict(group[0][0].meta)
    op, size = fields["op"], comm.Get_size()
    if op == "adasum":  # every rank reaches this with the same op, so every rank raises
        raise NotImplementedError("Adasum is not implemented in ringtrain.torch; use op=hvd.Average or hvd.Sum")
    inputs = [entry.args[0] for _, entry in group]
    dtype = reduces_as(inputs[0].dtype)
    if len(inputs) == 1 and inputs[0].is_contiguous() and dtype == inputs[0].dtype \
            and entry_output(group[0]) is not None:
        flat = entry_output(group[0]).reshape(-1)
        if flat.data_ptr() != inputs[0].data_ptr():
            flat.copy_(inputs[0].reshape(-1))
    else:
        flat = torch.cat([t.reshape(-1).to(dtype) for t in inputs])
    # Average divides after the sum, except in half precision, where the sum could overflow first.
    average = op == "average"
    half = dtype == torch.float16
    scale_(flat, fields["prescale"], size if average and half else 1)
    reduce_(comm, flat, "sum" if average else op)
    scale_(flat, fields["postscale"], size if average and not half else 1)
    spans, offset = [], 0
    for t in inputs:
        spans.append((offset, t.numel()))
        offset += t.numel()
    return flat, spans


def entry_output(pair):
    """The output tensor an allreduce entry writes, when it can hold the fused result directly."""
    _, entry = pair
    return entry.args[1] if entry.kind == "allreduce" and entry.args[1].is_contiguous() else None


def _allreduce(comm, group):
    flat, spans = _reduce_group(comm, group)
    results = []
    for (_, entry), (offset, n) in zip(group, spans):
        out = entry.args[1]
        if out.data_ptr() != flat.data_ptr() or out.numel() != flat.numel():
            out.copy_(flat[offset:offset + n].view(out.shape))
        results.append(out)
    return results


def _reducescatter(comm, group):
    flat, spans = _reduce_group(comm, group)
    rank, size = comm.Get_rank(), comm.Get_size()
    results = []
    for (_, entry), (offset, n) in zip(group, spans):
        tensor = entry.args[0]
        rows = tensor.shape[0]
        start, count = scatter_rows(rows, size)[rank]
        per_row = n // rows if rows else 0
        mine = flat[offset + start * per_row: offset + (start + count) * per_row]
        results.append(mine.view(count, *tensor.shape[1:]).to(tensor.dtype).clone())
    return results


def _staged(tensor):
    """``tensor`` as a contiguous CPU tensor MPI can read (a copy for CUDA or strided tensors)."""
    _sync(tensor)
    return tensor.detach().cpu().contiguous()


def _allgather(comm, group):
    (op, entry), = group
    tensor = _staged(entry.args[0])
    rows = [info for info in op.infos]
    rest = tensor.shape[1:] if tensor.dim() else ()
    row_bytes = math.prod(rest) * tensor.element_size()
    out = torch.empty((sum(rows), *rest), dtype=tensor.dtype)
    comm.Allgatherv(byte_view(tensor), [byte_view(out), [r * row_bytes for r in rows]])
    return [out.to(entry.args[0].device)]


def _broadcast(comm, group):
    (op, entry), = group
    tensor, out = entry.args
    root = dict(op.meta)["root"]
    if comm.Get_rank() == root and out.data_ptr() != tensor.data_ptr():
        out.copy_(tensor)
    host = _staged(out) if out.is_cuda or not out.is_contiguous() else out
    comm.Bcast(byte_view(host), root=root)
    if host is not out:
        out.copy_(host)
    return [out]


def _alltoall(comm, group):
    (op, entry), = group
    tensor = _staged(entry.args[0])
    rank = comm.Get_rank()
    sent = op.infos[rank]
    received = [splits[rank] for splits in op.infos]
    rest = tensor.shape[1:]
    row_bytes = math.prod(rest) * tensor.element_size()
    out = torch.empty((sum(received), *rest), dtype=tensor.dtype)
    send_counts = [s * row_bytes for s in sent]
    recv_counts = [r * row_bytes for r in received]
    from mpi4py import MPI

    comm.Alltoallv([byte_view(tensor), (send_counts, _displacements(send_counts)), MPI.BYTE],
                   [byte_view(out), (recv_counts, _displacements(recv_counts)), MPI.BYTE])
    return [(out.to(entry.args[0].device), torch.tensor(received, dtype=torch.int32))]


def _displacements(counts):
    return np.concatenate(([0], np.cumsum(counts[:-1]))).astype(np.int64).tolist() if counts else []


def _barrier(comm, group):
    comm.Barrier()
    return [None for _ in group]


_KERNELS = {"allreduce": _allreduce, "reducescatter": _reducescatter, "allgather": _allgather,
            "broadcast": _broadcast, "alltoall": _alltoall, "barrier": _barrier}

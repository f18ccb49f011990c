"""What each op does once its process set's leader has decided it: the bytes, moved by the channel's driver.

Every function here is collective over ``comm`` (the process set's data
communicator) and is called by :class:`~ringtrain.torch.channel.Channel`
on every member in the same order, with arguments the ranks have already
compared (:mod:`ringtrain.torch.negotiation`), so no header check is
needed here.

Which tensors the ops take, and how MPI sees their memory: CPU tensors
are handed to MPI as zero-copy NumPy views (:func:`host_view`,
:func:`byte_view`); CUDA tensors are staged through host memory, except
reductions, which go through :func:`ringtrain.comm.allreduce_` (CUDA IPC
on one host). Reductions of the dtypes ringtrain's comm layer takes
(:data:`RING_DTYPES`) go through ``allreduce_`` (the shared-memory window
on one host, the ring or MPI across hosts); the others (8- and 16-bit
integers, bool, ``Product``) through MPI's ``Allreduce``; bfloat16 in
float32. A reduce-scatter is MPI's ``Reduce_scatter``: each rank receives
only its rows, half the bytes of an allreduce.
"""

import math
import os

import numpy as np
import torch

from ..comm import allreduce_
from ..comm.state import state_of
from ..environment import env_int, or_default
from .interop import as_array

__all__ = ["SUPPORTED", "RING_DTYPES", "FUSABLE", "check_tensor", "dtype_name", "host_view", "byte_view",
           "reduces_as", "fuse_key", "nbytes", "run", "scatter_rows", "zeros_like_meta", "stand_in_args", "split_parts",
           "reduce_locally", "take_result", "raw_bytes", "host_array", "run_local", "GroupResults", "LOCAL_BYTES"]

# What Horovod's torch ops accept.
SUPPORTED = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
             torch.float32, torch.float64, torch.bool)
_SUPPORTED = frozenset(SUPPORTED)
# The dtypes ringtrain's own allreduce (ringtrain.comm) reduces; the rest go to MPI's Allreduce.
RING_DTYPES = (torch.float16, torch.float32, torch.float64, torch.int32, torch.int64)
FUSABLE = ("allreduce", "reducescatter")
_NUMPY_FAST = {"float32": np.float32, "float64": np.float64}
_COMBINE = {"sum": np.add, "min": np.minimum, "max": np.maximum}  # what a transport's reduce-scatter combines with
# An allreduce or broadcast up to this size travels with its announcements and is computed on every rank.
def local_bytes(env):
    """``RINGTRAIN_HVD_LOCAL_BYTES`` (EnvironmentValueError when it is no count)."""
    return env_int(env, "RINGTRAIN_HVD_LOCAL_BYTES", 16 << 10, unit=" of bytes", everywhere=True)


# A bad value is refused by hvd.init()'s agreement (engine.settings_problem), on every rank.
LOCAL_BYTES = or_default(local_bytes, os.environ, 16 << 10)
_FAST_DTYPES = (torch.float32, torch.float64)  # integer averages truncate, float16 predivides: not here


def dtype_name(dtype):
    """``torch.float32`` -> ``"float32"`` (pure)."""
    return str(dtype).replace("torch.", "")


def check_tensor(tensor, who):
    """The problem with a tensor no collective takes, as one line, or None (pure)."""
    if not isinstance(tensor, torch.Tensor):
        return f"{who}: expected a torch.Tensor, got {type(tensor).__name__}"
    if tensor.dtype not in _SUPPORTED:
        names = ", ".join(dtype_name(d) for d in SUPPORTED)
        return f"{who}: tensor type {dtype_name(tensor.dtype)} is not supported; use one of {names}"
    if not (tensor.is_cpu or tensor.is_cuda):
        return f"{who}: a tensor on {tensor.device}: only CPU and CUDA tensors are supported"
    if tensor.is_sparse:
        return f"{who}: a sparse tensor; use sparse_allreduce_async, or sparse_as_dense=True in the optimizer"
    return None


def reduces_as(dtype):
    """The dtype a reduction of ``dtype`` runs in: float32 for bfloat16, else itself (pure)."""
    return torch.float32 if dtype == torch.bfloat16 else dtype


def host_view(tensor):
    """A NumPy view of a contiguous CPU tensor of a dtype NumPy has (not bfloat16); writes go through."""
    return tensor.detach().reshape(-1).numpy()


def byte_view(tensor):
    """The raw bytes of a contiguous CPU tensor, as a 1-D uint8 NumPy view (any dtype, 0-dim included)."""
    flat = tensor.detach().reshape(-1)
    if flat.dtype == torch.bool or flat.element_size() > 1:
        flat = flat.view(torch.uint8)
    return flat.numpy().view(np.uint8)


def fuse_key(meta):
    """What reductions fused into one buffer must share: everything but the shape (pure).

    Floats are compared by ``repr``, so NaN factors fuse alike on every rank.
    """
    return tuple((f, repr(v) if isinstance(v, float) else v) for f, v in meta if f != "shape")


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


def stand_in_args(meta):
    """The arguments a joined rank runs an allreduce with that it did not submit: zeros in, zeros out."""
    fields = dict(meta)
    if "parts" in fields:
        return [(z, z) for z in (zeros_like_meta(m) for m in fields["parts"])]
    zeros = zeros_like_meta(meta)
    return (zeros, zeros)


def split_parts(decision, args):
    """A grouped op as one ``(meta, args, infos)`` per tensor, in order (pure)."""
    metas = dict(decision.meta)["parts"]
    return [(meta, a, [info[i] if info is not None else None for info in (decision.infos or [])])
            for i, (meta, a) in enumerate(zip(metas, args))]


def host_array(tensor):
    """A flat NumPy view of a CPU float32/float64 tensor, kept for the next call on the same memory.

    Making the view costs more than a small op's arithmetic, and programs
    reduce the same tensors step after step, often through a new tensor
    object each time (``p.detach()``), so a view is found by the memory it
    covers: its address, dtype and size. The view holds that memory, so no
    other storage can be given the same address while it is kept. A strided
    tensor has no flat view: it gets a fresh copy (to read; writes to it do
    not reach the tensor), never kept, so no later call can read stale values.
    """
    if not tensor.is_contiguous():
        return tensor.detach().reshape(-1).numpy()
    key = (tensor.data_ptr(), tensor.dtype, tensor.numel())
    array = _VIEWS.get(key)
    if array is None:
        array = tensor.detach().numpy().reshape(-1)
        if len(_VIEWS) >= 256:  # views of tensors since freed must not pile up
            _VIEWS.clear()
        _VIEWS[key] = array
    return array


_VIEWS = {}


def _fast(tensor):
    return tensor.dtype in _FAST_DTYPES and not tensor.is_cuda and tensor.is_contiguous()


def _fast_plan(meta):
    """The NumPy dtype of a sum or average without scale factors of float32/float64 (else None), remembered."""
    found = _PLANS.get(id(meta))
    if found is not None and found[0] is meta:
        return found[1]
    fields = dict(meta)
    plan = (_NUMPY_FAST.get(fields.get("dtype")) if fields.get("op") in ("sum", "average")
            and fields.get("prescale") == 1.0 and fields.get("postscale") == 1.0 else None)
    if len(_PLANS) >= 1024:
        _PLANS.clear()
    _PLANS[id(meta)] = (meta, plan)  # the meta is kept alive here, so its id is not reused while remembered
    return plan


_PLANS = {}


def reduce_locally(meta, inputs, out):
    """An allreduce computed on this rank from every member's input (tensors, or their raw bytes), into ``out``.

    The same arithmetic as the collective path (each input prescaled,
    combined in member order, then postscaled; an average divides after the
    sum, or before it in half precision), so every member computing a small
    op itself (:mod:`ringtrain.torch.channel`) gets the same bits.
    """
    numpy_dtype = _fast_plan(meta)
    if numpy_dtype is not None and out.is_contiguous():  # (a plan means a CPU float32/float64 op: out is one)
        return _reduce_in_numpy(meta, numpy_dtype, inputs, out)
    n = len(inputs)
    fields = dict(meta)
    op = fields["op"]
    dtype = getattr(torch, fields["dtype"])
    work_dtype = reduces_as(dtype)
    average, half = op == "average", work_dtype == torch.float16
    total = None
    for x in inputs:
        t = x.detach() if isinstance(x, torch.Tensor) else torch.frombuffer(bytearray(x), dtype=dtype)
        t = t.reshape(-1).to(work_dtype, copy=True)
        scale_(t, fields["prescale"], n if average and half else 1)
        total = t if total is None else _combine(total, t, op)
    scale_(total, fields["postscale"], n if average and not half else 1)
    out.copy_(total.to(dtype).view(out.shape))
    return out


def _reduce_in_numpy(meta, numpy_dtype, inputs, out):
    """:func:`reduce_locally` of a float32/float64 sum or average without factors, through NumPy views."""
    total = host_array(out)
    arrays = []
    for i, x in enumerate(inputs):
        if x is out:
            a = total
        else:
            a = host_array(x) if isinstance(x, torch.Tensor) else np.frombuffer(x, numpy_dtype)
        # Summing into out, which may be one of the inputs: one read after the first sum must be a copy.
        arrays.append(a.copy() if i > 1 and np.shares_memory(a, total) else a)
    n = len(arrays)
    if n == 1:
        np.copyto(total, arrays[0])
    else:
        np.add(arrays[0], arrays[1], out=total)
    for a in arrays[2:]:
        total += a
    if meta[_OP][1] == "average":
        divisor = _DIVISORS.get((numpy_dtype, n))
        if divisor is None:  # a NumPy scalar of the array's dtype: the division stays in that dtype
            divisor = _DIVISORS[(numpy_dtype, n)] = numpy_dtype(n)
        np.divide(total, divisor, out=total)
    return out


_DIVISORS = {}


def _combine(total, t, op):
    if total.dtype == torch.bool:  # as MPI's logical ops do for booleans
        return total.logical_or_(t) if op in ("sum", "average", "max") else total.logical_and_(t)
    if op in ("sum", "average"):
        return total.add_(t)
    if op == "product":
        return total.mul_(t)
    return torch.maximum(total, t, out=total) if op == "max" else torch.minimum(total, t, out=total)


def take_result(out, data):
    """Write another rank's data (a tensor, or its raw bytes) into ``out``; return ``out``."""
    if isinstance(data, torch.Tensor):
        if data.data_ptr() != out.data_ptr():
            out.copy_(data.view(out.shape))
    elif _fast(out):
        np.copyto(host_array(out), np.frombuffer(data, _NUMPY_FAST[dtype_name(out.dtype)]))
    else:
        out.copy_(torch.frombuffer(bytearray(data), dtype=out.dtype).view(out.shape))
    return out


def raw_bytes(tensor):
    """A CPU tensor's contents as ``bytes`` (what goes with a small op's announcement)."""
    if _fast(tensor):
        return host_array(tensor).tobytes()
    return bytes(byte_view(tensor.detach().contiguous()))


def run_local(meta, data, out):
    """A small op computed on this rank from the data every member sent with its announcement, into ``out``.

    ``data`` holds each member's (in member order; None for a rank that
    joined, which adds zeros): an allreduce's inputs, a broadcast's from its
    root; a barrier has none.
    """
    kind = meta[0][1]
    if kind == "barrier":
        return None
    if kind == "broadcast":
        return take_result(out, data[dict(meta)["root"]])
    return reduce_locally(meta, [zeros_like_meta(meta) if d is None else d for d in data], out)


class GroupResults:
    """A grouped op's results: ``done(values, error)`` runs once every part has completed (with the first error)."""

    def __init__(self, parts, done):
        self.values, self.left, self.error, self._done = [None] * parts, parts, None, done

    def part(self, i):
        """The completion of part ``i`` (what a :class:`~ringtrain.torch.handles.Pending` is to an op)."""
        return _Part(self, i)

    def _finish(self, i, value, error):
        self.values[i] = value
        self.error = self.error or error
        self.left -= 1
        if self.left == 0:
            self._done(self.values, self.error)


class _Part:
    __slots__ = ("group", "i")

    def __init__(self, group, i):
        self.group, self.i = group, i

    def succeed(self, value):
        self.group._finish(self.i, value, None)

    def fail(self, error):
        self.group._finish(self.i, None, error)


def run(kind, comm, group):
    """Run ``group`` (``[(Decision, Entry)]``, one op or a fused run); return each entry's result."""
    if kind == "call":  # process-set changes and the timeline: a function every member runs in order
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

    host, work = _mpi_work(flat)
    comm.Allreduce(MPI.IN_PLACE, host_view(work), op=_mpi_op(op, work.dtype))
    if work is not flat:
        flat.copy_(work)
    return flat


def _mpi_work(flat):
    """``(host, work)``: ``flat`` on the host, and in a dtype MPI reduces (float32 for float16: MPI has no half)."""
    wide = flat.dtype == torch.float16
    host = flat.cpu() if flat.is_cuda or wide else flat
    return host, (host.float() if wide else host)


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


def _fields(group, comm):
    fields = dict(group[0][0].meta)
    if fields["op"] == "adasum":  # every rank reaches this with the same op, so every rank raises
        raise NotImplementedError("Adasum is not implemented in ringtrain.torch; use op=hvd.Average or hvd.Sum")
    return fields, fields["op"] == "average", comm.Get_size()


# Where a reduction's fields sit in its meta (ops_async builds it in this order).
_OP, _PRESCALE, _POSTSCALE = 3, 4, 5
_FAST_OPS = ("sum", "min", "max", "average")


def _allreduce(comm, group):
    if len(group) == 1:
        result = _allreduce_one(comm, *group[0])
        if result is not None:
            return [result]
    fields, average, size = _fields(group, comm)
    inputs = [entry.args[0] for _, entry in group]
    dtype = reduces_as(inputs[0].dtype)
    out0 = group[0][1].args[1]
    if len(group) == 1 and inputs[0].is_contiguous() and out0.is_contiguous() and dtype == inputs[0].dtype:
        flat = out0.reshape(-1)
        if flat.data_ptr() != inputs[0].data_ptr():
            flat.copy_(inputs[0].reshape(-1))
    else:
        flat = torch.cat([t.reshape(-1).to(dtype) for t in inputs])
    # Average divides after the sum, except in half precision, where the sum could overflow first.
    half = dtype == torch.float16
    scale_(flat, fields["prescale"], size if average and half else 1)
    reduce_(comm, flat, "sum" if average else fields["op"])
    scale_(flat, fields["postscale"], size if average and not half else 1)
    results, offset = [], 0
    for (_, entry), t in zip(group, inputs):
        out, n = entry.args[1], t.numel()
        if out.data_ptr() != flat.data_ptr() or out.numel() != flat.numel():
            out.copy_(flat[offset:offset + n].view(out.shape))
        offset += n
        results.append(out)
    return results


def _allreduce_one(comm, decision, entry):
    """A lone contiguous CPU allreduce of a dtype the comm layer reduces, without scale factors: the common
    small op, in as few steps as a direct ``allreduce_`` (None when it is not that case)."""
    meta = decision.meta
    op = meta[_OP][1]
    tensor, out = entry.args
    if (meta[_PRESCALE][1] != 1.0 or meta[_POSTSCALE][1] != 1.0 or op not in _FAST_OPS
            or tensor.dtype not in _FAST_DTYPES or tensor.is_cuda or not out.is_contiguous()):
        return None
    if out is not tensor:
        out.copy_(tensor)
    array = host_array(out)
    if op == "average":
        allreduce_(array, op="sum", comm=comm)
        out.div_(comm.Get_size())  # in the tensor's own dtype, as the general path does
    else:
        allreduce_(array, op=op, comm=comm)
    return out


def _reducescatter(comm, group):
    """Each rank's rows of the reduction, and only those: the inputs laid out rank by rank, then one reduce-scatter.

    Half the bytes of an allreduce move: ringtrain's transport (the
    shared-memory window on one host, the ring across hosts) runs only its
    first phase, each rank's rows padded to the same length so that its
    chunk is its rows; dtypes and ops the transports do not take go through
    MPI's ``Reduce_scatter``.
    """
    fields, average, size = _fields(group, comm)
    rank = comm.Get_rank()
    inputs = [_staged(entry.args[0]) for _, entry in group]
    dtype = reduces_as(inputs[0].dtype)
    blocks = [[] for _ in range(size)]
    for t in inputs:
        for r, (start, count) in enumerate(scatter_rows(t.shape[0], size)):
            blocks[r].append(t[start:start + count].reshape(-1))
    counts = [sum(b.numel() for b in bs) for bs in blocks]
    half = dtype == torch.float16
    op = "sum" if average else fields["op"]
    if dtype in RING_DTYPES and op in _COMBINE:
        width = max(counts)  # every rank's block padded to the longest: chunk r is rank r's rows
        if len(inputs) == 1 and min(counts) == width:  # rows that split evenly are laid out so already
            send = inputs[0].reshape(-1).to(dtype, copy=True)
        else:
            send = torch.zeros(size * width, dtype=dtype)
            for r, bs in enumerate(blocks):
                if bs:
                    torch.cat([b.to(dtype) for b in bs], out=send[r * width:r * width + counts[r]])
        scale_(send, fields["prescale"], size if average and half else 1)
        array = host_view(send)
        state_of(comm).transport_for("auto", array.nbytes).reduce_scatter(array, _COMBINE[op])
        mine = send[rank * width:rank * width + counts[rank]]
    else:
        send = torch.cat([b.to(dtype) for bs in blocks for b in bs])
        scale_(send, fields["prescale"], size if average and half else 1)
        host, work = _mpi_work(send)
        mine = torch.empty(counts[rank], dtype=work.dtype)
        comm.Reduce_scatter(host_view(work), host_view(mine), counts, op=_mpi_op(op, work.dtype))
    scale_(mine, fields["postscale"], size if average and not half else 1)
    results, offset = [], 0
    for (_, entry), t in zip(group, inputs):
        start, count = scatter_rows(t.shape[0], size)[rank]
        n = count * math.prod(t.shape[1:])
        results.append(mine[offset:offset + n].view(count, *t.shape[1:]).to(entry.args[0].dtype)
                       .to(entry.args[0].device))
        offset += n
    return results


def _staged(tensor):
    """``tensor`` as a contiguous CPU tensor MPI can read (a copy for CUDA or strided tensors)."""
    _sync(tensor)
    return tensor.detach().cpu().contiguous()


def _allgather(comm, group):
    (op, entry), = group
    tensor = _staged(entry.args[0])
    rows = list(op.infos)
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
    from mpi4py import MPI

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

"""What each op does once its process set's leader has decided it: the bytes, moved by the channel's driver.

Every function here is collective over ``comm`` (the process set's data
communicator) and is called by :class:`~ringtrain.engine.channel.Channel`
on every member in the same order, with arguments the ranks have already
compared (:mod:`ringtrain.engine.negotiation`), so no header check is
needed here.

The kernels take arrays (:mod:`ringtrain.engine.arrays`): NumPy arrays are
handed to MPI as they are; CuPy arrays are staged through host memory,
except reductions, which go through :func:`ringtrain.comm.allreduce_` (CUDA
IPC on one host). Reductions of the element types ringtrain's comm layer
takes (:data:`~ringtrain.engine.arrays.RING_DTYPES`) go through
``allreduce_`` (the shared-memory window on one host, the ring or MPI
across hosts); the others (8- and 16-bit integers, bool, ``Product``)
through MPI's ``Allreduce``; bfloat16 in float32. A reduce-scatter is
MPI's ``Reduce_scatter`` or a transport's: each rank receives only its
rows, half the bytes of an allreduce.
"""

import math

import numpy as np

from ..comm import allreduce_
from ..comm.collectives import reduce_into
from ..comm.state import state_of
from . import arrays
from .arrays import RING_DTYPES
from .negotiation import Grouped

__all__ = ["FUSABLE", "run", "scatter_rows", "stand_in_args", "split_parts",
           "reduce_locally", "take_result", "raw_bytes", "run_local", "GroupResults", "scale_"]

FUSABLE = ("allreduce", "reducescatter")
_NUMPY_FAST = {"float32": np.float32, "float64": np.float64}
_COMBINE = {"sum": np.add, "min": np.minimum, "max": np.maximum}  # what a transport's reduce-scatter combines with
_FAST_OPS = ("sum", "min", "max", "average")


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


def _zeros_of(record):
    return arrays.zeros(record.shape, record.dtype, cuda=record.device == "cuda")


def stand_in_args(record):
    """The arguments a joined rank runs an allreduce with that it did not submit: zeros in, zeros out."""
    if type(record) is Grouped:
        return [(z, z) for z in (_zeros_of(part) for part in record.parts)]
    zeros = _zeros_of(record)
    return (zeros, zeros)


def split_parts(decision, args):
    """A grouped op as one ``(record, args, infos)`` per array, in order (pure)."""
    return [(part, a, [info[i] if info is not None else None for info in (decision.infos or [])])
            for i, (part, a) in enumerate(zip(decision.record.parts, args))]


def _fast_plan(record):
    """The NumPy dtype of a CPU float32/float64 sum or average without scale factors (else None), remembered."""
    kept, plan = _PLANS.get(id(record), (None, None))
    if kept is record:
        return plan
    plan = (_NUMPY_FAST.get(record.dtype) if record.op in ("sum", "average") and record.prescale == 1.0
            and record.postscale == 1.0 and record.device == "cpu" else None)
    if len(_PLANS) >= 1024:
        _PLANS.clear()
    _PLANS[id(record)] = (record, plan)  # the record is kept alive here, so its id is not reused while remembered
    return plan


_PLANS = {}


def _input(x, name):
    """A member's input: an array, or the raw bytes it announced, as a flat array of ``name`` elements."""
    if isinstance(x, (bytes, bytearray, memoryview)):
        return np.frombuffer(x, np.uint16 if name == "bfloat16" else np.dtype(name))
    return x.reshape(-1)


def reduce_locally(record, inputs, out):
    """An allreduce computed on this rank from every member's input (arrays, or their raw bytes), into ``out``.

    The same arithmetic as the collective path (each input prescaled,
    combined in member order, then postscaled; an average divides after the
    sum, in half precision by multiplying by ``postscale / n``, as Horovod
    does), so every member computing a small op itself
    (:mod:`ringtrain.engine.channel`) gets the same bits.
    """
    numpy_dtype = _fast_plan(record)
    if numpy_dtype is not None and out.flags.c_contiguous:
        return _reduce_in_numpy(record, numpy_dtype, inputs, out)
    n = len(inputs)
    op, name = record.op, record.dtype
    total = None
    for x in inputs:
        t = arrays.to_work(_input(x, name), name)
        t = scale_(t, record.prescale, 1)
        total = t if total is None else _combine(total, t, op)
    total = scale_(total, *_postscale(record, name, n))
    return arrays.from_work(total, name, out)


def _postscale(record, work_name, size):
    """``(factor, divisor)`` applied after the reduction: an average's division is in it (pure).

    Half precision multiplies by ``postscale / size`` (one factor, in
    float32), as Horovod's CPU path does after summing in half precision,
    so the mean of equal inputs is what TensorFlow's ``(x * n) / n`` gives;
    the other types divide by ``size`` in their own type (integers in
    float64, truncated).
    """
    if record.op != "average":
        return record.postscale, 1
    if work_name == "float16":
        return record.postscale / size, 1
    return record.postscale, size


def _reduce_in_numpy(record, numpy_dtype, inputs, out):
    """:func:`reduce_locally` of a float32/float64 sum or average without factors, in place in ``out``."""
    total = out if out.ndim == 1 else out.reshape(-1)
    n = len(inputs)
    if n == 1:
        np.copyto(total, _flat(inputs[0], out, total, numpy_dtype))
    elif n == 2:  # (one ufunc call: NumPy sees to an input that shares out's memory)
        np.add(_flat(inputs[0], out, total, numpy_dtype), _flat(inputs[1], out, total, numpy_dtype), out=total)
    else:
        later = []
        for x in inputs[2:]:  # out may be one of them: one read after the first sum is a copy, taken before it
            a = _flat(x, out, total, numpy_dtype)
            later.append(a.copy() if np.shares_memory(a, total) else a)
        np.add(_flat(inputs[0], out, total, numpy_dtype), _flat(inputs[1], out, total, numpy_dtype), out=total)
        for a in later:
            total += a
    if record.op == "average":
        divisor = _DIVISORS.get((numpy_dtype, n))
        if divisor is None:  # of the array's dtype, so the division stays in it (0-d: a ufunc takes it faster)
            divisor = _DIVISORS[(numpy_dtype, n)] = np.array(n, numpy_dtype)
            divisor.flags.writeable = False
        np.divide(total, divisor, out=total)
    return out


def _flat(x, out, total, numpy_dtype):
    """One member's input to :func:`_reduce_in_numpy`, flat: ``total`` for ``out`` itself, else a view."""
    if x is out:
        return total
    if isinstance(x, np.ndarray):
        return x if x.ndim == 1 else x.reshape(-1)
    return np.frombuffer(x, numpy_dtype)  # a member's raw bytes


_DIVISORS = {}


def _combine(total, t, op):
    xp = arrays.xp_of(total)
    if total.dtype == np.bool_:  # as MPI's logical ops do for booleans
        return xp.logical_or(total, t, out=total) if op in ("sum", "average", "max") else \
            xp.logical_and(total, t, out=total)
    if op in ("sum", "average"):
        return xp.add(total, t, out=total)
    if op == "product":
        return xp.multiply(total, t, out=total)
    return xp.maximum(total, t, out=total) if op == "max" else xp.minimum(total, t, out=total)


def take_result(out, data, name):
    """Write another rank's data (an array, or its raw bytes) into ``out``; return ``out``."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        source = np.frombuffer(data, np.uint16 if name == "bfloat16" else np.dtype(name))
        arrays.bits(out, name)[...] = source.reshape(out.shape)
    elif data is not out:
        arrays.bits(out, name)[...] = arrays.bits(data, name).reshape(out.shape)
    return out


def raw_bytes(array):
    """A host array's contents as ``bytes`` (what goes with a small op's announcement)."""
    return array.tobytes()


def run_local(record, data, out):
    """A small op computed on this rank from the data every member sent with its announcement, into ``out``.

    ``data`` holds each member's (in member order; None for a rank that
    joined, which adds zeros): an allreduce's inputs, a broadcast's from its
    root; a barrier has none.
    """
    if record.kind == "barrier":
        return None
    if record.kind == "broadcast":
        return take_result(out, data[record.root], record.dtype)
    return reduce_locally(record, [_zeros_of(record) if d is None else d for d in data], out)


class GroupResults:
    """A grouped op's results: ``done(values, error)`` runs once every part has completed (with the first error)."""

    def __init__(self, parts, done):
        self.values, self.left, self.error, self._done = [None] * parts, parts, None, done

    def part(self, i):
        """The completion of part ``i`` (what a :class:`~ringtrain.engine.handles.Pending` is to an op)."""
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
    return _KERNELS[kind](comm, group)


def _mpi_op(op, work):
    from mpi4py import MPI

    if work == "bool":  # MPI reduces booleans with its logical ops only
        return {"sum": MPI.LOR, "max": MPI.LOR, "min": MPI.LAND, "product": MPI.LAND}[op]
    return {"sum": MPI.SUM, "min": MPI.MIN, "max": MPI.MAX, "product": MPI.PROD}[op]


def reduce_(comm, flat, op):
    """Reduce the contiguous 1-D ``flat`` (in its work type) in place across ``comm`` with ``op``; return it."""
    arrays.synchronize(flat)
    name = flat.dtype.name
    if name in RING_DTYPES and op != "product":
        allreduce_(flat, op=op, comm=comm)
        return flat
    from mpi4py import MPI

    work = arrays.host(flat)
    if name == "float16":  # MPI has no half: reduce in float32
        work = work.astype(np.float32)
    comm.Allreduce(MPI.IN_PLACE, work, op=_mpi_op(op, work.dtype.name))
    if work is not flat:
        flat[...] = arrays.like(work.astype(flat.dtype, copy=False), flat)
    return flat


def scale_(flat, factor, divisor):
    """``flat * factor / divisor``, in place where it can be: integers through float64, then truncated, as Horovod.

    Returns the scaled array (``flat`` itself, except for integers).
    """
    if factor == 1.0 and divisor == 1:
        return flat
    xp = arrays.xp_of(flat)
    if flat.dtype == np.float16:  # in float32, rounded once, as frameworks scale half precision
        wide = flat.astype(np.float32)
        if factor != 1.0:
            wide *= np.float32(factor)
        if divisor != 1:
            wide /= np.float32(divisor)
        flat[...] = wide
        return flat
    if flat.dtype.kind == "f":
        if factor != 1.0:
            xp.multiply(flat, flat.dtype.type(factor), out=flat)
        if divisor != 1:
            xp.divide(flat, flat.dtype.type(divisor), out=flat)
        return flat
    wide = flat.astype(np.float64)
    if factor != 1.0:
        wide *= factor
    if divisor != 1:
        wide /= divisor
    flat[...] = wide.astype(flat.dtype)
    return flat


def _reduction(group, comm):
    record = group[0][0].record
    if record.op == "adasum":  # every rank reaches this with the same op, so every rank raises
        raise NotImplementedError("Adasum is not implemented in ringtrain's engine; use op=Average or Sum")
    return record, record.op == "average", comm.Get_size()


def _allreduce(comm, group):
    if len(group) == 1:
        result = _allreduce_one(comm, *group[0])
        if result is not None:
            return [result]
    record, average, size = _reduction(group, comm)
    name = record.dtype
    work_name = arrays.work_name(name)
    inputs = [entry.args[0] for _, entry in group]
    out0 = group[0][1].args[1]
    xp = arrays.xp_of(out0)
    if len(group) == 1 and work_name == name and out0.flags.c_contiguous:
        flat = out0.reshape(-1)
        if not _same_memory(flat, inputs[0]):
            flat[...] = inputs[0].reshape(-1)
    else:
        flat = xp.concatenate([arrays.to_work(t, name, copy=False) for t in inputs]) if len(inputs) > 1 else \
            arrays.to_work(inputs[0], name)
    # Average divides after the sum (half precision by multiplying: see _postscale).
    flat = scale_(flat, record.prescale, 1)
    reduce_(comm, flat, "sum" if average else record.op)
    flat = scale_(flat, *_postscale(record, work_name, size))
    results, offset = [], 0
    for (_, entry), t in zip(group, inputs):
        out, n = entry.args[1], t.size
        if not (len(group) == 1 and _same_memory(out, flat)):
            arrays.from_work(flat[offset:offset + n], name, out)
        offset += n
        results.append(out)
    arrays.synchronize(group[0][1].args[1])
    return results


def _same_memory(a, b):
    """Whether two arrays are the same elements in the same order (one is the other, or a contiguous view of it).

    A start address alone does not say so: a strided or transposed view of
    an output starts where the output does and holds other elements.
    """
    return _address(a) == _address(b) and a.size == b.size and a.flags.c_contiguous and b.flags.c_contiguous


def _address(a):
    return a.data.ptr if arrays.is_cuda(a) else a.__array_interface__["data"][0]


def _allreduce_one(comm, decision, entry):
    """A lone contiguous CPU allreduce of float32/float64 without scale factors: the common small op, in as
    few steps as a direct ``allreduce_`` (None when it is not that case)."""
    record = decision.record
    op = record.op
    array, out = entry.args
    if (record.prescale != 1.0 or record.postscale != 1.0 or op not in _FAST_OPS
            or record.dtype not in _NUMPY_FAST or record.device != "cpu" or not out.flags.c_contiguous):
        return None
    flat = out.reshape(-1)
    library_op = "sum" if op == "average" else op
    if array is out:
        allreduce_(flat, op=library_op, comm=comm)
    else:  # into another array: a large input is read where it is, not copied into out first
        reduce_into(flat, array.reshape(-1), op=library_op, comm=comm)
    if op == "average":
        np.divide(flat, flat.dtype.type(comm.Get_size()), out=flat)  # in the array's own dtype, as the general path
    return out


def _reducescatter(comm, group):
    """Each rank's rows of the reduction, and only those: the inputs laid out rank by rank, then one reduce-scatter.

    Half the bytes of an allreduce move: ringtrain's transport (the
    shared-memory window on one host, the ring across hosts) runs only its
    first phase, each rank's rows padded to the same length so that its
    chunk is its rows; element types and ops the transports do not take go
    through MPI's ``Reduce_scatter``.
    """
    record, average, size = _reduction(group, comm)
    rank = comm.Get_rank()
    name = record.dtype
    work_name = arrays.work_name(name)
    inputs = [arrays.host(entry.args[0]) for _, entry in group]
    blocks = [[] for _ in range(size)]
    for t in inputs:
        for r, (start, count) in enumerate(scatter_rows(t.shape[0], size)):
            blocks[r].append(arrays.to_work(t[start:start + count], name, copy=False))
    counts = [sum(b.size for b in bs) for bs in blocks]
    half = work_name == "float16"
    op = "sum" if average else record.op
    if work_name in RING_DTYPES and op in _COMBINE:
        width = max(counts)  # every rank's block padded to the longest: chunk r is rank r's rows
        send = np.zeros(size * width, dtype=work_name)
        for r, bs in enumerate(blocks):
            if bs:
                send[r * width:r * width + counts[r]] = np.concatenate(bs)
        send = scale_(send, record.prescale, 1)
        state_of(comm).transport_for("auto", send.nbytes).reduce_scatter(send, _COMBINE[op])
        mine = send[rank * width:rank * width + counts[rank]]
    else:
        send = np.concatenate([b for bs in blocks for b in bs]).astype(np.float32 if half else work_name)
        send = scale_(send, record.prescale, 1)
        mine = np.empty(counts[rank], dtype=send.dtype)
        comm.Reduce_scatter(send, mine, counts, op=_mpi_op(op, send.dtype.name))
        mine = mine.astype(work_name, copy=False)
    mine = scale_(mine, *_postscale(record, work_name, size))
    results, offset = [], 0
    for (_, entry), t in zip(group, inputs):
        start, count = scatter_rows(t.shape[0], size)[rank]
        n = count * math.prod(t.shape[1:])
        out = np.empty((count, *t.shape[1:]), dtype=np.uint16 if name == "bfloat16" else name)
        arrays.from_work(mine[offset:offset + n], name, out)
        results.append(arrays.like(out, entry.args[0]))
        offset += n
    return results


def _allgather(comm, group):
    (op, entry), = group
    array = entry.args[0]
    staged = arrays.host(array)
    rows = list(op.infos)
    rest = staged.shape[1:] if staged.ndim else ()
    row_bytes = math.prod(rest) * staged.itemsize
    out = np.empty((sum(rows), *rest), dtype=staged.dtype)
    comm.Allgatherv(arrays.byte_view(staged), [arrays.byte_view(out), [r * row_bytes for r in rows]])
    return [arrays.like(out, array)]


def _broadcast(comm, group):
    (op, entry), = group
    array, out = entry.args
    root = op.record.root
    if comm.Get_rank() == root and not _same_memory(out, array):
        out[...] = array
    on_host = not arrays.is_cuda(out) and out.flags.c_contiguous
    staged = out if on_host else arrays.host(out)
    comm.Bcast(arrays.byte_view(staged), root=root)
    if not on_host:
        out[...] = arrays.like(staged, out)
        arrays.synchronize(out)
    return [out]


def _alltoall(comm, group):
    from mpi4py import MPI

    (op, entry), = group
    array = entry.args[0]
    staged = arrays.host(array)
    rank = comm.Get_rank()
    sent = op.infos[rank]
    received = [splits[rank] for splits in op.infos]
    rest = staged.shape[1:]
    row_bytes = math.prod(rest) * staged.itemsize
    out = np.empty((sum(received), *rest), dtype=staged.dtype)
    send_counts = [s * row_bytes for s in sent]
    recv_counts = [r * row_bytes for r in received]
    comm.Alltoallv([arrays.byte_view(staged), (send_counts, _displacements(send_counts)), MPI.BYTE],
                   [arrays.byte_view(out), (recv_counts, _displacements(recv_counts)), MPI.BYTE])
    return [(arrays.like(out, array), np.array(received, dtype=np.int32))]


def _displacements(counts):
    return np.concatenate(([0], np.cumsum(counts[:-1]))).astype(np.int64).tolist() if counts else []


def _barrier(comm, group):
    comm.Barrier()
    return [None for _ in group]


_KERNELS = {"allreduce": _allreduce, "reducescatter": _reducescatter, "allgather": _allgather,
            "broadcast": _broadcast, "alltoall": _alltoall, "barrier": _barrier}

"""A DistributedOptimizer's gradients in flat buckets: staged as backward makes them, reduced, handed back.

:class:`GradientBuckets` is what :class:`~ringtrain.torch.DistributedOptimizer`
hands each gradient to. Each gradient gets a slot in a flat staging buffer
(one per device and wire dtype), laid out in the order the ranks agreed on
(the reverse of the root's parameter order: backward's usual order), and the
slots are the arrays a :class:`ringtrain.comm.reducer.Reducer` was built
for. So

* :meth:`GradientBuckets.push` copies a final gradient into its slot (the
  one copy a fusion buffer costs anyway), scales it by the prescale factor
  and pushes the slot; as soon as a bucket's last slot is pushed, the reducer
  starts that bucket's reduction on its communication thread, in place,
  while backward goes on;
* :meth:`GradientBuckets.finish` pushes the slots nobody pushed (zeros for a
  parameter without a gradient on this rank, as Horovod and DDP do: another
  rank may have one), waits for every bucket, scales by the postscale factor
  and hands each result back as ``.grad``.

Aliasing: a result is handed back by making ``.grad`` a view of its slot (as
Horovod's ``grad.set_(output)`` does), so there is no copy back, and a
gradient that backward accumulates into the kept ``.grad`` next step
(``zero_grad(set_to_none=False)``) is already staged: :meth:`push` then
skips the copy but never the prescale.

Staging also takes what the transports cannot: a bfloat16 gradient is staged
as float32, a complex one as its real and imaginary float pairs, a sparse one
dense (``to_sparse`` again on the way back).

Contract (every rank of the communicator): the constructor and
:meth:`finish` are collective, and every rank must build the buckets for
parameters of the same shapes and dtypes in the same order, with the same
op, compression and factors. :func:`match_problem` is that contract as a
pure function over every rank's description, which
:func:`~ringtrain.torch.DistributedOptimizer` gathers before it builds the
buckets: by parameter name when the user named them, else by position.
"""

import torch

from ..comm.buckets import DEFAULT_BUCKET_BYTES, plan_buckets
from ..comm.hooks import allreduce_hook
from ..comm.reducer import Reducer
from .tensors import as_array, sync

__all__ = ["GradientBuckets", "match_problem", "wire_dtype"]

# Gradients whose dtype the transports do not take travel as a wider float.
_WIRE = {torch.bfloat16: torch.float32, torch.complex64: torch.float32, torch.complex128: torch.float64}
_TAKEN = (torch.float16, torch.float32, torch.float64)


def wire_dtype(dtype):
    """The dtype a gradient of ``dtype`` travels as, or None when ringtrain cannot reduce it (pure)."""
    if dtype in _TAKEN:
        return dtype
    return _WIRE.get(dtype)


def _slot_shape(p):
    # A complex gradient travels as its (real, imaginary) pairs: torch.view_as_real's shape.
    return tuple(p.shape) + ((2,) if p.dtype.is_complex else ())


class GradientBuckets:
    """Reduce parameters' gradients in buckets as they become final (see the module docstring).

    Args:
        comm: the communicator (duplicated by each reducer; collective).
        named: ``[(name, parameter)]`` in the order :meth:`push` will usually
            be called (backward's order), the same shapes and dtypes on every rank.
        op: the reducer's op: ``"mean"``, ``"sum"``, ``"min"`` or ``"max"``.
        compression: the reducer's compression: ``None`` or ``"fp16"``.
        prescale, postscale: factors applied to each gradient before and after
            the reduction (Horovod's ``gradient_predivide_factor``), 1.0 for none.
        bucket_bytes: the reducer's largest bucket (None: its default).
    """

    def __init__(self, comm, named, op="mean", compression=None, prescale=1.0, postscale=1.0, bucket_bytes=None):
        self.prescale, self.postscale = prescale, postscale
        self.params = [p for _, p in named]
        self._slot, self._slot_name = {}, {}
        by_device = {}
        for name, p in named:
            by_device.setdefault(p.device, []).append((name, p))
        self.reducers = []
        for device, members in sorted(by_device.items(), key=lambda item: str(item[0])):
            slots = self._make_slots(members, device)
            # The reducer reduces a bucket in place only when it is handed the very arrays it was built for.
            arrays = {name: as_array(slots[id(p)]) for name, p in members}
            # One bucket starts with the last gradient, when backward is over: nothing to overlap, so
            # it is reduced on the caller's thread, without a hand-over to a communication thread.
            # Not with a reducer per device: ranks could then block in different reducers' first buckets.
            single = len(by_device) == 1 and len(plan_buckets(list(arrays.values()),
                                                               bucket_bytes or DEFAULT_BUCKET_BYTES)) == 1
            reducer = Reducer(comm, arrays, allreduce_hook(op, compression=compression), bucket_bytes=bucket_bytes,
                              threaded=False if single else None)
            self.reducers.append(reducer)
            for name, p in members:
                self._slot[p] = (reducer, name, slots[id(p)], arrays[name])
                self._slot_name[p] = name
        self._pushed = set()

    def _make_slots(self, members, device):
        """id(parameter) -> its slot: consecutive views of one flat tensor per wire dtype, in ``members`` order."""
        sizes = {}
        for _, p in members:
            dtype = wire_dtype(p.dtype)
            sizes[dtype] = sizes.get(dtype, 0) + p.numel() * (2 if p.dtype.is_complex else 1)
        flats = {dtype: torch.zeros(total, dtype=dtype, device=device) for dtype, total in sizes.items()}
        offsets = dict.fromkeys(flats, 0)
        slots = {}
        for _, p in members:
            dtype = wire_dtype(p.dtype)
            shape = _slot_shape(p)
            count = p.numel() * (2 if p.dtype.is_complex else 1)
            slots[id(p)] = flats[dtype][offsets[dtype]: offsets[dtype] + count].view(shape)
            offsets[dtype] += count
        return slots

    def started(self):
        """How many buckets have been handed to their reducers since the last :meth:`finish` (all reducers)."""
        count = 0
        for reducer in self.reducers:
            done = {self._slot_name[p] for p in self._pushed if self._slot[p][0] is reducer}
            for bucket in reducer.buckets:  # started strictly in order, each once all its members are in
                if not all(reducer.names[i] in done for i in bucket.indices):
                    break
                count += 1
        return count

    def pushed(self, p):
        """Whether ``p``'s gradient has been pushed since the last :meth:`finish`."""
        return p in self._pushed

    def push(self, p):
        """Stage ``p.grad`` (zeros if it has none) and hand it to its reducer; may start a bucket's reduction."""
        reducer, name, slot, array = self._slot[p]
        with torch.no_grad():
            _stage(p.grad, slot, self.prescale)
        sync([slot])  # the reducer hands the slot to MPI from another thread; torch's copy must be done by then
        self._pushed.add(p)
        reducer.push(name, array)

    def finish(self):
        """Push what is left, wait for every bucket and write each result into its ``.grad`` (collective)."""
        for p in self.params:
            if p not in self._pushed:
                self.push(p)
        self._pushed.clear()
        for reducer in self.reducers:
            reducer.wait()
        with torch.no_grad():
            for p in self.params:
                self._write_back(p, self._slot[p][2])

    def _write_back(self, p, slot):
        """Hand the reduced slot back as ``p.grad``: a view of it where the dtypes allow (see the module docstring)."""
        if self.postscale != 1.0:
            slot.mul_(self.postscale)
        grad = p.grad
        if grad is None:
            p.grad = torch.zeros_like(p)
            grad = p.grad
        if grad.is_sparse:
            p.grad = slot.to(grad.dtype).to_sparse(grad.sparse_dim())
        elif grad.is_complex():
            torch.view_as_real(grad).copy_(slot)
        elif grad.dtype == slot.dtype:
            grad.set_(slot)
        else:
            grad.copy_(slot)

    def close(self):
        """Stop the reducers' threads and free their communicators (collective)."""
        for reducer in self.reducers:
            reducer.close()
        self.reducers = []


def _stage(grad, slot, prescale):
    """Put ``grad`` (None: zeros) into its slot in the wire's form, times ``prescale``."""
    if grad is None:
        slot.zero_()
        return
    if grad.is_sparse:
        slot.copy_(grad.to_dense())
    elif grad.data_ptr() != slot.data_ptr():  # not already the slot: a new .grad, or one of another dtype
        slot.copy_(torch.view_as_real(grad) if grad.is_complex() else grad)
    # Also when backward accumulated straight into the slot: skipping the 1/f here while the f/size
    # after the sum is applied would leave the gradient f times too large.
    if prescale != 1.0:
        slot.mul_(prescale)


_FIELDS = ("shape", "dtype", "device")


def match_problem(records, ranks, by_name):
    """What stops the ranks' gradients from being matched and reduced alike, as one line, or None (pure).

    Args:
        records: one dict per member, in the set's rank order: ``refused``
            (its own argument error, or None), ``reduction`` (op and
            compression by name, predivide factor's ``repr``, so that NaN
            equals NaN) and ``params``
            (``(name, shape, dtype, device type)`` of each trained
            parameter, in its optimizer's order).
        ranks: the members' ranks, for the message.
        by_name: match parameters by name (else by position).
    """
    for rank, record in zip(ranks, records):
        if record["refused"] is not None:
            return f"rank {rank} refused its arguments: {record['refused']}"
    first = records[0]
    for rank, record in zip(ranks[1:], records[1:]):
        for field, a, b in zip(("op", "compression", "gradient_predivide_factor"), first["reduction"],
                               record["reduction"]):
            if a != b:
                return (f"{field} is {a} on rank {ranks[0]} and {b} on rank {rank}; pass the same op, compression "
                        "and gradient_predivide_factor on every rank")
        problem = (_by_name if by_name else _by_position)(first["params"], record["params"], ranks[0], rank)
        if problem is not None:
            return problem
    return None


def _by_name(root, other, root_rank, rank):
    theirs = {name: rest for name, *rest in other}
    mine = {name: rest for name, *rest in root}
    missing = [n for n in mine if n not in theirs] + [n for n in theirs if n not in mine]
    if missing:
        there, absent = (root_rank, rank) if missing[0] in mine else (rank, root_rank)
        return (f"parameter {missing[0]!r} is trained on rank {there} but not on rank {absent}; name the same "
                "trained parameters (requires_grad=True) on every rank")
    for name, *rest in root:
        for field, a, b in zip(_FIELDS, rest, theirs[name]):
            if a != b:
                return (f"parameter {name!r} has {field} {_show(a)} on rank {root_rank} and {_show(b)} on rank "
                        f"{rank}; build the same model on every rank")
    return None


def _by_position(root, other, root_rank, rank):
    if len(root) != len(other):
        return (f"rank {root_rank} trains {len(root)} parameters and rank {rank} {len(other)}; build the same "
                "model and optimizer on every rank")
    for i, ((name, *a), (_, *b)) in enumerate(zip(root, other)):
        for field, x, y in zip(_FIELDS, a, b):
            if x != y:
                return (f"trained parameter {i} ({name} on rank {root_rank}) has {field} {_show(x)} there and "
                        f"{_show(y)} on rank {rank}; pass named_parameters=model.named_parameters() to match "
                        "gradients by name, or list the parameters in the same order on every rank")
    return None


def _show(value):
    return str(value).replace("torch.", "")  # torch.float32 -> float32; shapes as tuples

"""The op layer under the TensorFlow face: Horovod's collectives on NumPy arrays, by plain MPI collectives.

The TensorFlow face (:mod:`ringtrain.tensorflow.mpi_ops`) turns tensors into
arrays and calls only the names here, which are the names of the
framework-neutral engine (``ringtrain.engine``): ``init``, the rank family,
process sets, ``*_async`` ops returning handles, ``synchronize``, ``poll``,
``barrier``, ``join``, ``helper`` and the op constants. Until that engine
serves every face, this module implements them directly, each op a short
exchange on the process set's communicator, run at submit:

* **Negotiation.** Every op starts with one small allgather of what the
  members must agree on (kind, dtype, shape, op, factors, root) and of any
  argument this rank refused. A member that refused raises ``ValueError``;
  every other member raises :class:`CollectiveMismatchError` naming it; ranks
  that disagree all raise :class:`CollectiveMismatchError` naming both
  values. No member is left waiting.
* **Order.** Ops run in the order each rank submits them (names are for the
  messages): every member of a set must make the same calls in the same order.
* **Bounds.** Every exchange runs inside ringtrain's guard
  (``ringtrain.comm.set_timeout``, ``RINGTRAIN_TIMEOUT``): past the bound
  the rank prints which op it waited in and the job is ended. An uncaught
  exception on a rank (after :func:`init`) prints, then ends the job with
  ``MPI_Abort``, so no peer waits for it.

Collective: :func:`init`, :func:`shutdown`, :func:`add_process_set` and
:func:`remove_process_set` on every rank in the same order; every op on every
member of its process set.
"""

import contextlib
import itertools
import sys
import threading

import numpy as np

from ..comm.guard import guard_of
from ..failure import describe

__all__ = ["Average", "Sum", "Adasum", "Min", "Max", "Product", "HorovodInternalError", "CollectiveMismatchError",
           "ProcessSet", "global_process_set", "add_process_set", "remove_process_set", "init", "shutdown",
           "is_initialized", "rank", "size", "local_rank", "local_size", "cross_rank", "cross_size",
           "is_homogeneous", "allreduce_async", "grouped_allreduce_async", "allgather_async",
           "grouped_allgather_async", "broadcast_async", "alltoall_async", "reducescatter_async",
           "grouped_reducescatter_async", "barrier", "join", "poll", "synchronize", "helper", "op_name",
           "alltoall_splits", "scatter_rows", "communicator_of", "process_set_by_id", "call", "default_name"]

# Horovod's values (horovod.common.basics), so a script that stored or compared them keeps working.
Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5
OP_NAMES = {Average: "average", Sum: "sum", Adasum: "adasum", Min: "min", Max: "max", Product: "product"}
NOT_INITIALIZED = "Horovod has not been initialized; use hvd.init()."


class HorovodInternalError(RuntimeError):
    """A collective failed on every rank that took part (Horovod's name for it)."""


class CollectiveMismatchError(HorovodInternalError):
    """Members of a process set submitted an op with different kinds, dtypes, shapes, ops or roots."""


def op_name(op):
    """The name of a reduction op constant (pure); ValueError naming the valid ones."""
    try:
        return OP_NAMES[op]
    except (KeyError, TypeError):
        choices = ", ".join(f"{v} ({k})" for k, v in OP_NAMES.items())
        raise ValueError(f"unknown reduction op {op!r}; choose one of {choices}") from None


class ProcessSet:
    """A set of ranks that collectives can run over (Horovod's ``ProcessSet``).

    Args:
        ranks_or_comm: a list of ranks, or an mpi4py communicator whose ranks
            are all in the runtime's communicator.
    """

    def __init__(self, ranks_or_comm):
        self.process_set_id = None
        self.mpi_comm = None
        if hasattr(ranks_or_comm, "Get_group"):
            self.mpi_comm = ranks_or_comm
            self.ranks = None  # learnt when it is added
        else:
            self.ranks = sorted({int(r) for r in ranks_or_comm})

    def _require(self):
        if _runtime is None:
            raise ValueError(NOT_INITIALIZED)

    def size(self):
        """Number of ranks in the set (None when it is not registered)."""
        self._require()
        return None if self.process_set_id is None else len(self.ranks)

    def rank(self):
        """This rank's place in the set, or -1 when it is not a member (None when it is not registered)."""
        self._require()
        if self.process_set_id is None:
            return None
        return self.ranks.index(rank()) if rank() in self.ranks else -1

    def included(self):
        """True when this rank is a member (None when the set is not registered)."""
        self._require()
        return None if self.process_set_id is None else rank() in self.ranks

    def __eq__(self, other):
        return isinstance(other, ProcessSet) and self.process_set_id == other.process_set_id \
            and self.ranks == other.ranks

    def __hash__(self):
        return hash(self.process_set_id)

    def __str__(self):
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"

    __repr__ = __str__


class _Global(ProcessSet):
    """The set of every rank (id 0): its ranks are the runtime's."""

    def __init__(self):
        super().__init__([])
        self.process_set_id = 0

    @property
    def ranks(self):
        return list(range(size())) if _runtime is not None else []

    @ranks.setter
    def ranks(self, value):
        pass


global_process_set = _Global()


class _Runtime:
    """This process's place in the job and the communicators its sets run over."""

    def __init__(self, comm):
        from ..cluster.topology import TaskSpec, node_layout

        self.comm = comm
        self.spec = TaskSpec.from_mpi(comm)
        _, local = node_layout(self.spec.hosts)
        counts, cross = {}, []
        for lr in local:
            cross.append(counts.get(lr, 0))
            counts[lr] = cross[-1] + 1
        self.cross_rank, self.cross_size = cross[self.spec.rank], counts[local[self.spec.rank]]
        per_host = {}
        for host in self.spec.hosts:
            per_host[host] = per_host.get(host, 0) + 1
        self.homogeneous = len(set(per_host.values())) == 1
        self.comms = {0: comm.Dup()}   # set id -> communicator (None where this rank is not a member)
        self.sets = {0: global_process_set}
        self.next_id = 1
        self.previous_hook = sys.excepthook
        self.helper_comms = {}


_runtime = None


def _current():
    if _runtime is None:
        raise ValueError(NOT_INITIALIZED)
    return _runtime


def init(comm=None, process_sets=None):
    """Start over ``comm`` (default ``MPI.COMM_WORLD``); a second call does nothing (collective)."""
    global _runtime
    if _runtime is not None:
        return
    from mpi4py import MPI

    if comm is not None and not isinstance(comm, MPI.Comm):
        ranks = sorted({int(r) for r in comm})
        sub = MPI.COMM_WORLD.Create(MPI.COMM_WORLD.Get_group().Incl(ranks))
        if sub == MPI.COMM_NULL:
            raise ValueError(f"init(comm={comm!r}): this process is not in the list")
        comm = sub
    _runtime = _Runtime(MPI.COMM_WORLD if comm is None else comm)
    sys.excepthook = _end_job_hook(_runtime.previous_hook)
    for ps in process_sets or []:
        add_process_set(ps)


def _end_job_hook(previous):
    """An uncaught exception prints, then ends the whole job: no peer waits for this rank."""
    def hook(exc_type, exc, tb):
        previous(exc_type, exc, tb)
        runtime = _runtime
        if runtime is not None and runtime.spec.size > 1:
            sys.stderr.write(f"rank {runtime.spec.rank}: {describe(exc)}; ending the job\n")
            sys.stderr.flush()
            runtime.comm.Abort(1)
    return hook


def shutdown():
    """Stop: later ops raise until :func:`init` (never waits for a peer)."""
    global _runtime
    runtime, _runtime = _runtime, None
    if runtime is not None:
        sys.excepthook = runtime.previous_hook
        for ps in runtime.sets.values():
            if ps is not global_process_set:
                ps.process_set_id = None


def is_initialized():
    """True between :func:`init` and :func:`shutdown`."""
    return _runtime is not None


def rank():
    """This process's rank."""
    return _current().spec.rank


def size():
    """Number of ranks."""
    return _current().spec.size


def local_rank():
    """This process's rank among the ranks on its host."""
    return _current().spec.local_rank


def local_size():
    """Number of ranks on this host."""
    return _current().spec.local_size


def cross_rank():
    """This rank's host's place among the ranks with its local rank."""
    return _current().cross_rank


def cross_size():
    """Number of ranks with this rank's local rank: one per host that has one."""
    return _current().cross_size


def is_homogeneous():
    """True when every host runs the same number of ranks."""
    return _current().homogeneous


def add_process_set(process_set):
    """Register a process set (a ProcessSet or a list of ranks) on every rank; return it (collective)."""
    runtime = _current()
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    if ps.process_set_id is not None:
        raise ValueError(f"{ps} is already registered")
    if ps.mpi_comm is not None:
        mine = runtime.comm.Get_rank() if ps.mpi_comm.Get_size() and _in(ps.mpi_comm) else -1
        ps.ranks = sorted(r for r in runtime.comm.allgather(mine) if r >= 0)
    everyone = runtime.comm.allgather(ps.ranks)
    if any(r != ps.ranks for r in everyone):
        raise ValueError(f"add_process_set: the ranks differ across ranks: {everyone}")
    if not ps.ranks or ps.ranks[0] < 0 or ps.ranks[-1] >= runtime.spec.size:
        raise ValueError(f"add_process_set: ranks must lie in 0..{runtime.spec.size - 1}, got {ps.ranks}")
    for other in runtime.sets.values():
        if other.ranks == ps.ranks:
            raise ValueError(f"a process set with ranks {ps.ranks} is already registered ({other})")
    member = runtime.spec.rank in ps.ranks
    sub = runtime.comm.Split(0 if member else 1, runtime.spec.rank)
    ps.process_set_id = runtime.next_id
    runtime.next_id += 1
    runtime.comms[ps.process_set_id] = sub if member else None
    runtime.sets[ps.process_set_id] = ps
    return ps


def _in(comm):
    from mpi4py import MPI

    return comm != MPI.COMM_NULL


def remove_process_set(process_set):
    """Unregister a process set on every rank (collective); False when it was not registered."""
    runtime = _current()
    set_id = process_set.process_set_id
    if set_id in (None, 0) or set_id not in runtime.sets:
        return False
    runtime.comm.Barrier()
    runtime.sets.pop(set_id)
    runtime.comms.pop(set_id, None)
    process_set.process_set_id = None
    return True


def process_set_by_id(set_id):
    """The registered process set of id ``set_id`` (ValueError when there is none)."""
    ps = _current().sets.get(set_id)
    if ps is None:
        raise ValueError(f"process set {set_id} is not registered; call hvd.add_process_set() first")
    return ps


def communicator_of(process_set):
    """The communicator of ``process_set`` for this rank's helpers (ValueError when not a member)."""
    runtime = _current()
    ps = global_process_set if process_set is None else process_set
    comm = runtime.comms.get(ps.process_set_id)
    if ps.process_set_id is None or ps.process_set_id not in runtime.comms:
        raise ValueError(f"{ps} is not registered; call hvd.add_process_set() first")
    if comm is None:
        raise ValueError(f"this rank ({runtime.spec.rank}) is not in {ps}")
    return comm


@contextlib.contextmanager
def helper(label):
    """A context for a helper's plain collectives around the engine (broadcast_variables, the optimizer's)."""
    _current()
    yield


def call(label, process_set, run):
    """``run(comm)`` on every member of the set after the members agree it is ``label`` (collective).

    For helpers made of plain collectives (``broadcast_object``): a member
    that is in another op instead gets a :class:`CollectiveMismatchError`,
    as every member does, rather than pairing its messages with the helper's.
    """
    return synchronize(_submit(label, None, process_set, (("kind", label),), None, lambda comm, _: run(comm)))


# Handles: each op here has finished by the time its handle exists.

_results = {}
_handles = itertools.count(1)


def _register(result=None, error=None):
    handle = next(_handles)
    _results[handle] = (result, error)
    return handle


def poll(handle):
    """True when the op behind ``handle`` has finished (always, here)."""
    if handle not in _results:
        raise ValueError(f"poll: unknown handle {handle!r} (already synchronized?)")
    return True


def synchronize(handle):
    """The output of the op behind ``handle``: an array, a list of them, or (array, splits); raises its error."""
    result, error = _results.pop(handle, (None, None))
    if error is not None:
        raise error
    return result


_local = threading.local()


@contextlib.contextmanager
def default_name(name):
    """Ops submitted without a name in this block (on this thread) take ``name``, and are matched by it."""
    _local.name = name
    try:
        yield
    finally:
        _local.name = None


def _submit(kind, name, process_set, meta, problem, run):
    """Negotiate ``meta`` with the set's members, then ``run(comm)``; a handle to the result or the error.

    A named op (or one in a :func:`default_name` block) must carry the same
    name on every member: ranks that run differently named ops at once get
    a :class:`CollectiveMismatchError` instead of each other's data.
    """
    name = name if name is not None else getattr(_local, "name", None)
    if name is not None:
        meta = (*meta, ("name", str(name)))
    comm = _set_comm(kind, process_set)
    label = f"{kind} {name!r}" if name else kind
    guard = guard_of(comm)
    try:
        return _register(guard.call(label, _negotiated, comm, label, meta, problem, run))
    except (HorovodInternalError, ValueError) as exc:
        return _register(error=exc)


def _set_comm(kind, process_set):
    runtime = _current()
    ps = global_process_set if process_set is None else process_set
    if ps.process_set_id is None or ps.process_set_id not in runtime.comms:
        raise ValueError(f"{kind}: the process set is not registered; call hvd.add_process_set() first")
    comm = runtime.comms[ps.process_set_id]
    if comm is None:
        raise ValueError(f"{kind}: this rank ({runtime.spec.rank}) is not in {ps}")
    return comm


def _negotiated(comm, label, meta, problem, run):
    records = comm.allgather((meta, problem))
    me = comm.Get_rank()
    verdict = mismatch(records, me, label)
    if verdict is not None:
        raise verdict
    return run(comm, [m for m, _ in records])


def mismatch(records, me, label):
    """The error every member raises for these ``(meta, problem)`` records, or None when they agree (pure).

    ``meta`` is a tuple of ``(field, value)`` pairs; a member's own refusal is
    a ``ValueError`` on it and a :class:`CollectiveMismatchError` elsewhere.
    """
    if records[me][1] is not None:
        return ValueError(records[me][1])
    for r, (_, problem) in enumerate(records):
        if problem is not None:
            return CollectiveMismatchError(f"{label}: rank {r} refused it: {problem}")
    first = records[0][0]
    for r, (meta, _) in enumerate(records):
        problem = meta_difference(first, meta)
        if problem is not None:
            return CollectiveMismatchError(f"{label}: ranks disagree on {problem[0]}: rank 0 has {problem[1]!r} "
                                           f"and rank {r} has {problem[2]!r}")
    return None


def meta_difference(first, other):
    """``(field, first's value, other's value)`` where two metas first differ, or None (pure).

    A grouped op's meta holds ``("parts", (meta, ...))``: its parts are compared one by one.
    """
    if len(first) != len(other):
        return "the op", first, other
    for (field, mine), (_, theirs) in zip(first, other):
        if mine == theirs:
            continue
        if field == "parts" and len(mine) == len(theirs):
            for i, (a, b) in enumerate(zip(mine, theirs)):
                inner = meta_difference(a, b)
                if inner is not None:
                    where = inner[0] if len(mine) == 1 else f"tensor {i}'s {inner[0].removeprefix('the ')}"
                    return where, inner[1], inner[2]
        if field == "parts":
            return "the number of tensors", len(mine), len(theirs)
        return f"the {field}", mine, theirs
    return None


# The ops.

def _reduce_meta(kind, array, op, prescale_factor, postscale_factor):
    return (("kind", kind), ("dtype", str(array.dtype)), ("shape", tuple(array.shape)), ("op", op_name(op)),
            ("prescale", float(prescale_factor)), ("postscale", float(postscale_factor)))


def _scale(array, factor):
    """``array * factor`` in Horovod's arithmetic: float64 for integers, float32 for float16, then cast back."""
    if factor == 1.0:
        return array
    if array.dtype.kind in "iub":
        return (array.astype(np.float64) * factor).astype(array.dtype)
    if array.dtype == np.float16:
        return (array.astype(np.float32) * np.float32(factor)).astype(np.float16)
    return (array * np.asarray(factor, array.dtype)).astype(array.dtype)


def _mpi_reduce(comm, array, op):
    """Reduce ``array`` over ``comm`` with a NumPy op, in rank order; a new array (the same on every member)."""
    from mpi4py import MPI

    if op == "sum" and array.dtype.kind in "fiu" and array.dtype.itemsize >= 4 or \
            op in ("min", "max") and array.dtype.kind in "fiu" and array.dtype.itemsize >= 4:
        out = np.empty_like(array)
        comm.Allreduce(np.ascontiguousarray(array), out, op={"sum": MPI.SUM, "min": MPI.MIN, "max": MPI.MAX}[op])
        return out
    gathered = np.empty((comm.Get_size(),) + array.shape, array.dtype)
    comm.Allgather(np.ascontiguousarray(array), gathered)
    if op == "sum":
        wide = gathered.astype(np.float32) if array.dtype == np.float16 else gathered
        return wide.sum(axis=0, dtype=wide.dtype).astype(array.dtype)
    if op == "product":
        return np.prod(gathered, axis=0, dtype=array.dtype)
    return (np.min if op == "min" else np.max)(gathered, axis=0)


def reduce_array(comm, array, op, prescale_factor, postscale_factor):
    """Horovod's allreduce of one array: prescale, reduce (Average: sum then divide), postscale."""
    name = op_name(op)
    if name == "adasum":
        name = "sum"  # Adasum of identical-scale gradients is not served: the sum (documented)
    if name == "average" and array.dtype == np.bool_:
        name = "max"
    reduced = _mpi_reduce(comm, _scale(array, prescale_factor), "sum" if name == "average" else name)
    if name == "average":
        n = comm.Get_size()
        if reduced.dtype.kind in "iu":
            reduced = (reduced.astype(np.float64) / n).astype(reduced.dtype)
        elif reduced.dtype == np.float16:
            reduced = (reduced.astype(np.float32) / n).astype(np.float16)
        else:
            reduced = (reduced / np.asarray(n, reduced.dtype)).astype(reduced.dtype)
    return _scale(reduced, postscale_factor)


def _check(array, kind):
    if not isinstance(array, np.ndarray):
        return f"{kind}: expected a NumPy array, got {type(array).__name__}"
    if array.dtype.kind not in "fiub":
        return f"{kind}: unsupported dtype {array.dtype}"
    return None


def allreduce_async(array, name=None, op=Average, prescale_factor=1.0, postscale_factor=1.0,
                    process_set=global_process_set):
    """Start reducing ``array`` across the set's members into a new array; return a handle."""
    return grouped_allreduce_async([array], name, op, prescale_factor, postscale_factor, process_set,
                                   single=True)


def grouped_allreduce_async(arrays, name=None, op=Average, prescale_factor=1.0, postscale_factor=1.0,
                            process_set=global_process_set, single=False):
    """Start reducing each array into a new one; return one handle (a list)."""
    arrays = list(arrays)
    problem = next((p for p in (_check(a, "allreduce") for a in arrays) if p), None)
    try:
        meta = (("kind", "allreduce"), ("parts", tuple(_reduce_meta("allreduce", a, op, prescale_factor,
                                                                     postscale_factor) for a in arrays)))
    except ValueError as exc:
        meta, problem = (), str(exc)

    def run(comm, _):
        out = [reduce_array(comm, a, op, prescale_factor, postscale_factor) for a in arrays]
        return out[0] if single else out
    return _submit("allreduce", name, process_set, meta, problem, run)


def allgather_async(array, name=None, process_set=global_process_set):
    """Start concatenating every member's ``array`` on the first dimension; return a handle."""
    return grouped_allgather_async([array], name, process_set, single=True)


def grouped_allgather_async(arrays, name=None, process_set=global_process_set, single=False):
    """Start an allgather of each array; return one handle (a list)."""
    arrays = [a.reshape(1) if a.ndim == 0 else a for a in arrays]
    problem = next((p for p in (_check(a, "allgather") for a in arrays) if p), None)
    meta = (("kind", "allgather"), ("parts", tuple((("dtype", str(a.dtype)), ("trailing shape", tuple(a.shape[1:])))
                                                   for a in arrays)))

    def run(comm, _):
        rows = comm.allgather([a.shape[0] for a in arrays])
        out = []
        for i, a in enumerate(arrays):
            counts = [r[i] for r in rows]
            result = np.empty((sum(counts),) + a.shape[1:], a.dtype)
            row = int(np.prod(a.shape[1:], dtype=np.int64)) * a.dtype.itemsize
            comm.Allgatherv(np.ascontiguousarray(a).view(np.uint8).reshape(-1),
                            [result.view(np.uint8).reshape(-1), [c * row for c in counts]])
            out.append(result)
        return out[0] if single else out
    return _submit("allgather", name, process_set, meta, problem, run)


def broadcast_async(array, root_rank, name=None, process_set=global_process_set):
    """Start copying ``root_rank``'s ``array`` to every member, into a new array; return a handle."""
    ps = global_process_set if process_set is None else process_set
    problem = _check(array, "broadcast")
    ranks = list(ps.ranks)
    root = -1
    try:
        root = ranks.index(int(root_rank))
    except (TypeError, ValueError):
        problem = problem or f"broadcast: root_rank {root_rank!r} is not in the process set (ranks {ranks})"
    meta = (("kind", "broadcast"), ("dtype", str(array.dtype)), ("shape", tuple(array.shape)), ("root", root_rank))

    def run(comm, _):
        out = np.array(array, copy=True, order="C")  # (ascontiguousarray would make a 0-d array 1-d)
        comm.Bcast(out.reshape(-1).view(np.uint8), root=root)
        return out
    return _submit("broadcast", name, process_set, meta, problem, run)


def alltoall_splits(rows, splits, nranks):
    """The rows sent to each member, as a list of ints; ValueError naming the problem (pure)."""
    if splits is None:
        if rows % nranks:
            raise ValueError(f"alltoall: the first dimension ({rows}) is not a multiple of the number of ranks "
                             f"({nranks}); pass splits")
        return [rows // nranks] * nranks
    splits = [int(s) for s in np.asarray(splits).reshape(-1)]
    if len(splits) != nranks or any(s < 0 for s in splits):
        raise ValueError(f"alltoall: splits must hold {nranks} counts of at least 0, got {splits}")
    if sum(splits) > rows:
        raise ValueError(f"alltoall: the splits add up to {sum(splits)}, more than the first dimension ({rows})")
    return splits


def alltoall_async(array, splits=None, name=None, process_set=global_process_set):
    """Start sending ``splits[r]`` rows to each member ``r``; ``synchronize`` gives (output, received splits)."""
    ps = global_process_set if process_set is None else process_set
    problem, sent = _check(array, "alltoall"), None
    try:
        sent = alltoall_splits(array.shape[0] if array.ndim else 0, splits, len(ps.ranks))
    except ValueError as exc:
        problem = problem or str(exc)
    meta = (("kind", "alltoall"), ("dtype", str(array.dtype)), ("trailing shape", tuple(array.shape[1:])))

    def run(comm, _):
        received = np.array(comm.alltoall(sent), np.int32)
        row = int(np.prod(array.shape[1:], dtype=np.int64)) * array.dtype.itemsize
        out = np.empty((int(received.sum()),) + array.shape[1:], array.dtype)
        send = np.ascontiguousarray(array).view(np.uint8).reshape(-1)
        comm.Alltoallv([send, [s * row for s in sent]], [out.view(np.uint8).reshape(-1), [int(r) * row
                                                                                           for r in received]])
        return out, received
    return _submit("alltoall", name, process_set, meta, problem, run)


def scatter_rows(rows, nranks):
    """Each member's ``(start, stop)`` rows of a reducescatter: the first ``rows % n`` members one more (pure)."""
    base, extra = divmod(rows, nranks)
    bounds, start = [], 0
    for r in range(nranks):
        stop = start + base + (1 if r < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def reducescatter_async(array, name=None, op=Average, process_set=global_process_set, prescale_factor=1.0,
                        postscale_factor=1.0):
    """Start reducing ``array`` and keeping this member's block of rows; return a handle."""
    return grouped_reducescatter_async([array], name, op, process_set, prescale_factor, postscale_factor,
                                       single=True)


def grouped_reducescatter_async(arrays, name=None, op=Average, process_set=global_process_set,
                                prescale_factor=1.0, postscale_factor=1.0, single=False):
    """Start a reducescatter of each array; return one handle (a list)."""
    arrays = list(arrays)
    problem = next((p for p in (_check(a, "reducescatter") for a in arrays) if p), None)
    if problem is None and any(a.ndim == 0 for a in arrays):
        problem = "reducescatter: a 0-dim tensor has no rows to scatter; reshape it to (1,) or more"
    if problem is None and op not in (Sum, Average):
        problem = f"reducescatter: op must be Sum or Average, got {op!r}"
    meta = (("kind", "reducescatter"), ("parts", tuple(_reduce_meta("reducescatter", a, op if op in OP_NAMES else Sum,
                                                                    prescale_factor, postscale_factor)
                                                       for a in arrays)))

    def run(comm, _):
        out = []
        for a in arrays:
            start, stop = scatter_rows(a.shape[0], comm.Get_size())[comm.Get_rank()]
            out.append(reduce_array(comm, a, op, prescale_factor, postscale_factor)[start:stop].copy())
        return out[0] if single else out
    return _submit("reducescatter", name, process_set, meta, problem, run)


def barrier(process_set=global_process_set):
    """Wait until every member of the set has reached the barrier (collective over the set)."""
    synchronize(_submit("barrier", None, process_set, (("kind", "barrier"),), None, lambda comm, _: None))


def join(device=-1):
    """Declare this rank done; returns the last rank to join, the same on every rank (collective).

    Here every rank waits in ``join`` for the others (the highest rank is
    reported as the last); a rank that submits another op meanwhile gets a
    :class:`CollectiveMismatchError` on every rank instead of a wait.
    """
    handle = _submit("join", None, None, (("kind", "join"),), None, lambda comm, _: comm.Get_size() - 1)
    return synchronize(handle)

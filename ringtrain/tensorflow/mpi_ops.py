"""Horovod's TensorFlow ops: tensors to arrays, the op layer, arrays back; eager, ``tf.function`` and graphs.

Each op turns its tensors into NumPy arrays and hands them to the op layer
(:mod:`ringtrain.tensorflow.collectives`, the engine's names), which runs the
collective; the result comes back as new tensors. The contract, as Horovod's:

* **Eager.** The op runs on the calling thread: ``tensor.numpy()`` (no copy
  on the CPU), the collective, a new tensor.
* **Inside ``tf.function`` and TF1 graphs.** The op is a
  ``tf.numpy_function`` whose output shapes are set as far as they are known
  (an allreduce keeps its input's shape; an allgather knows all but the
  first dimension). Every collective of a graph runs after the one built
  before it (a control dependency), so each rank runs a graph's collectives
  in the order the program wrote them, the order every member must share;
  TensorFlow would otherwise run independent ops in any order, on several
  threads at once, and a rank's blocked threads could wait on ops its peers
  have not reached. In a TF1 graph a fetch therefore also runs the
  collectives built before the ones it needs (their outputs unused). Each
  run of a TF1 graph's collective has a name of its own: the graph's place
  among the graphs this process has built collectives in, the collective's
  place in its graph, and how many times it has run (every rank builds and
  runs the same graphs in the same order), so no run reuses the name of an
  op still in flight from an earlier graph or fetch (a refused op's name is
  in flight until every member has heard of it). An unnamed collective of a
  ``tf.function`` is named by its process set and how many unnamed
  ``tf.function`` collectives of that set this process has run, so a set's
  members match them in the order each runs them, whatever the ranks
  outside the set ran meanwhile. That order is the program's on one thread
  only: collectives in functions that threads run at the same time need
  names (``name=``), as Horovod's do.
* **Gradients.** Registered as Horovod registers them: an allreduce's is the
  same allreduce of the incoming gradient; an allgather's is this rank's rows
  of the averaged gradient; a broadcast's is the averaged gradient on the
  root and zero elsewhere; an alltoall's travels back along the received
  splits; a reducescatter's is the allgather of the incoming gradient, scaled
  as the forward op was.
* **Errors.** Members that disagree (shapes, dtypes, ops, roots) get
  ``tf.errors.FailedPreconditionError`` on every rank, which is also a
  :class:`~ringtrain.tensorflow.collectives.HorovodInternalError`; an
  argument this rank refuses is ``tf.errors.InvalidArgumentError`` here and
  a ``FailedPreconditionError`` on its peers. So in graphs too, where the
  errors are TensorFlow's own classes: there the Python function returns
  the failure, and a stock op raises it (:func:`failure_path`).

Collective: every member of the op's process set must run the same ops in
the same order (see :mod:`ringtrain.tensorflow.collectives`).
"""

import itertools
import math
import weakref

import numpy as np
import tensorflow as tf

from ..engine import runtime as _runtime
from ..failure import GRAPH_FAILURE, GRAPH_SLASH

from . import collectives as engine
from .collectives import (Adasum, Average, Max, Min, Product, ProcessSet, Sum, add_process_set, cross_rank,
                          cross_size, global_process_set, init, is_homogeneous, is_initialized, local_rank,
                          local_size, rank, remove_process_set, shutdown, size)

__all__ = ["init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "cross_rank",
           "cross_size", "is_homogeneous", "ProcessSet", "global_process_set", "add_process_set",
           "remove_process_set", "Average", "Sum", "Adasum", "Min", "Max", "Product", "rank_op", "size_op",
           "local_rank_op", "local_size_op", "process_set_included_op", "allgather", "grouped_allgather",
           "broadcast", "broadcast_", "alltoall", "join", "barrier", "mpi_threads_supported", "mpi_enabled",
           "mpi_built", "gloo_enabled", "gloo_built", "nccl_built", "ddl_built", "ccl_built", "cuda_built",
           "rocm_built", "start_timeline", "stop_timeline", "handle_average_backwards_compatibility",
           "check_num_rank_power_of_2", "allreduce_op", "grouped_allreduce_op", "reducescatter_op",
           "grouped_reducescatter_op", "HorovodMismatchError", "HorovodRefusedError"]

_ALIGN = 64  # the boundary TensorFlow's CPU kernels assume of a tensor's data (EIGEN_MAX_ALIGN_BYTES)
_from_dlpack = tf.experimental.dlpack.from_dlpack


class HorovodMismatchError(tf.errors.FailedPreconditionError, engine.HorovodInternalError):
    """Members of a process set disagreed on an op, or one of them refused it, or the op failed."""

    def __init__(self, message):
        tf.errors.FailedPreconditionError.__init__(self, None, None, message)


class HorovodRefusedError(tf.errors.InvalidArgumentError, ValueError):
    """This rank refused an op on its own arguments (its peers get a :class:`HorovodMismatchError`)."""

    def __init__(self, message):
        tf.errors.InvalidArgumentError.__init__(self, None, None, message)


def _translated(error):
    if isinstance(error, (HorovodMismatchError, HorovodRefusedError)):
        return error
    if isinstance(error, engine.HorovodInternalError):
        return HorovodMismatchError(str(error))
    return HorovodRefusedError(str(error))


def _finish(submit):
    """``synchronize(submit())``, the engine's errors as TensorFlow's (submit may refuse, synchronize fail)."""
    return with_tf_errors(lambda: engine.synchronize(submit()))


def with_tf_errors(call):
    """``call()``, a blocking engine call, its errors as TensorFlow's."""
    try:
        return call()
    except (engine.HorovodInternalError, ValueError) as exc:
        raise _translated(exc) from None


# Running an op: eager, or a numpy_function chained after its graph's previous collective.

_LAST = weakref.WeakKeyDictionary()  # graph -> the last collective op built in it
_COUNTS = weakref.WeakKeyDictionary()  # TF1 graph -> [its index among this process's graphs, collectives built]
_GRAPHS = itertools.count(1)  # TF1 graphs that have had a collective built in them
_RUNS = weakref.WeakKeyDictionary()  # runtime -> {process set id: its unnamed tf.function collectives run so far}


def _graph_function(run, name, dtypes, set_id=0):
    """The numpy_function body: the op layer's ops, named as the face chose (see the module docstring), then
    the path :func:`_checked` reads (``/dev/null`` when the op succeeded; else :func:`failure_path`, and in
    place of outputs of ``dtypes``, empty ones). Unnamed (a tf.function's), its runs are counted with every
    unnamed tf.function collective's on process set ``set_id``."""
    runs = itertools.count(1)
    prefix = name if name is not None else "tf.function" if not set_id else f"tf.function.set{set_id}"

    def body(*arrays):
        arrays = [np.asarray(a) for a in arrays]
        label = f"{prefix}.{next(runs if name is not None else _runs_of(set_id))}"
        with engine.default_name(label):
            try:
                outputs = [np.asarray(a) for a in run(*arrays)]
            except HorovodMismatchError as exc:
                return [np.empty(0, d.as_numpy_dtype) for d in dtypes] + [failure_path(str(exc))]
        return outputs + [_NULL]
    return body


def _runs_of(set_id):
    """The count of this runtime's unnamed tf.function collectives on set ``set_id`` (a new ``init``, after an
    elastic reset, counts afresh on every rank, as a worker that just joined does)."""
    counts = _RUNS.get(_runtime.current())
    if counts is None:
        counts = _RUNS[_runtime.current()] = {}
    return counts.setdefault(set_id, itertools.count(1))


_NULL = np.bytes_(b"/dev/null")  # (a file every Linux has: empty to read, and takes what is written)


def failure_path(message):
    """A path whose read fails with ``FAILED_PRECONDITION`` and ``message`` in the error (pure).

    A graph's Python function cannot fail with a status of its choosing:
    TensorFlow makes the status from the exception's Python class alone
    (``DoCallPyFunc``), so Horovod's ``FailedPreconditionError`` would be an
    ``UnknownError``. Reading a path under ``/dev/null``, a file and not a
    directory, fails with that code (``ENOTDIR``) before any file is opened,
    and TensorFlow's error quotes the path: :data:`ringtrain.failure.GRAPH_FAILURE`,
    then the message as one name. TensorFlow cleans a path before it opens
    it (``..`` taken as text), so a slash in the message, an op's name
    ``a/../../etc/x`` for one, would read another file: each is
    :data:`ringtrain.failure.GRAPH_SLASH` here, a slash again in
    :func:`~ringtrain.failure.describe`. NUL bytes end a path, so they go;
    a message past :data:`_MESSAGE_BYTES` is cut (a longer path fails with
    another code), and ends with an ellipsis.
    """
    raw = message.replace("\0", " ").replace("/", GRAPH_SLASH).encode(errors="replace")
    if len(raw) > _MESSAGE_BYTES:
        raw = raw[:_MESSAGE_BYTES].decode(errors="ignore").encode() + "\u2026".encode()
    return np.bytes_(GRAPH_FAILURE.encode() + raw)


_MESSAGE_BYTES = 3072  # (Linux refuses paths of 4096 bytes and more with ENAMETOOLONG: InvalidArgumentError)


def _checked(outputs, failure):
    """``outputs`` of a graph's collective after a read of ``failure``: ``/dev/null`` (empty) when the op
    succeeded, else :func:`failure_path`, whose read raises ``FailedPreconditionError``.

    What is read is written back to ``/dev/null``: a stateful op that takes
    the read as its input, so the read runs wherever the collective ran.
    Alone, the read (stateless, its value unused) would be made a no-op by
    TensorFlow's graph optimizer, and left out of a ``tf.function`` whose
    result does not need it (a ``join``, a collective whose result the
    function drops). A read every run rather than a ``tf.cond``: a cond's
    branches are functions, and a TF1 graph of many collectives, fetched
    again and again, ran much slower with them.
    """
    with tf.control_dependencies([tf.io.write_file(_NULL, tf.io.read_file(failure))]):
        return [tf.identity(o) for o in outputs]


def _graph_name(graph):
    """The next TF1 collective's name in ``graph``: ``graph-collective.<graph>.<collective>`` (see the docstring)."""
    counts = _COUNTS.get(graph)
    if counts is None:
        counts = _COUNTS[graph] = [next(_GRAPHS), 0]
    counts[1] += 1
    return f"graph-collective.{counts[0]}.{counts[1]}"


def _collective(run, inputs, dtypes, shapes=None, process_set=global_process_set):
    """``run(*arrays) -> [arrays]`` over ``inputs``; a list of tensors of ``dtypes`` (shapes set in graphs)."""
    if tf.executing_eagerly():
        return [tf.convert_to_tensor(a) for a in run(*[np.asarray(t.numpy()) for t in inputs])]
    graph = tf.compat.v1.get_default_graph()
    name = None if getattr(graph, "building_function", False) else _graph_name(graph)
    set_id = (global_process_set if process_set is None else process_set).process_set_id
    previous = _LAST.get(graph)
    with tf.control_dependencies([previous] if previous is not None else []):
        *outputs, failure = tf.numpy_function(_graph_function(run, name, dtypes, set_id), list(inputs),
                                              list(dtypes) + [tf.string], stateful=True, name="HorovodCollective")
        outputs = _checked(outputs, failure)
    _LAST[graph] = outputs[0].op  # (after the check: a fetch of a later collective raises this one's failure)
    for out, shape in zip(outputs, shapes or []):
        if shape is not None:
            out.set_shape(shape)
    return outputs


# Element types the engine does not reduce but which ops that only move bytes can carry, as a same-sized type.
_CARRIED = {np.dtype(np.uint16): np.int16, np.dtype(np.uint32): np.int32, np.dtype(np.uint64): np.int64}


def _carried(array):
    """``array`` as a type the engine takes, for an op that only moves bytes (allgather, broadcast, alltoall)."""
    as_type = _CARRIED.get(array.dtype)
    return array if as_type is None else array.view(as_type)


def _back(result, like):
    """``result`` with ``like``'s element type again (undoing :func:`_carried`)."""
    return result if result.dtype == like.dtype else result.view(like.dtype)


def _tensor(value):
    return value if isinstance(value, tf.Tensor) else tf.convert_to_tensor(value)


def _tail_shape(tensor):
    shape = tensor.shape
    return tf.TensorShape([None]).concatenate(shape[1:]) if shape.rank else tf.TensorShape([None])


try:  # whether a GradientTape is recording now: eagerly, an op nobody differentiates skips the gradient wrapper
    from tensorflow.python.eager.record import could_possibly_record as _tape_active
except ImportError:  # a TensorFlow without the module: always wrap
    def _tape_active():
        return True


def _differentiable(tensors):
    """Whether to register the op's gradient: floating tensors, in a graph or under a recording tape."""
    if not any(t.dtype.is_floating or t.dtype.is_complex for t in tensors):
        return False
    return not tf.executing_eagerly() or _tape_active()


# The eager allreduce of one tensor, the op of an eager loop: straight to the engine and back.

try:  # the type of an eager tensor (making one to learn it would start TensorFlow's runtime at import)
    from tensorflow.python.eager.context import context as _context
    from tensorflow.python.framework.ops import EagerTensor as _EAGER
except ImportError:  # a TensorFlow without them: every op takes the general path
    _EAGER = None
# The element types whose eager tensors are NumPy arrays of the same type (``_numpy()`` views their memory on
# the CPU), by TensorFlow's number for the type (cheaper to read than the DType), and whether they are floating.
_VIEWED = {t.as_datatype_enum: t.is_floating for t in (tf.float16, tf.float32, tf.float64, tf.int8, tf.int16,
                                                       tf.int32, tf.int64, tf.uint8, tf.bool)}


def eager_direct(tensor):
    """Whether :func:`eager_allreduce` may take ``tensor``: eager, of a plain type, with no gradient to record."""
    if type(tensor) is not _EAGER or not tf.executing_eagerly():
        return False
    floating = _VIEWED.get(tensor._datatype_enum())
    return floating is not None and not (floating and _tape_active())


def eager_allreduce(tensor, name, op, prescale_factor, postscale_factor, process_set):
    """``tensor`` (one :func:`eager_direct` accepts) reduced across the set, as a new tensor (collective).

    The same op as :func:`allreduce_op`'s, announced, matched, bounded and
    failed alike, with the least between the caller and the engine: the
    tensor's own memory (``_numpy()``, not ``numpy()``'s copy) as the input,
    a new array as the output (so the engine's cached record of the op and
    its blocking call's lane for a small op are taken), and one tensor made
    from it (on the current device, as ``tf.convert_to_tensor`` makes it). On the
    host that tensor is the array's own memory, handed over by DLPack: making
    a tensor from an array copies it, and costs more than the op's messages.
    """
    array = tensor._numpy()
    if type(array) is not np.ndarray:  # (a scalar's may be a NumPy scalar)
        array = np.asarray(array)
    out = _aligned_empty(array.shape, array.dtype)
    name = engine.name_or_default(name)
    with_tf_errors(lambda: engine.allreduce(array, name, op, prescale_factor, postscale_factor, process_set, out=out))
    device = _context().device_name
    if not device or "device:CPU:" in device:
        return _from_dlpack(out.__dlpack__())  # (nobody else holds out: the tensor owns it from here)
    # What tf.convert_to_tensor does with an array, less its defensive copy.
    return _EAGER(out, device, None)


def _aligned_empty(shape, dtype):
    """An uninitialized C-contiguous array whose data starts on a 64-byte boundary (pure).

    TensorFlow's kernels assume their inputs are aligned so (EIGEN_MAX_ALIGN_BYTES)
    and abort the process on a tensor that is not; NumPy's allocations need
    not be, and a tensor handed over by DLPack is used where it lies.
    """
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + _ALIGN, np.uint8)
    start = -raw.__array_interface__["data"][0] % _ALIGN
    return raw[start:start + nbytes].view(dtype).reshape(shape)


# Allreduce.

def _allreduce_raw(tensors, name, op, prescale_factor, postscale_factor, process_set):
    def run(*arrays):
        name_ = engine.name_or_default(name)
        if len(arrays) == 1:  # a single op: the engine's small-op path (its data travels with the announcement)
            return [_finish(lambda: engine.allreduce_async(arrays[0], name_, op, prescale_factor, postscale_factor,
                                                           process_set))]
        return _finish(lambda: engine.grouped_allreduce_async(arrays, name_, op, prescale_factor, postscale_factor,
                                                              process_set))
    return _collective(run, tensors, [t.dtype for t in tensors], [t.shape for t in tensors], process_set)


def grouped_allreduce_op(tensors, name=None, op=Sum, prescale_factor=1.0, postscale_factor=1.0,
                       ignore_name_scope=False, process_set=global_process_set):
    """Reduce each tensor across the set's members (default: sum) into new tensors; differentiable."""
    tensors = [_tensor(t) for t in tensors]
    if not _differentiable(tensors):
        return _allreduce_raw(tensors, name, op, prescale_factor, postscale_factor, process_set)

    @tf.custom_gradient
    def reduce(*xs):
        out = _allreduce_raw(list(xs), name, op, prescale_factor, postscale_factor, process_set)

        def grad(*dys):
            dys = [tf.cast(dy, x.dtype) for dy, x in zip(dys, xs)]
            return grouped_allreduce_op(dys, None, op, prescale_factor, postscale_factor, process_set=process_set)
        return out, grad
    return list(reduce(*tensors))


def allreduce_op(tensor, name=None, op=Sum, prescale_factor=1.0, postscale_factor=1.0, ignore_name_scope=False,
               process_set=global_process_set):
    """Reduce ``tensor`` across the set's members (default: sum) into a new tensor; differentiable."""
    if eager_direct(tensor):
        return eager_allreduce(tensor, name, op, prescale_factor, postscale_factor, process_set)
    return grouped_allreduce_op([tensor], name, op, prescale_factor, postscale_factor, ignore_name_scope,
                              process_set)[0]


# Allgather.

def _allgather_raw(tensors, name, process_set):
    def run(*arrays):
        out = _finish(lambda: engine.grouped_allgather_async([_carried(a) for a in arrays],
                                                             engine.name_or_default(name), process_set))
        return [_back(o, a) for o, a in zip(out, arrays)]
    return _collective(run, tensors, [t.dtype for t in tensors], [_tail_shape(t) for t in tensors],
                       process_set)


def _my_rows(grad, tensor, process_set):
    """This rank's rows of an allgathered gradient: its first dimension, gathered, gives the offsets."""
    rows = tf.reshape(tf.shape(tensor, out_type=tf.int32)[:1] if tensor.shape.rank != 0 else tf.ones([1], tf.int32),
                      [1])
    everyone = _allgather_raw([rows], None, process_set)[0]
    me = (global_process_set if process_set is None else process_set).rank()
    start = tf.reduce_sum(everyone[:me])
    piece = grad[start:start + everyone[me]]
    return tf.reshape(piece, tf.shape(tensor)) if tensor.shape.rank == 0 else piece


def grouped_allgather(tensors, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Concatenate every member's tensors on the first dimension (which may differ); differentiable."""
    tensors = [_tensor(t) for t in tensors]
    if not _differentiable(tensors):
        return _allgather_raw(tensors, name, process_set)

    @tf.custom_gradient
    def gather(*xs):
        out = _allgather_raw(list(xs), name, process_set)

        def grad(*dys):
            reduced = grouped_allreduce_op([tf.cast(dy, x.dtype) for dy, x in zip(dys, xs)], op=Average,
                                         process_set=process_set)
            return [_my_rows(g, x, process_set) for g, x in zip(reduced, xs)]
        return out, grad
    return list(gather(*tensors))


def allgather(tensor, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Concatenate every member's ``tensor`` on the first dimension (which may differ); differentiable."""
    return grouped_allgather([tensor], name, ignore_name_scope, process_set)[0]


# Broadcast.

def _broadcast_raw(tensor, root_rank, name, process_set):
    def run(array):
        out = _finish(lambda: engine.broadcast_async(_carried(array), root_rank, engine.name_or_default(name),
                                                     process_set))
        return [_back(out, array)]
    return _collective(run, [tensor], [tensor.dtype], [tensor.shape], process_set)[0]


def broadcast(tensor, root_rank, name=None, ignore_name_scope=False, process_set=global_process_set):
    """``root_rank``'s ``tensor`` on every member, in a new tensor; differentiable."""
    tensor = _tensor(tensor)
    if not _differentiable([tensor]):
        return _broadcast_raw(tensor, root_rank, name, process_set)

    @tf.custom_gradient
    def bcast(x):
        def grad(dy):
            reduced = allreduce_op(tf.cast(dy, x.dtype), op=Average, process_set=process_set)
            return reduced if rank() == root_rank else reduced * 0
        return _broadcast_raw(x, root_rank, name, process_set), grad
    return bcast(tensor)


def _read(variable):
    """A variable's value as a tensor: a tf.Variable's ``read_value()``, a Keras 3 Variable's tensor."""
    return variable.read_value() if hasattr(variable, "read_value") else tf.convert_to_tensor(variable)


def broadcast_(variables, root_rank, name=None, process_set=global_process_set):
    """Overwrite each variable with ``root_rank``'s, in place; return their new values (collective).

    Takes ``tf.Variable`` (resource or TF1 reference) and Keras 3 ``Variable`` objects.
    """
    variables = list(variables)
    values = [broadcast(_read(v), root_rank, None if name is None else f"{name}.{i}", process_set=process_set)
              for i, v in enumerate(variables)]
    if tf.executing_eagerly():
        for v, value in zip(variables, values):
            v.assign(value)
        return [_read(v) for v in variables]
    assigns = [v.assign(value) if hasattr(v, "handle") or not hasattr(v, "read_value")
               else tf.compat.v1.assign(v, value) for v, value in zip(variables, values)]
    with tf.control_dependencies([a for a in assigns if a is not None]):
        return [tf.identity(_read(v)) for v in variables]


# Alltoall.

def _alltoall_raw(tensor, splits, name, process_set):
    given = splits is not None

    def run(array, *split_array):
        splits_ = split_array[0].astype(np.int32) if given else None
        out, received = _finish(lambda: engine.alltoall_async(_carried(array), splits_,
                                                              engine.name_or_default(name), process_set))
        return [_back(out, array), np.asarray(received, np.int32)]
    inputs = [tensor] + ([tf.cast(_tensor(splits), tf.int32)] if given else [])
    return _collective(run, inputs, [tensor.dtype, tf.int32], [_tail_shape(tensor), None], process_set)


def alltoall(tensor, splits=None, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Send ``splits[r]`` rows to member ``r``; the rows received (and the received splits when ``splits`` is given).

    Differentiable: the gradient travels back along the received splits.
    """
    tensor = _tensor(tensor)
    if not _differentiable([tensor]):
        output, received = _alltoall_raw(tensor, splits, name, process_set)
    else:
        @tf.custom_gradient
        def exchange(x):
            output, received = _alltoall_raw(x, splits, name, process_set)

            def grad(dy, _unused=None):
                back, _ = _alltoall_raw(tf.cast(dy, x.dtype), received, None, process_set)
                return tf.reshape(back, tf.shape(x))
            return (output, received), grad
        output, received = exchange(tensor)
    return (output, received) if splits is not None else output


# Reducescatter.

def _reducescatter_raw(tensors, name, op, process_set, prescale_factor, postscale_factor):
    def run(*arrays):
        return _finish(lambda: engine.grouped_reducescatter_async(arrays, engine.name_or_default(name), op,
                                                                  process_set, prescale_factor, postscale_factor))
    return _collective(run, tensors, [t.dtype for t in tensors], [_tail_shape(t) for t in tensors],
                       process_set)


def _scatter_grad(dy, op, process_set, prescale_factor, postscale_factor):
    ps = global_process_set if process_set is None else process_set
    factor = (ps.size() if op == Sum else 1) * prescale_factor * postscale_factor
    if factor != 1:
        dy = dy * tf.cast(factor, dy.dtype)
    return allgather(dy, process_set=process_set)


def grouped_reducescatter_op(tensors, name=None, op=Sum, ignore_name_scope=False, process_set=global_process_set,
                           prescale_factor=1.0, postscale_factor=1.0):
    """Reduce each tensor and keep this member's block of rows (the first members one more); differentiable."""
    tensors = [_tensor(t) for t in tensors]
    if not _differentiable(tensors):
        return _reducescatter_raw(tensors, name, op, process_set, prescale_factor, postscale_factor)

    @tf.custom_gradient
    def scatter(*xs):
        out = _reducescatter_raw(list(xs), name, op, process_set, prescale_factor, postscale_factor)

        def grad(*dys):
            return [_scatter_grad(tf.cast(dy, x.dtype), op, process_set, prescale_factor, postscale_factor)
                    for dy, x in zip(dys, xs)]
        return out, grad
    return list(scatter(*tensors))


def reducescatter_op(tensor, name=None, op=Sum, ignore_name_scope=False, process_set=global_process_set,
                   prescale_factor=1.0, postscale_factor=1.0):
    """Reduce ``tensor`` and keep this member's block of rows; differentiable."""
    return grouped_reducescatter_op([tensor], name, op, ignore_name_scope, process_set, prescale_factor,
                                  postscale_factor)[0]


# Join, barrier, and the rank family as ops.

def join():
    """Declare this rank done; the last rank to join, as a scalar tensor, the same on every rank (collective).

    Until every rank has joined, a joined rank adds zeros to the others' allreduces.
    """
    def run():
        return [np.int32(_finish_join())]
    return _collective(run, [], [tf.int32], [tf.TensorShape([])])[0]


def _finish_join():
    try:
        return engine.join()
    except (engine.HorovodInternalError, ValueError) as exc:
        raise _translated(exc) from None


def barrier(process_set=global_process_set):
    """Wait until every member of the set has reached the barrier (collective over the set)."""
    try:
        engine.barrier(process_set)
    except (engine.HorovodInternalError, ValueError) as exc:
        raise _translated(exc) from None


def _set(process_set_id):
    try:
        return engine.process_set_by_id(process_set_id)
    except ValueError as exc:
        raise _translated(exc) from None


def size_op(process_set_id=0, name=None):
    """The number of ranks in the process set, as an int32 scalar tensor."""
    return tf.constant(_set(process_set_id).size(), tf.int32, name=name)


def local_size_op(name=None):
    """The number of ranks on this host, as an int32 scalar tensor."""
    return tf.constant(local_size(), tf.int32, name=name)


def rank_op(name=None):
    """This process's rank, as an int32 scalar tensor."""
    return tf.constant(rank(), tf.int32, name=name)


def local_rank_op(name=None):
    """This process's rank on its host, as an int32 scalar tensor."""
    return tf.constant(local_rank(), tf.int32, name=name)


def process_set_included_op(process_set_id=0, name=None):
    """1 when this rank is in the process set, else 0, as an int32 scalar tensor."""
    return tf.constant(int(bool(_set(process_set_id).included())), tf.int32, name=name)


def handle_average_backwards_compatibility(op, average):
    """The op from Horovod's ``op`` and deprecated ``average`` arguments."""
    if op is not None:
        if average is not None:
            raise ValueError("The op parameter supersedes average. Please provide only one of them.")
        return op
    if average is not None:
        import warnings

        warnings.warn("Parameter `average` has been replaced with `op` and will be removed in v1.0",
                      DeprecationWarning, stacklevel=3)
        return Average if average else Sum
    return Average


def check_num_rank_power_of_2(num_rank):
    """True when ``num_rank`` is a power of two (Horovod's Adasum check)."""
    return num_rank != 0 and (num_rank & (num_rank - 1)) == 0


def mpi_threads_supported():
    """True: MPI is initialised with MPI_THREAD_MULTIPLE (mpi4py's default)."""
    from mpi4py import MPI

    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def mpi_enabled():
    """True: every collective runs over MPI."""
    return True


def mpi_built(verbose=False):
    """True: ringtrain runs over MPI (mpi4py)."""
    return True


def gloo_enabled():
    """False: there is no Gloo controller."""
    return False


# The build flags that do not depend on the face are the engine's own (one answer for every face).
gloo_built, nccl_built, ddl_built, ccl_built = (_runtime.gloo_built, _runtime.nccl_built, _runtime.ddl_built,
                                                _runtime.ccl_built)


def cuda_built(verbose=False):
    """False: the TensorFlow face reduces host memory (GPU tensors go through the host)."""
    return False


def rocm_built(verbose=False):
    """False."""
    return False


def start_timeline(file_path, mark_cycles=False):
    """Accepted for Horovod's API; the TensorFlow face records no timeline."""


def stop_timeline():
    """Accepted for Horovod's API; the TensorFlow face records no timeline."""

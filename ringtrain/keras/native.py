"""``ringtrain.keras`` on Keras 3's torch and JAX backends: Horovod's Keras API over the engine, no TensorFlow.

Horovod never served these backends. Here the gradients, variables and
values are turned into NumPy arrays and reduced by the engine's own ops
(:mod:`ringtrain.engine`), the ops ``ringtrain.torch`` and
``ringtrain.tensorflow`` use, so the three faces share one runtime
(``init``, ranks, process sets, the failure model):

* torch: a CPU gradient is reduced in place through a NumPy view of its
  memory (no copy); a GPU or bfloat16 one through a host copy;
* JAX: ``fit`` runs its train step under ``jax.jit``, where the gradients
  are traced values with no data yet, so the reduction is a host callback
  in the compiled step (``jax.experimental.io_callback``, ordered, so every
  rank runs its collectives in program order). The host round trip is the
  price: the gradients leave the device once per step.

The wrapped optimizer reduces in ``apply`` (which ``apply_gradients``,
``fit``'s train step and JAX's ``stateless_apply`` all go through), in one
grouped allreduce per step, before the wrapped update. Collective: every
rank must step the same optimizer at the same steps, and call the other
collectives here in the same order.
"""

import sys

import keras
import numpy as np

from ..engine import ops
from ..engine.process_sets import ProcessSet, global_process_set
from ..engine.reduce_ops import Adasum, Average, Max, Min, Product, Sum
from ..engine.runtime import (add_process_set, cross_rank, cross_size, init, is_homogeneous, is_initialized,
                              local_rank, local_size, mpi_built, mpi_enabled, mpi_threads_supported, rank,
                              remove_process_set, shutdown, size)

__all__ = ["Adasum", "Average", "Compression", "Max", "Min", "Product", "ProcessSet", "Sum", "add_process_set",
           "barrier", "broadcast_variables", "cross_rank", "cross_size", "global_process_set", "init",
           "is_homogeneous", "is_initialized", "join", "local_rank", "local_size", "mpi_built", "mpi_enabled",
           "mpi_threads_supported", "rank", "remove_process_set", "shutdown", "size", "DistributedOptimizer",
           "broadcast_global_variables", "allreduce", "allgather", "broadcast", "reducescatter", "load_model"]

Callback = keras.callbacks.Callback


def barrier(process_set=global_process_set):
    """Wait until every member of the set has reached the barrier (collective)."""
    ops.barrier(process_set=process_set)


def join():
    """Horovod's ``join``: this rank has no more data; the others' collectives go on without it (collective)."""
    return ops.join()


class _NoCompression:
    """Reduce the gradients as they are."""

    @staticmethod
    def compress(array):
        return array, None

    @staticmethod
    def decompress(array, ctx):
        return array


class _FP16Compression:
    """Reduce floating gradients as float16 (half the bytes on the wire), then cast back."""

    @staticmethod
    def compress(array):
        if array.dtype.kind == "f" and array.dtype != np.float16:
            return array.astype(np.float16), array.dtype
        return array, None

    @staticmethod
    def decompress(array, ctx):
        return array if ctx is None else array.astype(ctx)


class Compression:
    """Horovod's gradient compression: ``Compression.none`` or ``Compression.fp16``."""

    none = _NoCompression
    fp16 = _FP16Compression


def source_key(variable):
    """A hashable key for a Keras variable (Keras 3's ``Variable`` compares by value, so its identity)."""
    return ("object", id(variable))


def sync_state(model):
    """Write JAX ``fit``'s step state back into ``model``'s variables, so a callback reads and assigns them.

    JAX's ``fit`` keeps the variables' values apart from the variables
    during an epoch; after a sync the next step starts from the variables
    again, so what a callback assigns is what trains. A no-op on torch.
    """
    sync = getattr(model, "jax_state_sync", None)
    if sync is not None:
        sync()


def _host(value):
    """``value`` (a tensor, variable, array or number) as a C-contiguous NumPy array this code may write."""
    array = keras.ops.convert_to_numpy(value)
    if not (array.flags.c_contiguous and array.flags.writeable):
        array = np.array(array, order="C")
    return array


def allreduce(value, name=None, average=None, prescale_factor=1.0, postscale_factor=1.0, op=None,
              compression=Compression.none):
    """``value`` (any array-like) reduced across ranks, as a NumPy array (collective)."""
    op = _op(op, average)
    array, ctx = compression.compress(_host(value))
    handle = ops.allreduce_async(array, name=name, op=op, prescale_factor=prescale_factor,
                                 postscale_factor=postscale_factor, out=array)
    return compression.decompress(ops.synchronize(handle), ctx)


def _op(op, average):
    """Horovod's ``average=`` (deprecated) folded into ``op``: Average unless told otherwise."""
    if op is not None and average is not None:
        raise ValueError("The op parameter supersedes average. Please provide only one of them.")
    if op is None:
        return Average if average is None or average else Sum
    return op


def allgather(value, name=None):
    """Every rank's ``value`` concatenated on the first dimension, as a NumPy array (collective)."""
    return ops.synchronize(ops.allgather_async(_host(value), name=name))


def broadcast(value, root_rank, name=None):
    """``root_rank``'s ``value``, as a NumPy array (collective)."""
    array = _host(value)
    return ops.synchronize(ops.broadcast_async(array, root_rank, name=name, out=array))


def reducescatter(value, name=None, op=Average):
    """``value`` reduced across ranks, this rank's block of rows, as a NumPy array (collective)."""
    return ops.synchronize(ops.reducescatter_async(_host(value), name=name, op=op))


def broadcast_variables(variables, root_rank, process_set=global_process_set):
    """Overwrite each Keras variable with ``root_rank``'s value (collective).

    Args:
        variables: the variables, the same shapes and dtypes on every member, in the same order.
        root_rank: the rank whose values everyone gets (a rank of the whole job).
        process_set: broadcast within this process set (default: every rank).
    """
    variables = list(variables)
    arrays = [_host(v.value) for v in variables]
    handles = [ops.broadcast_async(a, root_rank, process_set=process_set, out=a) for a in arrays]
    for variable, handle in zip(variables, handles):
        variable.assign(ops.synchronize(handle))


def broadcast_global_variables(root_rank):
    """Horovod's TF1 graph helper, which has no meaning here (RuntimeError, as Horovod's eager mode raises)."""
    raise RuntimeError("hvd.broadcast_global_variables() does not support eager execution. Please use "
                       "`hvd.broadcast_variables(<model/optimizer variables>)` instead, or "
                       "hvd.callbacks.BroadcastGlobalVariablesCallback(0) in fit's callbacks.")


class GradientReducer:
    """Averages a step's gradients across a process set: one grouped allreduce of NumPy arrays (collective).

    Args:
        name: the op's name (the same on every rank).
        op, prescale_factor, postscale_factor, process_set: as the engine's ``grouped_allreduce_async``.
        compression: ``Compression.none`` or ``Compression.fp16``.
    """

    def __init__(self, name, op, prescale_factor, postscale_factor, process_set, compression):
        self.name, self.op, self.process_set, self.compression = name, op, process_set, compression
        self.scale = (prescale_factor, postscale_factor)

    def arrays(self, arrays):
        """Reduce ``arrays`` (writable, C-contiguous NumPy arrays) in place; return them (collective)."""
        packed = [self.compression.compress(a) for a in arrays]
        wire = [p[0] for p in packed]
        handle = ops.grouped_allreduce_async(wire, name=self.name, op=self.op, prescale_factor=self.scale[0],
                                             postscale_factor=self.scale[1], process_set=self.process_set, out=wire)
        ops.synchronize(handle)
        for array, sent, (_, ctx) in zip(arrays, wire, packed):
            if sent is not array:
                array[...] = self.compression.decompress(sent, ctx)
        return arrays

    def tensors(self, grads):
        """The backend's gradient tensors reduced; torch CPU ones in place through a view of their memory."""
        if keras.backend.backend() == "jax":
            return self._jax(grads)
        return _outside_torch_compile(self._torch)(grads)

    def _torch(self, grads):
        views = [_torch_view(g) for g in grads]
        arrays = [v if v is not None else _host(g) for g, v in zip(grads, views)]
        self.arrays(arrays)
        return [g if v is not None else keras.ops.convert_to_tensor(a, dtype=g.dtype)
                for g, v, a in zip(grads, views, arrays)]

    def _jax(self, grads):
        """Under ``jax.jit`` the gradients have no data yet: the reduction is an ordered host callback in the step."""
        import jax
        from jax.experimental import io_callback

        specs = [jax.ShapeDtypeStruct(g.shape, g.dtype) for g in grads]

        def on_host(arrays):
            reduced = self.arrays([np.array(a, order="C") for a in arrays])
            return [np.asarray(r, dtype=s.dtype) for r, s in zip(reduced, specs)]
        return list(io_callback(on_host, specs, list(grads), ordered=True))


def _outside_torch_compile(fn):
    """``fn`` run as Python even inside ``torch.compile`` (``fit(jit_compile=True)`` on torch): a graph break there.

    Dynamo cannot trace the engine (threads, MPI), so the step's compiled
    graph is cut at the reduction. torch is reached through ``sys.modules``:
    Keras's torch backend has imported it, and only ringtrain.torch imports it.
    """
    torch = sys.modules.get("torch")
    return fn if torch is None else torch.compiler.disable(fn, recursive=True)


def _torch_view(grad):
    """A NumPy array over a torch CPU gradient's memory, or None where there is none to share (GPU, bfloat16)."""
    device = getattr(grad, "device", None)
    if getattr(device, "type", None) != "cpu" or not hasattr(grad, "detach"):
        return None
    try:
        view = grad.detach().numpy()
    except TypeError:  # bfloat16 has no NumPy dtype
        return None
    return view if view.flags.c_contiguous and view.flags.writeable else None


class DistributedKerasOptimizer:
    """What a wrapped Keras 3 optimizer gains (mixed in before its own class; settings in the class's ``_hvd``)."""

    _hvd = None  # (GradientReducer, scale_local_gradients), set on the class made for each wrap

    def register_local_var(self, var):
        """Keep ``var``'s gradient local (not reduced; scaled by 1/size when ``scale_local_gradients``)."""
        self.__dict__.setdefault("_hvd_local", set()).add(source_key(var))

    def apply(self, grads, trainable_variables=None):
        """Average ``grads`` across the process set, then the wrapped update (collective)."""
        variables = self._trainable_variables if trainable_variables is None else list(trainable_variables)
        return super().apply(self._hvd_reduce(list(grads), variables), trainable_variables)

    def _hvd_reduce(self, grads, variables):
        reducer, scale_local = self._hvd
        local = self.__dict__.get("_hvd_local", set())
        keep = [i for i, g in enumerate(grads)
                if g is not None and (i >= len(variables) or source_key(variables[i]) not in local)]
        out = list(grads)
        for i, g in zip(keep, reducer.tensors([grads[i] for i in keep]) if keep else []):
            out[i] = g
        if scale_local and local:
            n = reducer.process_set.size()
            out = [g * (1.0 / n) if g is not None and i not in keep else g for i, g in enumerate(out)]
        return out


def DistributedOptimizer(optimizer, name=None, device_dense="", device_sparse="",  # noqa: N802 - Horovod's name
                         compression=Compression.none, sparse_as_dense=False, gradient_predivide_factor=1.0,
                         op=Average, backward_passes_per_step=1, average_aggregated_gradients=False, num_groups=0,
                         groups=None, process_set=global_process_set, scale_local_gradients=True):
    """A copy of ``optimizer`` (same class and config) that averages gradients across ranks (Horovod's signature).

    ``device_dense``, ``device_sparse``, ``sparse_as_dense``, ``num_groups``
    and ``groups`` are accepted and change nothing: Keras 3's torch and JAX
    gradients are dense, and each step's are reduced in one grouped op.

    Raises:
        NotImplementedError: ``backward_passes_per_step > 1`` or ``op=Adasum``.
        ValueError: ``gradient_predivide_factor`` other than 1 with an op other than Average.
    """
    if backward_passes_per_step > 1:
        raise NotImplementedError("backward_passes_per_step > 1 is not implemented by ringtrain.keras; use the "
                                  "Keras 3 optimizer's own gradient_accumulation_steps")
    if op is Adasum:
        raise NotImplementedError("op=Adasum is not implemented by ringtrain.keras on the torch and jax backends")
    if gradient_predivide_factor != 1.0 and op is not Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    reducer = GradientReducer(name or f"Distributed{type(optimizer).__name__}", op, 1.0 / gradient_predivide_factor,
                              gradient_predivide_factor, process_set, compression)
    base = type(optimizer)
    cls = type(base.__name__, (DistributedKerasOptimizer, base),
               {"__module__": base.__module__, "_hvd": (reducer, scale_local_gradients)})
    return cls.from_config(optimizer.get_config())


def load_model(filepath, custom_optimizers=None, custom_objects=None, compression=Compression.none):
    """Load a saved Keras model; its optimizer, state kept, then averages gradients as :func:`DistributedOptimizer`.

    The optimizer keeps its loaded slots: its class becomes the wrapped
    class (the same class with the averaging mixed in).
    """
    objects = dict(custom_objects or {})
    objects.update({cls.__name__: cls for cls in custom_optimizers or ()})
    model = keras.models.load_model(filepath, custom_objects=objects or None)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and not isinstance(optimizer, DistributedKerasOptimizer):
        wrapped = DistributedOptimizer(optimizer, compression=compression)
        optimizer.__class__ = type(wrapped)  # the loaded state stays; apply() now averages first
    return model

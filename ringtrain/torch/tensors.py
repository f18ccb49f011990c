"""Tensors and the engine's arrays: the views both ways and the stream syncs, in one place.

The engine (:mod:`ringtrain.engine`) works on NumPy and CuPy arrays. A CPU
tensor's ``numpy()`` and a CUDA tensor's DLPack capsule are views of the
same memory, so the face hands the engine views, never copies, and reads
the results where the engine wrote them. bfloat16, which NumPy lacks,
travels as its 16-bit pattern with ``dtype="bfloat16"``.

Before another thread (the engine's) or MPI reads a CUDA tensor, the work
queued on it must land: the stream synced is the current stream *of the
tensor's own device* (:func:`stream_of`), not of the current device, which
on a host with several GPUs may be another.
"""

import numpy as np
import torch

from .. import backend

__all__ = ["SUPPORTED", "check_tensor", "dtype_name", "array_of", "engine_view", "known_view", "tensor_of",
           "stream_of", "sync", "as_array", "as_tensor"]

# What Horovod's torch ops accept.
SUPPORTED = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
             torch.float32, torch.float64, torch.bool)
_SUPPORTED = frozenset(SUPPORTED)


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


def as_array(tensor):
    """A zero-copy view of a tensor's memory: NumPy for a CPU tensor, CuPy (DLPack) for a CUDA one.

    Writing the array writes the tensor. Autograd does not see such writes;
    use it on ``detach()``-ed tensors, parameters' ``.data`` and gradients.

    Raises:
        ValueError: for a tensor on any other device, or a CUDA tensor where CuPy sees no GPU.
    """
    tensor = tensor.detach()
    if tensor.device.type == "cpu":
        return tensor.numpy()
    if tensor.device.type == "cuda":
        # DLPack shares the allocation; CuPy is reached through backend, the one module that imports it.
        return backend.xp_for("gpu").from_dlpack(tensor)
    raise ValueError(f"a tensor on {tensor.device}: ringtrain works with CPU and CUDA tensors")


def as_tensor(array):
    """A zero-copy torch view of a NumPy array (CPU) or a CuPy array (CUDA, through DLPack)."""
    if isinstance(array, np.ndarray):
        return torch.from_numpy(array)
    return torch.from_dlpack(array)


def array_of(tensor):
    """``(array, dtype)``: the engine's view of ``tensor``'s memory, and the element type to announce.

    ``dtype`` is ``"bfloat16"`` for a bfloat16 tensor (viewed as its bits),
    else None (the array's own dtype says it). Strided tensors give strided
    views: the engine reads them and writes through them.
    """
    if tensor.dtype == torch.bfloat16:
        return as_array(tensor.detach().view(torch.int16)), "bfloat16"
    return as_array(tensor), None


def engine_view(tensor):
    """:func:`array_of` a checked tensor, its CUDA work landed first (:func:`sync`): what the engine is handed.

    One function for the common case of one tensor, as cheap as the view
    itself: it runs for every op.
    """
    if tensor.is_cuda:
        stream_of(tensor).synchronize()
    if tensor.dtype == torch.bfloat16:
        return as_array(tensor.detach().view(torch.int16)), "bfloat16"
    if tensor.is_cpu and tensor.is_contiguous():
        return _host_view(tensor), None
    return as_array(tensor), None


def known_view(tensor):
    """The view :func:`engine_view` gave before for this contiguous CPU tensor's memory, or None.

    Only tensors that passed :func:`check_tensor` have views kept (and no
    bfloat16 one), so a view found here needs no check again: the look-up
    every blocking small op starts with.
    """
    if type(tensor) is torch.Tensor and tensor.is_cpu and tensor.is_contiguous():
        return _VIEWS.get((tensor.data_ptr(), tensor.dtype, tensor.shape))
    return None


def _host_view(tensor):
    """The NumPy view of a contiguous CPU tensor, the same array object for the same memory call after call.

    Programs reduce the same tensors step after step, often through a new
    tensor object each time (``p.detach()``), and the layers below keep what
    they prepared for an array (a small call's plan, a window's registration)
    by the array: a new view each call would prepare it all again. A view is
    found by the memory it covers (address, dtype, shape); it holds that
    memory, so no other tensor can be given the address while it is kept.
    """
    key = (tensor.data_ptr(), tensor.dtype, tensor.shape)
    array = _VIEWS.get(key)
    if array is None:
        if len(_VIEWS) >= 256:  # views of tensors since freed must not pile up
            _VIEWS.clear()
        array = _VIEWS[key] = tensor.detach().numpy()
    return array


_VIEWS = {}


def tensor_of(array, dtype=None):
    """The tensor over an array the engine returned (zero-copy), as ``dtype`` (``"bfloat16"``) when given."""
    if dtype == "bfloat16":
        return as_tensor(array.view(np.int16)).view(torch.bfloat16)
    return as_tensor(array)


def stream_of(tensor):
    """The CUDA stream whose queued work must land before ``tensor`` is read elsewhere: its device's current one."""
    return torch.cuda.current_stream(tensor.device)


def sync(tensors):
    """Wait for the work queued on each CUDA tensor's own device (once per device); CPU tensors need none."""
    seen = set()
    for t in tensors:
        if getattr(t, "is_cuda", False) and t.device not in seen:
            seen.add(t.device)
            stream_of(t).synchronize()
    return tensors

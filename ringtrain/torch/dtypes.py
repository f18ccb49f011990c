"""Which tensors the collectives take, and how their memory is seen by NumPy and MPI.

A CPU tensor's memory is handed to MPI as a zero-copy NumPy view
(:func:`host_view`). bfloat16 has no NumPy dtype: it moves as its raw
bytes and is reduced in float32 (:func:`reduces_as`).
"""

import numpy as np
import torch

__all__ = ["SUPPORTED", "RING_DTYPES", "check_tensor", "host_view", "byte_view", "reduces_as", "dtype_name"]

# What Horovod's torch ops accept.
SUPPORTED = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
             torch.float32, torch.float64, torch.bool)
# The dtypes ringtrain's own allreduce (ringtrain.comm) reduces; the rest go to MPI's Allreduce.
RING_DTYPES = (torch.float16, torch.float32, torch.float64, torch.int32, torch.int64)


def dtype_name(dtype):
    """``torch.float32`` -> ``"float32"`` (pure)."""
    return str(dtype).replace("torch.", "")


def check_tensor(tensor, who):
    """Raise ValueError (on this rank, before anything is sent) for a tensor no collective takes."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{who}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in SUPPORTED:
        names = ", ".join(dtype_name(d) for d in SUPPORTED)
        raise ValueError(f"{who}: tensor type {dtype_name(tensor.dtype)} is not supported; use one of {names}")
    if tensor.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{who}: a tensor on {tensor.device}: only CPU and CUDA tensors are supported")
    if tensor.is_sparse:
        raise ValueError(f"{who}: sparse tensors go through sparse_allreduce_async or sparse_as_dense")


def reduces_as(dtype):
    """The dtype a reduction of ``dtype`` runs in: float32 for bfloat16, else itself (pure)."""
    return torch.float32 if dtype == torch.bfloat16 else dtype


def host_view(tensor):
    """A NumPy view of a contiguous CPU tensor of a dtype NumPy has (not bfloat16); writes go through."""
    return tensor.detach().reshape(-1).numpy()


def byte_view(tensor):
    """The raw bytes of a contiguous CPU tensor, as a 1-D uint8 NumPy view (any dtype, 0-dim included)."""
    flat = tensor.detach().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    elif flat.element_size() > 1:
        flat = flat.view(torch.uint8)
    return flat.numpy().view(np.uint8)

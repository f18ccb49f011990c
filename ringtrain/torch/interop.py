"""PyTorch tensors and ringtrain arrays, without copies: views both ways, and gradient averaging.

``torch.Tensor.numpy()`` on a CPU tensor is a view of the same memory, so
ringtrain's collectives can reduce the gradients where PyTorch keeps them.
:func:`as_array` and :func:`as_tensor` are the two directions of that view
(NumPy for CPU tensors; CuPy through DLPack for CUDA tensors), which
:class:`ringtrain.torch.TorchModel` builds on to train any module
through the trainer. It needs torch, as the rest of :mod:`ringtrain.torch`
does; ``import ringtrain`` alone does not load it.

CUDA tensors are reduced through the GPU path (CUDA IPC on one host, a
CUDA-aware MPI or host staging across hosts) after the stream of each
tensor's own device is synchronised (:mod:`ringtrain.torch.tensors`).

Collective: every rank must call :func:`average_gradients_` after the same
backward, for modules of the same architecture, in the same order as every
other ringtrain collective.

Example (five calls, as in Horovod's examples)::

    model = torch.nn.Sequential(...)
    broadcast_parameters_(model)                 # every replica starts from rank 0's weights
    bucket_view_(model)                          # optional: grads in one flat buffer, no fusion copies
    for x, y in batches:
        opt.zero_grad(set_to_none=False)         # keep the gradient tensors (and the bucket view)
        loss_fn(model(x), y).backward()
        average_gradients_(model)                # in place, every rank the same
        opt.step()
"""

import numpy as np

from ..comm import allreduce_, allreduce_many_, broadcast_
from ..comm.state import state_of
from ..comm.guard import collective
from ..backend import contiguous_span
from .tensors import as_array, as_tensor, sync

__all__ = ["average_gradients_", "broadcast_parameters_", "broadcast_tensors_", "bucket_view_", "gradient_arrays",
           "as_array", "as_tensor"]


def _synchronized(tensors):
    """``tensors``, with torch's queued CUDA work on them finished (ringtrain's collectives read them next)."""
    return sync(tensors)


def gradient_arrays(module):
    """Zero-copy views of the module's gradients (NumPy, or CuPy for CUDA), in ``parameters()`` order."""
    return [as_array(p.grad) for p in module.parameters() if p.grad is not None]


def bucket_view_(module):
    """Give every parameter a zeroed gradient that is a view into one flat tensor; return that tensor.

    Like DDP's ``gradient_as_bucket_view``: backward accumulates into the
    views in place, and :func:`average_gradients_` then reduces the whole
    flat buffer with one call and no copies. ``zero_grad(set_to_none=True)``
    (PyTorch's default) drops the views; use ``set_to_none=False``, or call
    this again.
    """
    import torch

    params = [p for p in module.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the module has no parameters that require gradients")
    dtype = params[0].dtype
    device = params[0].device
    if any(p.dtype != dtype or p.device != device for p in params):
        raise ValueError("bucket_view_ needs parameters of one dtype on one device")
    flat = torch.zeros(sum(p.numel() for p in params), dtype=dtype, device=device)
    offset = 0
    for p in params:
        p.grad = flat[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
    return flat


def _one_buffer(tensors):
    """A flat view (NumPy, or CuPy for CUDA) of the memory the tensors tile back to back, in order, or None."""
    import torch

    first = tensors[0]
    storage = first.untyped_storage()
    if any(t.device != first.device or t.untyped_storage().data_ptr() != storage.data_ptr() for t in tensors):
        return None
    # The whole storage as one array: the span must lie inside it.
    whole = as_array(torch.empty(0, dtype=first.dtype, device=first.device).set_(storage))
    return contiguous_span([as_array(t) for t in tensors], within=whole)


@collective("average_gradients_")
def average_gradients_(module, comm=None, op="mean", bucket_bytes=None):
    """Average the module's gradients across the ranks of ``comm``, in place; collective.

    Gradients are matched by parameter, not by position in a list: ranks may
    differ in which parameters received a gradient (a branch taken on one
    rank only). A parameter with a gradient on some rank gets a zero gradient
    where it has none, so the average counts every rank, as Horovod and DDP
    do; a parameter with a gradient on no rank keeps ``grad = None``. Which
    parameters have gradients costs one small allreduce.

    Gradients laid out back to back (see :func:`bucket_view_`) go as one
    in-place allreduce; otherwise :func:`ringtrain.allreduce_many_` fuses
    them.

    Returns:
        ``module``.
    """
    import torch

    params = [p for p in module.parameters() if p.requires_grad]
    has = np.array([p.grad is not None for p in params], np.int32)
    # Every rank must hold the same parameters: a different count is a mismatch on every rank.
    allreduce_(has, op="max", comm=comm)
    for p, anywhere in zip(params, has):
        if anywhere and p.grad is None:
            p.grad = torch.zeros_like(p)
    tensors = _synchronized([p.grad for p, anywhere in zip(params, has) if anywhere])
    flat = _one_buffer(tensors) if tensors else None
    if flat is not None:
        allreduce_(flat, op=op, comm=comm)
    else:
        allreduce_many_([as_array(t) for t in tensors], op=op, comm=comm, bucket_bytes=bucket_bytes)
    return module


@collective("broadcast_parameters_")
def broadcast_parameters_(module, root=0, comm=None):
    """Overwrite every parameter and buffer with ``root``'s, in place, whatever their dtypes; collective."""
    broadcast_tensors_(list(module.parameters()) + list(module.buffers()), root=root, comm=comm)
    return module


@collective("broadcast_tensors_")
def broadcast_tensors_(tensors, root=0, comm=None):
    """Overwrite each tensor with ``root``'s, in place, in one message; collective.

    Any dtype (bool, uint8 and bfloat16 included) and any device: the
    tensors' bytes are packed into one buffer of 64-bit words, each tensor at
    a 16-byte boundary, and broadcast with :func:`ringtrain.broadcast_`,
    whose header check makes ranks with a different total size raise instead
    of hanging. Every rank must pass tensors of the same shapes and dtypes in
    the same order.
    """
    import torch

    tensors = _synchronized(list(tensors))
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        # 16-byte boundaries: every dtype (complex128 included) can be viewed in place at its offset.
        total += -(-t.numel() * t.element_size() // 16) * 16
    words = np.zeros(total // 8, np.int64)
    raw = torch.from_numpy(words.view(np.uint8))
    root_here = state_of(comm).rank == root
    if root_here:
        for t, start in zip(tensors, offsets):
            source = _bytes(t.detach())
            raw[start:start + source.numel()].copy_(source)
    broadcast_(words, root=root, comm=comm)
    if not root_here:
        with torch.no_grad():
            for t, start in zip(tensors, offsets):
                count = t.numel() * t.element_size()
                t.copy_(raw[start:start + count].view(t.dtype).reshape(t.shape))
    return tensors


def _bytes(tensor):
    """A CPU uint8 view (or copy, from a GPU or a strided tensor) of ``tensor``'s bytes."""
    import torch

    flat = tensor.cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat

"""Communication hooks: how the :class:`~ringtrain.comm.reducer.Reducer` reduces one bucket.

As PyTorch DDP's ``ddp_comm_hooks``: the Reducer decides *when* a bucket is
reduced (as soon as backward has filled it), a hook decides *how*. A hook is
a plain function ``hook(state, bucket)`` that reduces ``bucket.buffer`` in
place across ``state.comm`` (:class:`ringtrain.comm.state.CommState`); it is
collective, and every rank's Reducer calls it for the same buckets in the
same order. The two here reduce through the same header-checked path as
:func:`~ringtrain.comm.buckets.allreduce_many_`, so a Reducer gives bitwise
its results::

    Reducer(comm, grads)                                  # allreduce_hook(): the mean, transport "auto"
    Reducer(comm, grads, hook=fp16_compress_hook())       # float16 on the wire, as Horovod's Compression.fp16
    Reducer(comm, grads, hook=allreduce_hook("sum", transport="ring"))

A hook may carry a ``compression`` attribute (None or "fp16"): it goes into
the list's signature, so ranks whose hooks disagree raise instead of
reducing mismatched buckets.
"""

from dataclasses import dataclass

import numpy as np

from .. import backend
from .buckets import reduce_bucket, travels_as_fp16
from .collectives import NO_PROBLEM

__all__ = ["GradBucket", "allreduce_hook", "fp16_compress_hook"]


@dataclass(frozen=True)
class GradBucket:
    """One bucket handed to a hook.

    Attributes:
        index: its place in the Reducer's order (0 first).
        buffer: the 1-D contiguous array to reduce in place (the gradients
            themselves where they are one contiguous run, else a fusion buffer).
        narrays: how many arrays the Reducer reduces in all (for the header check).
        signature: the hash of every shape, dtype and the compression (for the header check).
    """

    index: int
    buffer: object
    narrays: int
    signature: int


def allreduce_hook(op="mean", transport="auto", compression=None):
    """A hook that reduces each bucket with ``op`` through ``transport``, optionally as float16.

    Args:
        op: ``"sum"``, ``"mean"``, ``"min"`` or ``"max"``.
        transport: ``"auto"``, ``"shm"``, ``"ring"``, ``"mpi"`` or ``"hierarchical"``.
        compression: None, or ``"fp16"`` (see :func:`~ringtrain.comm.buckets.allreduce_many_`).
    """
    # Each bucket's float16 wire buffer, made on first use. Keyed by the
    # communicator's state too: one hook may serve several Reducers, each
    # reducing on its own thread and its own duplicate communicator.
    wires = {}

    def hook(state, bucket):
        flat, wire = bucket.buffer, None
        if travels_as_fp16(np.dtype(flat.dtype), compression, state.size):
            key = (id(state), bucket.index, flat.size, backend.device_of(flat))
            wire = wires.get(key)
            if wire is None:
                wire = wires[key] = backend.get_array_module(flat).empty(flat.size, np.float16)
        reduce_bucket(state, "Reducer", flat, wire, op, transport, bucket.narrays, bucket.signature, NO_PROBLEM)

    hook.compression = compression
    return hook


def fp16_compress_hook(op="mean", transport="auto"):
    """:func:`allreduce_hook` with float16 on the wire (DDP's ``fp16_compress_hook``)."""
    return allreduce_hook(op, transport, "fp16")

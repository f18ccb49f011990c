"""The optimizer step split across ranks: reduce-scatter, update my shard, allgather.

After a gradient allreduce every rank holds the whole averaged gradient and
runs the same optimizer update over every parameter: N copies of the same
arithmetic, all competing for one host's memory bandwidth. ZeRO's first
stage (Rajbhandari et al., 2020; PyTorch's ``ZeroRedundancyOptimizer``)
splits that work. The ring allreduce already is a reduce-scatter followed by
an allgather, so stop after the reduce-scatter, let each rank update only the
chunk of the parameters whose gradient it has just reduced, and allgather
the updated parameters instead of the gradients. The bytes moved are the
allreduce's; each rank's update costs 1/N of the whole.

A step (:class:`ShardedStep`) is three collective phases:

1. :meth:`~ShardedStep.reduce_gradients`: reduce-scatter the flat gradient
   buffer and divide this rank's chunk by N (the mean);
2. :meth:`~ShardedStep.sum_small`: sum a few float64 values across ranks,
   the same on every rank (in rank order on the shared-memory window; in
   MPI's order on the other transports): the trainer's step metrics, and a count of ranks whose chunk
   is not finite. No rank sees the whole gradient any more, so a step that
   must be skipped is agreed here, before any rank updates;
3. :meth:`~ShardedStep.update` and :meth:`~ShardedStep.allgather`: update
   the chunk in place with :meth:`ringtrain.optim.Optimizer.step_slice`,
   then allgather the updated parameter chunks.

The phases are a transport's (:mod:`ringtrain.comm.transports.base`), on a duplicate
of the communicator, chosen by the same size policy as the allreduce
(:func:`ringtrain.comm.policy.choose_transport`). So the result is bitwise
that of the allreduce under the same ``transport`` (``op="mean"``) followed
by ``Optimizer.step``, by construction: the allreduce is the same
transport's reduce-scatter and allgather, and the update is elementwise
(tested at 1 to 4 ranks). Over MPI's own collectives it is equal to
rounding: MPI picks its order. On the shared-memory window the model's flat
buffers move into the window (:meth:`ringtrain.comm.transports.shm.WindowTransport.share`),
so the peers read gradients and parameters where backward and the update
wrote them, with no copy. A transport without the two phases (the
hierarchical one) keeps the allreduce.

The optimizer state stays whole on every rank, but only the own chunk of it
advances; :meth:`ShardedStep.gather_state` brings every rank's copy up to
date (the trainer calls it before each checkpoint, so checkpoints are those
of an unsharded run). Memory is not partitioned: for the models ringtrain
trains, the time is what matters.
"""

import warnings

import numpy as np

from .. import backend
from ..comm.cuda_aware import cuda_aware
from ..comm.policy import SMALL_VALUES, transport_choice
from ..comm.state import release, state_of
from ..comm.transports import open_transport
from ..models.base import flat_layout

__all__ = ["ShardedStep", "shardable"]


def shardable(model, opt):
    """Why the step cannot be sharded for ``model`` and ``opt`` on this rank, or None if it can (local).

    The sharded step needs the flat-buffer tier (a
    :class:`~ringtrain.models.FlatModel`, on the CPU or a GPU) and an optimizer
    whose state is laid out in the model's flat order
    (``build_optimizer(..., order=flat_layout(model).order)``).
    """
    layout = flat_layout(model)
    if layout is None:
        return "the model keeps no flat buffers (subclass ringtrain.models.FlatModel)"
    if not opt.flat or tuple(opt.order) != tuple(layout.order):
        return "the optimizer state is not laid out in the model's flat order"
    return None


class ShardedStep:
    """Reduce-scatter, update this rank's chunk, allgather: one data-parallel step.

    Build with :meth:`create` (collective). ``self.start, self.stop`` is the
    range of the flat buffers this rank owns.
    """

    def __init__(self, transport, comm, model, opt):
        self.transport, self.comm, self.model, self.opt = transport, comm, model, opt
        self.size = transport.size
        self.start, self.stop = transport.owned(model.grad_buffer.size)

    @classmethod
    def create(cls, model, opt, comm=None, transport="auto", algorithm=None):
        """A :class:`ShardedStep` for ``model`` and ``opt`` on ``comm``, or None where it does not apply.

        Collective over ``comm`` (default ``MPI.COMM_WORLD``); every rank
        gets the same answer. It applies where :func:`shardable` finds
        nothing on any rank and the transport that ``transport`` picks for
        the gradient (:func:`ringtrain.comm.transports.open_transport`, as
        the allreduce picks it) has both phases and, for GPU buffers, reads
        device memory (CUDA IPC, or a CUDA-aware MPI). On one rank the phases
        do nothing and :meth:`update` is the whole update, so the same loop
        runs at any size. ``algorithm`` is the deprecated name of ``transport``.
        """
        from mpi4py import MPI

        choice = transport_choice(transport, algorithm, "ShardedStep.create")
        comm = comm if comm is not None else MPI.COMM_WORLD
        if not comm.allreduce(int(shardable(model, opt) is None), op=MPI.MIN):
            return None
        gbuf = model.grad_buffer
        device = backend.device_of(gbuf)
        dup = comm.Dup()  # its own messages: never matched with another collective's
        made = open_transport(choice, dup, gbuf.nbytes, device, state_of(comm).one_host,
                              shared_bytes=2 * _aligned(gbuf.nbytes))
        # On a GPU only CUDA IPC or a CUDA-aware MPI reads device memory; every rank must agree on which.
        usable = made is not None and made.two_phase and (
            device is None or made.on_device or comm.allreduce(int(cuda_aware()[0]), op=MPI.MIN))
        if usable and made.name in ("shm", "cuda-ipc"):
            usable = _move_into_window(made, model)
        if not usable:
            if made is not None:
                made.close()
            release(dup)
            return None  # the allreduce serves (staged through the host on a GPU)
        return cls(made, dup, model, opt)

    @property
    def kind(self):
        """The transport's name: "shm", "cuda-ipc", "ring" or "mpi" ("local" on one rank)."""
        return self.transport.name

    def reduce_gradients(self):
        """Phase 1 (collective): this rank's chunk of the mean gradient, a view of the grad buffer.

        The rest of the grad buffer is left partly reduced: only the chunk is meaningful.
        """
        grads = self.model.grad_buffer
        # MPI knows nothing of CUDA streams: backward's kernels must be done before it reads.
        backend.synchronize(grads)
        self.transport.reduce_scatter(grads)
        chunk = grads[self.start:self.stop]
        if self.size > 1:
            backend.get_array_module(chunk).divide(chunk, self.size, out=chunk)
        return chunk

    def sum_small(self, values):
        """Phase 2 (collective): sum the float64 array ``values`` across ranks, in place, the same on every rank."""
        if values.dtype != np.float64 or values.ndim != 1 or values.size > SMALL_VALUES:
            raise ValueError(f"sum_small takes at most {SMALL_VALUES} float64 values, got {values.dtype} "
                             f"{values.shape}")
        return self.transport.sum_small(values)

    def update(self, lr):
        """Update this rank's chunk of the parameters from its chunk of the gradient (local)."""
        a, b = self.start, self.stop
        self.opt.step_slice(self.model.param_buffer[a:b], self.model.grad_buffer[a:b], lr, a, b)

    def allgather(self):
        """Phase 3 (collective): every rank receives every chunk of the updated parameters."""
        backend.synchronize(self.model.param_buffer)  # the update's kernels, before MPI reads the chunk
        self.transport.allgather(self.model.param_buffer)

    def gather_state(self):
        """Bring every rank's copy of the optimizer state up to date from the chunks' owners (collective)."""
        for flat in self.opt.flat_state():
            backend.synchronize(flat)
            self.transport.allgather(flat)

    def close(self):
        """Move the model's buffers back to private memory; release the transport (collective)."""
        if self.transport.name in ("shm", "cuda-ipc"):
            xp = backend.get_array_module(self.model.param_buffer)
            self.model.rebind(xp.empty_like(self.model.param_buffer), xp.empty_like(self.model.grad_buffer))
        self.transport.close()
        release(self.comm)


def _move_into_window(transport, model):
    """Move the model's buffers into the window, where peers read them in place; False if it cannot (collective).

    CUDA IPC maps two model-sized allocations here; where a rank cannot
    (little memory left with many ranks on one GPU), every rank hears it and
    the trainer falls back to the allreduce instead of dying.
    """
    gbuf = model.grad_buffer
    try:
        model.rebind(transport.share(gbuf.size, gbuf.dtype), transport.share(gbuf.size, gbuf.dtype))
    except RuntimeError as exc:  # raised on every rank alike: the mapping's success is agreed collectively
        if transport.rank == 0:
            warnings.warn(f"the sharded step falls back to the allreduce: {exc}", RuntimeWarning, stacklevel=3)
        return False
    return True


def _aligned(nbytes):
    return -(-nbytes // 64) * 64

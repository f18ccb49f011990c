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
2. :meth:`~ShardedStep.sum_small`: sum a few float64 values across ranks in
   rank order: the trainer's step metrics, and a count of ranks whose chunk
   is not finite. No rank sees the whole gradient any more, so a step that
   must be skipped is agreed here, before any rank updates;
3. :meth:`~ShardedStep.update` and :meth:`~ShardedStep.allgather`: update
   the chunk in place with :meth:`ringtrain.optim.Optimizer.step_slice`,
   then allgather the updated parameter chunks.

The result is bitwise that of an allreduce over the same transport
(``algorithm="shm"`` or ``"ring"``, ``op="mean"``) followed by
``Optimizer.step``: each chunk is reduced by the same code in the same order,
divided the same way, and the update is elementwise (tested at 1 to 4 ranks).
Over MPI's own collectives it is equal to rounding: MPI picks the order.

Three transports carry the phases (:func:`transport_for` picks one). Ranks
on one host use their own MPI shared-memory window
(:class:`ringtrain.comm.window.SharedArena`): each rank reads its peers' buffers
directly, each phase is one barrier, and the small sum rides in a header at
the end of each slot. Otherwise the ring's two phases
(:func:`ringtrain.comm.ring.ring_reduce_scatter`, :func:`~ringtrain.comm.ring.ring_allgather`),
or for small gradients MPI's own ``Reduce_scatter`` and ``Allgatherv``, run
on a duplicate communicator, and the small sum is one ``Allreduce``.

The optimizer state stays whole on every rank, but only the own chunk of it
advances; :meth:`ShardedStep.gather_state` brings every rank's copy up to
date (the trainer calls it before each checkpoint, so checkpoints are those
of an unsharded run). Memory is not partitioned: for the models ringtrain
trains, the time is what matters.
"""

import numpy as np

from ..comm.collectives import RING_BYTES, SEGMENT_BYTES
from ..comm.ring import chunk_bounds, ring_allgather, ring_reduce_scatter
from ..comm.window import SINGLE_BLOCK_BYTES, SharedArena

__all__ = ["ShardedStep", "flat_layout", "transport_for", "SMALL_VALUES", "ALGORITHMS"]

ALGORITHMS = ("auto", "ring", "mpi", "shm")  # the --allreduce choices a step can be sharded under
SMALL_VALUES = 16  # float64 values that sum_small can carry
_HEADER_BYTES = SMALL_VALUES * 8


def _address(a):
    return a.__array_interface__["data"][0]


def transport_for(algorithm, nbytes, one_host):
    """The transport for a flat gradient of ``nbytes``: "shm", "ring", "mpi", or None (do not shard).

    As the allreduce chooses (:mod:`ringtrain.comm.collectives`): "auto" takes
    shared memory on one host while the gradient fits one slot, otherwise
    the ring from :data:`~ringtrain.comm.collectives.RING_BYTES` up and MPI's own
    ``Reduce_scatter``/``Allgatherv`` below (latency-bound sizes, where MPI's
    algorithms beat a ring of 2(N-1) steps). "ring", "mpi" and "shm" force
    theirs; "shm" where it cannot apply, and "hierarchical", give None.
    """
    if algorithm not in ALGORITHMS:
        return None
    if algorithm in ("auto", "shm") and one_host and nbytes + _HEADER_BYTES <= SINGLE_BLOCK_BYTES:
        return "shm"
    if algorithm == "shm":
        return None
    if algorithm == "ring" or (algorithm == "auto" and nbytes >= RING_BYTES):
        return "ring"
    return "mpi"


def flat_layout(model):
    """The parameter names in flat-buffer order, or None if the model has no such layout.

    The layout exists when ``model.params`` and ``model.grads`` are views,
    in the same order and at the same offsets, covering the whole of
    ``model.param_buffer`` and ``model.grad_buffer`` (1-D NumPy arrays of one
    dtype), as :class:`ringtrain.models.MLP` lays them out.
    """
    pbuf, gbuf = getattr(model, "param_buffer", None), getattr(model, "grad_buffer", None)
    params, grads = getattr(model, "params", None), getattr(model, "grads", None)
    if not (isinstance(pbuf, np.ndarray) and isinstance(gbuf, np.ndarray) and isinstance(params, dict)
            and isinstance(grads, dict) and list(grads) == list(params) and params):
        return None
    if pbuf.ndim != 1 or pbuf.shape != gbuf.shape or pbuf.dtype != gbuf.dtype:
        return None
    if not (pbuf.flags.c_contiguous and gbuf.flags.c_contiguous):
        return None
    offsets = {}
    for name, p in params.items():
        g = grads[name]
        if not all(isinstance(a, np.ndarray) and a.dtype == pbuf.dtype and a.flags.c_contiguous for a in (p, g)):
            return None
        offset = _address(p) - _address(pbuf)
        if offset != _address(g) - _address(gbuf) or p.shape != g.shape:
            return None
        offsets[name] = offset
    order = sorted(params, key=offsets.get)
    position = 0
    for name in order:
        if offsets[name] != position:
            return None
        position += params[name].nbytes
    return order if position == pbuf.nbytes else None


class ShardedStep:
    """Reduce-scatter, update this rank's chunk, allgather: one data-parallel step.

    Build with :meth:`create` (collective). ``self.start, self.stop`` is the
    range of the flat buffers this rank owns.
    """

    def __init__(self, transport, model, opt):
        self.transport, self.model, self.opt = transport, model, opt
        self.size = transport.size
        self.start, self.stop = transport.owned

    @classmethod
    def create(cls, model, opt, comm=None, algorithm="auto"):
        """A :class:`ShardedStep` for ``model`` and ``opt`` on ``comm``, or None where it does not apply.

        Collective over ``comm`` (default ``MPI.COMM_WORLD``); every rank
        gets the same answer. It applies to a model with a
        :func:`flat_layout` on the CPU and an optimizer whose state is laid
        out in that order (``build_optimizer(..., order=flat_layout(model))``).
        The transport follows ``algorithm`` as :func:`transport_for` says;
        "hierarchical" (and "shm" where it cannot apply) keep the allreduce:
        None. On one rank the phases do nothing and :meth:`update` is the
        whole update, so the same loop runs at any size.

        On shared memory, a model with a ``rebind(param_buffer, grad_buffer)``
        method (:meth:`ringtrain.models.MLP.rebind`) has its buffers moved
        into the window, so peers read them where backward and the update
        wrote them, with no copy; :meth:`close` moves them back out.
        """
        from mpi4py import MPI

        comm = comm if comm is not None else MPI.COMM_WORLD
        if algorithm not in ALGORITHMS:
            return None
        order = flat_layout(model)
        fits = order is not None and getattr(opt, "flat", False) and tuple(opt.order) == tuple(order)
        if not comm.allreduce(int(fits), op=MPI.MIN):
            return None
        gbuf = model.grad_buffer
        if comm.Get_size() == 1:
            return cls(_LocalTransport(gbuf.size), model, opt)
        transport = None
        if transport_for(algorithm, gbuf.nbytes, one_host=True) == "shm":
            rebind = comm.allreduce(int(callable(getattr(model, "rebind", None))), op=MPI.MIN)
            transport = _ShmTransport.create(comm, model, bool(rebind))  # None across hosts
        kind = "shm" if transport is not None else transport_for(algorithm, gbuf.nbytes, one_host=False)
        if kind in ("ring", "mpi"):
            transport = (_RingTransport if kind == "ring" else _MpiTransport)(comm.Dup(), gbuf.size, gbuf.dtype)
        return cls(transport, model, opt) if transport is not None else None

    @property
    def kind(self):
        """"shm", "ring" or "mpi": the transport in use ("local" on one rank)."""
        return self.transport.kind

    def reduce_gradients(self):
        """Phase 1 (collective): this rank's chunk of the mean gradient, a view of the grad buffer.

        The rest of the grad buffer is left partly reduced: only the chunk is meaningful.
        """
        grads = self.model.grad_buffer
        self.transport.reduce_scatter(grads, self.transport.shared_grads)
        chunk = grads[self.start:self.stop]
        if self.size > 1:
            np.divide(chunk, self.size, out=chunk)
        return chunk

    def sum_small(self, values):
        """Phase 2 (collective): sum the float64 array ``values`` across ranks, in place, in rank order."""
        if values.dtype != np.float64 or values.ndim != 1 or values.size > SMALL_VALUES:
            raise ValueError(f"sum_small takes at most {SMALL_VALUES} float64 values, got {values.dtype} "
                             f"{values.shape}")
        self.transport.sum_small(values)
        return values

    def update(self, lr):
        """Update this rank's chunk of the parameters from its chunk of the gradient (local)."""
        a, b = self.start, self.stop
        self.opt.step_slice(self.model.param_buffer[a:b], self.model.grad_buffer[a:b], lr, a, b)

    def allgather(self):
        """Phase 3 (collective): every rank receives every chunk of the updated parameters."""
        self.transport.allgather(self.model.param_buffer, self.transport.shared_params)

    def gather_state(self):
        """Bring every rank's copy of the optimizer state up to date from the chunks' owners (collective)."""
        for flat in self.opt.flat_state():
            self.transport.allgather(flat)

    def close(self):
        """Move the model's buffers back to private memory; release the window or communicator (collective)."""
        self.transport.close(self.model)


class _LocalTransport:
    """One rank: it owns everything, and every phase is nothing."""

    kind = "local"
    size = 1
    shared_params = shared_grads = None

    def __init__(self, n):
        self.owned = (0, n)

    def reduce_scatter(self, x, shared=None):
        pass

    def sum_small(self, values):
        pass

    def allgather(self, x, shared=None):
        pass

    def close(self, model):
        pass


class _ShmTransport:
    """The three phases through a shared-memory window: one barrier each.

    Staged arrays go through each rank's slot. Each call (one phase) uses one
    half of every slot, alternating, and has one barrier: it writes its half
    before the barrier and reads after it. What it overwrites was last read
    two calls back, before the barrier of the call in between, which every
    rank has since passed; so no call needs a closing barrier, and the calls
    may come in any order.

    A model's own buffers, when they live in the window (``shared_params``,
    ``shared_grads``: every rank's buffer), are read by peers in place. Each
    is written only by its owner, and never while a peer may read it: a rank
    writes its gradients (in backward) after the step's last barrier, by
    which time the peers have read them (before the second), and writes its
    parameter chunk (in the update) after the next step's second barrier,
    by which time the peers have copied it (before the next step's first).
    """

    kind = "shm"

    def __init__(self, arena, n):
        self.arena, self.rank, self.size = arena, arena.rank, arena.size
        self.bounds = chunk_bounds(n, self.size)
        self.owned = (self.bounds[self.rank], self.bounds[self.rank + 1])
        self.units = 0
        self.base = 0
        self.shared_params = self.shared_grads = None

    @classmethod
    def create(cls, comm, model, rebind):
        """Collective; None unless every rank shares one host."""
        gbuf = model.grad_buffer
        step = -(-gbuf.nbytes // 64) * 64  # keep the second buffer 64-byte aligned
        arena = SharedArena.create(comm, extra_bytes=2 * step if rebind else 0)
        if arena is None:
            return None
        transport = cls(arena, gbuf.size)
        if rebind:
            def buffers(extra):
                return (extra[:gbuf.nbytes].view(gbuf.dtype), extra[step:step + gbuf.nbytes].view(gbuf.dtype))

            everyone = [buffers(extra) for extra in arena.extras]
            transport.shared_params = [p for p, _ in everyone]
            transport.shared_grads = [g for _, g in everyone]
            model.rebind(*everyone[arena.rank])
        return transport

    def _next_half(self):
        self.base = (self.units % 2) * self.arena.half
        self.units += 1

    def _views(self, dtype, n):
        return [slot[self.base:self.base + n * dtype.itemsize].view(dtype) for slot in self.arena.slots]

    def reduce_scatter(self, x, shared=None):
        self._next_half()
        bounds, rank = self.bounds, self.rank
        views = shared
        if views is None:
            views = self._views(x.dtype, x.size)
            mine = views[rank]
            for owner in range(self.size):  # publish the chunks the peers own
                if owner != rank:
                    mine[bounds[owner]:bounds[owner + 1]] = x[bounds[owner]:bounds[owner + 1]]
        self.arena.sync()
        a, b = self.owned
        chunk = x[a:b]
        for peer in range(self.size):  # the order shm_allreduce uses: bitwise its result
            if peer != rank:
                np.add(chunk, views[peer][a:b], out=chunk)

    def sum_small(self, values):
        self._next_half()
        end = self.base + self.arena.half
        headers = [slot[end - _HEADER_BYTES:end].view(np.float64)[:values.size] for slot in self.arena.slots]
        headers[self.rank][:] = values
        self.arena.sync()
        values[:] = headers[0]
        for header in headers[1:]:
            values += header

    def allgather(self, x, shared=None):
        self._next_half()
        bounds, rank = self.bounds, self.rank
        views = shared
        if views is None:
            views = self._views(x.dtype, x.size)
            a, b = self.owned
            views[rank][a:b] = x[a:b]
        self.arena.sync()
        for owner in range(self.size):
            if owner != rank:
                x[bounds[owner]:bounds[owner + 1]] = views[owner][bounds[owner]:bounds[owner + 1]]

    def close(self, model):
        if self.shared_params is not None:
            model.rebind(np.empty_like(model.param_buffer), np.empty_like(model.grad_buffer))
            self.shared_params = self.shared_grads = None
        self.arena.free()


class _OverMPI:
    """What the ring and MPI transports share: their own communicator and one small Allreduce."""

    shared_params = shared_grads = None  # MPI moves the bytes: nothing is read in place

    def sum_small(self, values):
        from mpi4py import MPI

        self.comm.Allreduce(MPI.IN_PLACE, values, op=MPI.SUM)

    def close(self, model):
        self.comm.Free()


class _RingTransport(_OverMPI):
    """The three phases over MPI: the ring's reduce-scatter and allgather, and one small Allreduce."""

    kind = "ring"

    def __init__(self, comm, n, dtype):
        self.comm, self.rank, self.size = comm, comm.Get_rank(), comm.Get_size()
        self.bounds = chunk_bounds(n, self.size)
        owner = (self.rank + 1) % self.size  # where the ring's reduce-scatter leaves a finished chunk
        self.owned = (self.bounds[owner], self.bounds[owner + 1])
        self.segment = max(1, SEGMENT_BYTES // np.dtype(dtype).itemsize)
        self.stages = (np.empty(self.segment, dtype), np.empty(self.segment, dtype))

    def reduce_scatter(self, x, shared=None):
        ring_reduce_scatter(self.comm, x, np.add, self.stages, self.segment)

    def allgather(self, x, shared=None):
        ring_allgather(self.comm, x, self.bounds)


class _MpiTransport(_OverMPI):
    """The three phases as MPI's own ``Reduce_scatter``, ``Allreduce`` and ``Allgatherv``.

    Rank r owns chunk r. MPI may add in another order than the ring: equal
    to the allreduce's result to rounding, not bitwise.
    """

    kind = "mpi"

    def __init__(self, comm, n, dtype):
        from mpi4py import MPI

        self.MPI, self.comm, self.rank, self.size = MPI, comm, comm.Get_rank(), comm.Get_size()
        self.bounds = chunk_bounds(n, self.size)
        self.owned = (self.bounds[self.rank], self.bounds[self.rank + 1])
        self.counts = [b - a for a, b in zip(self.bounds, self.bounds[1:])]
        self.displs = self.bounds[:-1]
        self.datatype = MPI.Datatype.fromcode(np.dtype(dtype).char)
        self.received = np.empty(self.counts[self.rank], dtype)

    def reduce_scatter(self, x, shared=None):
        self.comm.Reduce_scatter([x, self.datatype], [self.received, self.datatype], self.counts, op=self.MPI.SUM)
        a, b = self.owned
        x[a:b] = self.received

    def allgather(self, x, shared=None):
        self.comm.Allgatherv(self.MPI.IN_PLACE, [x, self.counts, self.displs, self.datatype])

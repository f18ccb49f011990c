"""What ringtrain keeps on one communicator: its transports, buffers and small-call plans.

A :class:`CommState` is cached on each communicator with MPI attribute
caching (:meth:`CommState.of`): the recursive-doubling schedule, the send
and receive buffers of the header exchange (:func:`ringtrain.comm.header.exchange`), the transports made so far
(:meth:`CommState.transport_for`), reused staging buffers (the fusion
buffer, pinned host copies of GPU arrays) and the small-call plans of
:mod:`ringtrain.comm.plans`. They grow to the largest size seen and are
reused, so steady-state calls allocate nothing.

The state lives and dies with its communicator: freeing the communicator
(``comm.Free()``) closes its transports (the shared-memory window among
them). One exception: the persistent requests of 2-rank small-call plans
keep MPI from destroying a freed communicator until they are freed, and
MPI then deletes the state from inside ``MPI_Request_free``, where no other
MPI call may run. So free a communicator ringtrain has used with
:func:`release`, which closes the state first.
"""

import atexit
import weakref

import numpy as np

from .board import Board
from .header import HEADER_BYTES
from .policy import SMALL_BYTES, choose_transport
from .schedule import doubling_schedule
from .transports import create_transport

__all__ = ["CommState", "state_of", "release"]


class CommState:
    """What ringtrain keeps on one communicator: its schedule, transports and reused buffers."""

    _keyval = None  # one MPI attribute key for the process, made on first use

    def __init__(self, comm):
        from mpi4py import MPI

        self.MPI = MPI
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.doubling = doubling_schedule(self.rank, self.size)
        self.cuda_aware = None  # asked on the first GPU array
        self._one_host = None   # asked on the first call that needs it (collective)
        self._board = False     # made on the first header exchange (collective); None across hosts
        self._transports = {}
        self._buffers = {}
        capacity = HEADER_BYTES + SMALL_BYTES
        self.send = np.empty(capacity, np.uint8)
        self.recv = np.empty(capacity, np.uint8)
        self.send_header = self.send[:HEADER_BYTES].view(np.int64)
        self.recv_header = self.recv[:HEADER_BYTES].view(np.int64)
        self.send_bytes, self.recv_bytes = memoryview(self.send), memoryview(self.recv)
        self.header_only = [self.send[:HEADER_BYTES], MPI.BYTE]
        self.heard = [self.recv, MPI.BYTE]
        # Small calls are latency-bound: Python's own overhead is a large part
        # of a 4 KiB call, so packed headers (ringtrain.comm.header.exchange)
        # and buffer views are made once.
        self.packed = {}
        self._views = {}
        # Steady-state plans for small CPU calls (ringtrain.comm.plans.small_plan),
        # keyed on everything the header says; None where no plan applies.
        self.plans = {}
        self.freeing_requests = False
        # Persistent requests must be freed before MPI_Finalize (MPICH warns
        # of them otherwise); Python's atexit handlers run before mpi4py's.
        atexit.register(_drop_plans_at_exit, weakref.ref(self))

    @classmethod
    def of(cls, comm):
        """The state cached on ``comm``, made on first use (Comm attribute caching)."""
        if cls._keyval is None:
            cls._keyval = comm.Create_keyval(delete_fn=_free_state)
        state = comm.Get_attr(cls._keyval)
        if state is None:
            state = cls(comm)
            comm.Set_attr(cls._keyval, state)
        return state

    def one_host(self):
        """Whether every rank of the communicator shares one host (collective on first use)."""
        if self._one_host is None:
            MPI = self.MPI
            node = self.comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
            self._one_host = bool(self.comm.allreduce(int(node.Get_size() == self.size), op=MPI.MIN))
            node.Free()
        return self._one_host

    def board(self):
        """The shared-memory :class:`~ringtrain.comm.board.Board` for header exchanges, or None across hosts.

        Made on the first header exchange, which every rank reaches in the
        same call (collective).
        """
        if self._board is False:
            self._board = Board.create(self.comm) if self.one_host() else None
        return self._board

    def exchange_by_messages(self):
        """Exchange headers by point-to-point messages even on one host, as across hosts.

        For tests and debugging of the across-host protocol on one machine;
        call it on every rank before the communicator's first collective.
        """
        if self._board is not False:
            raise RuntimeError("exchange_by_messages() must come before the communicator's first collective")
        self._board = None

    def payload(self, dtype, count):
        """The view a small call's data goes in before :func:`ringtrain.comm.header.exchange`."""
        board = self.board()
        return board.payload(dtype, count) if board is not None else self.views(dtype, count)[0]

    def transport_for(self, algorithm, nbytes, gpu=False):
        """The transport the size policy picks for ``nbytes`` under ``algorithm``, made on first use.

        Collective on first use of a transport (and of :meth:`one_host`):
        every rank reaches the same call with the same size and algorithm,
        which the header exchange has just checked. None where ``algorithm``
        cannot apply (``"shm"`` across hosts) or the transport cannot serve
        this communicator (CUDA IPC where the ranks cannot map each other's
        memory).
        """
        one_host = self.one_host() if algorithm in ("auto", "shm") else False
        name = choose_transport(algorithm, nbytes, one_host, gpu)
        if name is None:
            return None
        if name not in self._transports:
            # None where it cannot serve this communicator (CUDA IPC refused): kept, not asked again.
            self._transports[name] = create_transport(name, self.comm)
        return self._transports[name]

    def drop_plans(self):
        """Forget the small-call plans and free their persistent requests."""
        plans = [plan for plan in self.plans.values() if plan is not None]
        self.plans.clear()
        # Freeing the last request of a communicator that was already freed
        # destroys it, and MPI runs _free_state from inside Request_free,
        # where another MPI call would deadlock: _free_state checks this flag.
        self.freeing_requests = True
        try:
            for plan in plans:
                plan.free()
        finally:
            self.freeing_requests = False

    def close(self):
        """Close every transport and free the plans (collective: the window's free is).

        Call it before freeing a communicator you made; freeing the
        communicator calls it too, through the attribute's delete callback.
        """
        self.drop_plans()
        transports, self._transports = list(self._transports.values()), {}
        for transport in transports:
            if transport is not None:
                transport.close()
        if self._board:
            board, self._board = self._board, False
            board.close()

    def buffer(self, name, nbytes, xp=np, pinned=False):
        """A reused 1-D uint8 buffer of at least ``nbytes``; grows, never shrinks."""
        key = (name, xp.__name__, pinned)
        buf = self._buffers.get(key)
        if buf is None or buf.size < nbytes:
            size = max(nbytes, 1)
            if pinned:
                memory = xp.cuda.alloc_pinned_memory(size)
                buf = np.frombuffer(memory, np.uint8, size)
            else:
                buf = xp.empty(size, np.uint8)
            self._buffers[key] = buf
        return buf

    def views(self, dtype, count):
        """(payload, message spec, received payload) for ``count`` elements of ``dtype``, cached."""
        key = (dtype, count)
        views = self._views.get(key)
        if views is None:
            if len(self._views) > 1024:
                self._views.clear()
            end = HEADER_BYTES + count * np.dtype(dtype).itemsize
            views = self._views[key] = (self.send[HEADER_BYTES:end].view(dtype),
                                        [self.send[:end], self.MPI.BYTE],
                                        self.recv[HEADER_BYTES:end].view(dtype))
        return views


def state_of(comm):
    """The :class:`CommState` of ``comm`` (default ``MPI.COMM_WORLD``)."""
    if comm is None:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
    return CommState.of(comm)


def release(comm):
    """Close ringtrain's state on ``comm`` (its windows, mappings and plans), then free ``comm`` (collective)."""
    if CommState._keyval is not None:
        state = comm.Get_attr(CommState._keyval)
        if state is not None:
            state.close()
    comm.Free()


def _free_state(comm, keyval, state):
    from mpi4py import MPI

    # At MPI_Finalize the world's attributes are deleted inside MPI itself;
    # freeing windows from there is not allowed, and pointless. Nor from inside
    # Request_free (see CommState.drop_plans): MPI holds its lock there.
    if (state is not None and not state.freeing_requests and not MPI.Is_finalized()
            and comm not in (MPI.COMM_WORLD, MPI.COMM_SELF)):
        state.close()


def _drop_plans_at_exit(ref):
    from mpi4py import MPI

    state = ref()
    if state is not None and state.plans and not MPI.Is_finalized():
        state.drop_plans()

"""What ringtrain keeps on one communicator: its transports, buffers and small-call plans.

A :class:`CommState` is cached on each communicator with MPI attribute
caching (:meth:`CommState.of`): the recursive-doubling schedule, the mailbox
of the header exchange (:class:`ringtrain.comm.exchange.Mailbox`), the transports made so far
(:meth:`CommState.transport_for`, keyed by name and device), reused staging buffers (the fusion
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
from .exchange import Mailbox
from .schedule import doubling_schedule
from .transports import open_transport, same_host

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
        self._transports = {}   # (name, device) -> transport, or None where it cannot serve
        self._buffers = {}
        self.mailbox = Mailbox(MPI)
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
            self._one_host = same_host(self.comm)
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
        return board.payload(dtype, count) if board is not None else self.mailbox.views(dtype, count)[0]

    def transport_for(self, choice, nbytes, device=None):
        """The transport the size policy picks for ``nbytes`` under ``choice`` on ``device``, made on first use.

        Through :func:`ringtrain.comm.transports.open_transport`, cached by
        name and device. Collective on first use of a transport (and of
        :meth:`one_host`): every rank reaches the same call with the same
        size and choice, which the header exchange has just checked. None
        where ``choice`` cannot apply (``"shm"`` across hosts) or the
        transport cannot serve this communicator (CUDA IPC where the ranks
        cannot map each other's memory).
        """
        return open_transport(choice, self.comm, nbytes, device, self.one_host, self._transports)

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

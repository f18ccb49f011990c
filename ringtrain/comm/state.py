"""What ringtrain keeps on one communicator: its transports, buffers and small-call plans.

A :class:`CommState` is cached on each communicator with MPI attribute
caching (:meth:`CommState.of`): the recursive-doubling schedule, the send
and receive buffers of the header exchange (:meth:`CommState.exchange`, the
protocol in :mod:`ringtrain.comm.header`), the transports made so far
(:meth:`CommState.transport_for`), reused staging buffers (the fusion
buffer, pinned host copies of GPU arrays) and the small-call plans of
:mod:`ringtrain.comm.pair`. They grow to the largest size seen and are
reused, so steady-state calls allocate nothing.

The state lives and dies with its communicator: freeing the communicator
(``comm.Free()``) closes its transports (the shared-memory window among
them) and frees the plans' persistent requests.
"""

import atexit
import weakref

import numpy as np

from .header import HEADER, HEADER_BYTES, NFIELDS, TAG
from .policy import SMALL_BYTES, choose_transport
from .schedule import doubling_schedule
from .transports import create_transport

__all__ = ["CommState", "state_of"]


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
        # of a 4 KiB call, so packed headers and buffer views are made once.
        self._packed = {}
        self._views = {}
        # Steady-state plans for small CPU calls at 2 ranks (ringtrain.comm.pair),
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

    def exchange(self, header, payload, combine, out):
        """The header exchange, by recursive doubling, with an optional payload.

        Every rank goes through the same rounds whatever its header says, and
        receives into buffers with room for any header plus the largest small
        payload, so disagreeing calls cannot truncate, overrun or hang. Each
        rank keeps the elementwise minimum of ``[fields, -fields]`` over what
        it has heard; a rank whose minimum still equals its own header heard
        only agreement, and after the last round everyone has heard from
        everyone.

        Args:
            header: ``NFIELDS`` ints.
            payload: the payload view from :meth:`views`, in ``self.send`` after the header,
                holding this rank's data, or None to send the header alone.
            combine: ``f(a, b, out)`` applied lower rank first.
            out: 1-D NumPy array the result is written to.

        Returns:
            ``(lowest, highest)`` field values over all ranks.
        """
        comm, rank = self.comm, self.rank
        mine = self._packed.get(header)
        if mine is None:
            if len(self._packed) > 1024:  # bounded: headers repeat in training loops
                self._packed.clear()
            mine = self._packed[header] = HEADER.pack(*header, *(-v for v in header))
        self.send_bytes[:HEADER_BYTES] = mine
        if payload is None:
            message, theirs = self.header_only, None
        else:
            message, theirs = self.views(payload.dtype, payload.size)[1:]
        heard, received = self.heard, self.recv_bytes[:HEADER_BYTES]
        agreed = True
        last = len(self.doubling) - 1
        for step, (kind, peer) in enumerate(self.doubling):
            if kind == "send":
                comm.Send(message, peer, TAG)
                comm.Recv(heard, peer, TAG)
                agreed = received.tobytes() == mine
                if agreed and payload is not None:
                    out[...] = theirs
                return self._verdict(agreed, self.recv_header)
            if kind == "unfold":
                comm.Send(message, peer, TAG)
                continue
            if kind == "exchange":
                comm.Sendrecv(message, peer, TAG, heard, peer, TAG)
            else:
                comm.Recv(heard, peer, TAG)
            if received.tobytes() != mine:
                agreed = False
                np.minimum(self.send_header, self.recv_header, out=self.send_header)
            if agreed and payload is not None:
                # On the last round (nothing left to pass on) write the result
                # straight to its destination: one copy fewer.
                target = out if step == last else payload
                if peer < rank:
                    combine(theirs, payload, out=target)
                else:
                    combine(payload, theirs, out=target)
        if agreed and payload is not None and (last < 0 or self.doubling[last][0] == "unfold"):
            out[...] = payload
        return self._verdict(agreed, self.send_header)

    def _verdict(self, agreed, header):
        if agreed:
            return None
        values = header.tolist()
        return values[:NFIELDS], [-v for v in values[NFIELDS:]]


def state_of(comm):
    """The :class:`CommState` of ``comm`` (default ``MPI.COMM_WORLD``)."""
    if comm is None:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
    return CommState.of(comm)


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

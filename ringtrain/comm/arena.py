"""Shared memory on one host: each rank's slot in one MPI window, and a barrier of counters.

:class:`SharedArena` is what the shared-memory transport
(:mod:`ringtrain.comm.transports.shm`) and the one-host header board
(:mod:`ringtrain.comm.board`) stand on: every rank holds NumPy views of every
rank's slot, and :meth:`SharedArena.sync` is a barrier six times cheaper than
MPI's, made of per-rank arrival counters in the window itself.
"""

import os

import numpy as np

__all__ = ["SharedArena"]

# Polls of a peer's counter before yielding between polls: the fewest that
# catch a peer arriving within microseconds, without taking the core from a
# late one when ranks outnumber cores; sleeping instead of yielding is much
# slower (docs/performance.md, "The figures behind the size policy and the
# small-call paths").
_SPINS = 30
# A cache line: each rank's arrival counter has one to itself.
_LINE = 64


class SharedArena:
    """Each rank's slot in one MPI shared-memory window, and the ranks' views of all slots.

    Made collectively by :meth:`create` over a communicator whose ranks share
    one host; every rank then holds NumPy views of every rank's slot.
    """

    def __init__(self, comm, node, win, slots, slot_bytes):
        self.comm, self._node, self._win = comm, node, win
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        # Each rank's arrival counter has a cache line of its own, before its slot.
        counters = [slot[:_LINE].view(np.int64)[:1] for slot in slots]
        self._mine = counters[self.rank]
        self._peers = [c for r, c in enumerate(counters) if r != self.rank]
        self._arrivals = 0
        self.slots = [slot[_LINE:_LINE + slot_bytes] for slot in slots]
        self.extras = [slot[_LINE + slot_bytes:] for slot in slots]
        self.half = slot_bytes // 2

    @classmethod
    def create(cls, comm, slot_bytes, extra_bytes=0):
        """The arena for ``comm``, or None unless every rank of ``comm`` shares one host.

        Each rank gets a slot of ``slot_bytes`` (two halves) and, after it,
        ``extra_bytes`` of its own (``self.extras``) for an owner to keep
        arrays that its peers read in place. Collective: every rank of
        ``comm`` must call it with the same sizes; all get the same answer.
        """
        from mpi4py import MPI

        node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
        together = comm.allreduce(int(node.Get_size() == comm.Get_size()), op=MPI.MIN)
        if not together:
            node.Free()
            return None
        # Whole cache lines: MPICH packs the ranks' segments back to back, and
        # each rank's counter must start a line of its own.
        total = -(-(_LINE + slot_bytes + extra_bytes) // _LINE) * _LINE
        win = MPI.Win.Allocate_shared(total, 1, comm=node)
        slots = [np.frombuffer(win.Shared_query(r)[0], np.uint8, total) for r in range(node.Get_size())]
        # One passive-target epoch for the arena's life: Win.Sync then orders
        # each rank's plain loads and stores around the barriers. Opened
        # before the barrier below, while every rank is inside MPI: MPICH
        # may need the peers' progress to grant it, and ranks spinning in
        # sync() make none.
        win.Lock_all()
        slots[node.Get_rank()][:_LINE] = 0
        node.Barrier()  # every counter is zero before anyone counts
        return cls(comm, node, win, slots, slot_bytes)

    def sync(self):
        """Every rank's writes so far are visible to every rank (collective).

        A barrier on counters in the window rather than MPI's: each rank
        counts its arrivals in its own counter and waits until every peer's
        has caught up: several times quicker than ``MPI_Barrier``, which
        small calls feel (figures: docs/performance.md). ``Win.Sync`` is
        MPI's memory barrier: it orders this rank's stores before its
        counter, and the peers' counters before the loads that follow.
        A stalled peer keeps us here as it would in any collective, for the
        watchdog to end.
        """
        self._arrivals += 1
        arrivals = self._arrivals
        self._win.Sync()
        self._mine[0] = arrivals
        for counter in self._peers:
            _wait_for(counter, arrivals, self._node.Iprobe)
        self._win.Sync()

    def free(self):
        """Release the window (collective)."""
        if self._win is not None:
            self._win.Unlock_all()
            self._win.Free()
            self._node.Free()
            self._win = self._node = None


def _wait_for(counter, value, progress):
    """Spin until ``counter[0]`` reaches ``value``; then yield between polls, calling ``progress()``."""
    for _ in range(_SPINS):
        if counter[0] >= value:
            return
    # A peer this late is busy or descheduled. Yielding gives up the core
    # (which, with more ranks than cores, the peer may need) and the GIL
    # (which the thread computing backward beside the reducer's needs).
    # ``progress`` (an Iprobe) lets MPI move anything a peer waits on from
    # us, as its own barrier would.
    while counter[0] < value:
        os.sched_yield()
        progress()

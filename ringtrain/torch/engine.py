"""The background thread every collective of the Horovod API runs on.

Callers submit :class:`Entry` objects and get a handle at once; the thread
runs rounds. In each round it announces the entries submitted since the
last one, gathers every rank's announcements (:meth:`Engine._gather`),
merges them into the same :class:`~ringtrain.torch.negotiation.Table` as
every other rank, and runs the ops every member has now announced, in the
same order on every rank (:mod:`ringtrain.torch.kernels`), small
allreduces fused into one buffer. Ranks may therefore submit named ops in
different orders, and ranks that disagree on an op fail it on every rank
instead of hanging.

This thread is the only caller of MPI for these ops, over its own
duplicate of the runtime's communicator: with ``MPI_THREAD_SERIALIZED``
that is what MPI allows, and with ``MPI_THREAD_MULTIPLE`` the user's own
MPI calls on the original communicator cannot meet its messages.
"""

import contextlib
import os
import pickle
import threading

import numpy as np

from ..comm import allreduce_, release
from . import handles, kernels
from .errors import CollectiveMismatchError, DuplicateNameError, HorovodInternalError
from .negotiation import JOIN, SHUTDOWN, Table

__all__ = ["Entry", "Engine", "FUSION_BYTES"]

# Horovod's default fusion buffer (HOROVOD_FUSION_THRESHOLD); the same variable sets it here.
FUSION_BYTES = int(os.environ.get("HOROVOD_FUSION_THRESHOLD", 64 << 20))
# While ops wait on a late rank, empty rounds run at most this often: a round
# is a small collective, and a tight loop of them would take a core from the
# training it waits on (Horovod's cycle time, HOROVOD_CYCLE_TIME, is 1 ms too).
# Room for one rank's announcements of a round (about 40 small ops) in the gather.
SLOT_BYTES = 4096
IDLE_ROUND_S = float(os.environ.get("HOROVOD_CYCLE_TIME", 1.0)) / 1000.0


class Entry:
    """One submitted op: what is announced (``meta``, ``info``), and what the kernel needs (``args``)."""

    __slots__ = ("name", "process_set", "kind", "meta", "info", "args", "pending")

    def __init__(self, name, process_set, kind, meta, info, args, pending):
        self.name, self.process_set, self.kind = name, process_set, kind
        self.meta, self.info, self.args, self.pending = meta, info, args, pending


class Engine:
    """The background thread, its queue and its names in flight (one per :class:`~ringtrain.torch.runtime.Runtime`)."""

    def __init__(self, runtime):
        self.runtime = runtime
        # Collective over the runtime's communicator: init() runs it on every rank.
        self.comm = runtime.comm.Dup()
        self.size, self.rank = self.comm.Get_size(), self.comm.Get_rank()
        self.timeline = None       # a ringtrain Timeline while start_timeline is on
        self.timeline_path = None
        self._cond = threading.Condition()
        self._queue = []
        self._in_flight = set()
        self._mine = {}
        self._table = Table(self._members)
        self._busy = False
        self._stopped = False
        self._failure = None
        self._names = {}
        self._exchange = Announcer(self.comm)
        self._thread = threading.Thread(target=self._main, name="ringtrain-hvd", daemon=True)
        self._thread.start()

    # The caller's side.

    def auto_name(self, kind):
        """``"<kind>.noname.<n>"``: every rank making the same unnamed calls in order names them alike."""
        n = self._names.get(kind, 0)
        self._names[kind] = n + 1
        return f"{kind}.noname.{n}"

    def submit(self, entry):
        """Queue ``entry``; ValueError if its name is in flight on this rank."""
        key = (entry.process_set, entry.name)
        with self._cond:
            if self._failure is not None:
                raise HorovodInternalError(f"the background thread has stopped: {self._failure}")
            if self._stopped:
                raise HorovodInternalError("ringtrain.torch has been shut down; call init() again")
            if key in self._in_flight:
                raise DuplicateNameError(f"an op named {entry.name!r} is already in flight on this rank; "
                                         "wait for it (synchronize) or use another name")
            self._in_flight.add(key)
            self._queue.append(entry)
            self._cond.notify()

    def stop(self, timeout=30.0):
        """Announce shutdown and wait for the thread; every rank must call it (collective)."""
        with self._cond:
            if not self._thread.is_alive():
                return
            self._queue.append(Entry(SHUTDOWN, 0, "shutdown", (("kind", "shutdown"),), None, None, None))
            self._cond.notify()
        self._thread.join(timeout)

    # The thread's side.

    def _members(self, process_set):
        if process_set == 0:
            return range(self.size)
        return self.runtime.extras["process_sets"].ranks_of(process_set)

    def _take(self):
        """The entries submitted since the last round; waits when there is nothing to announce."""
        with self._cond:
            if not self._queue:
                if not len(self._table):
                    while not self._queue:  # nothing anywhere: sleep until this rank submits
                        self._cond.wait()
                elif not self._busy:
                    self._cond.wait(IDLE_ROUND_S)
            new, self._queue = self._queue, []
        return new

    def _main(self):
        try:
            while not self._stopped:
                new = self._take()
                for entry in new:
                    self._mine[(entry.process_set, entry.name)] = entry
                everyone = self._exchange.gather([(e.name, e.process_set, e.meta, e.info) for e in new])
                ready = self._table.merge(everyone)
                self._busy = any(everyone)
                self._run(ready)
        except BaseException as exc:  # noqa: BLE001 - every waiting caller must hear of it
            self._fail_all(exc)
            return
        release(self.comm)

    def _run(self, ready):
        """Run the ready ops in order, fusing runs of compatible reductions."""
        i = 0
        while i < len(ready):
            op = ready[i]
            i += 1
            if op.name == SHUTDOWN:
                self._stopped = True
                continue
            entry = self._entry_for(op)
            if entry is None:
                continue  # an op of a process set this rank is not in, or one it cannot join in
            problem = _problem(op, entry)
            if problem is not None:
                entry.pending.fail(problem)
                continue
            if op.name == JOIN:
                entry.pending.succeed(op.last_joined)
                continue
            group = [(op, entry)]
            if entry.kind in kernels.FUSABLE:
                key, total = kernels.fuse_key(op.meta), kernels.nbytes(op.meta)
                while (i < len(ready) and ready[i].mismatch is None and ready[i].name != SHUTDOWN
                       and ready[i].process_set == op.process_set and kernels.fuse_key(ready[i].meta) == key
                       and total + kernels.nbytes(ready[i].meta) <= FUSION_BYTES):
                    total += kernels.nbytes(ready[i].meta)
                    group.append((ready[i], self._entry_for(ready[i])))
                    i += 1
            self._execute(group)

    def _entry_for(self, op):
        """This rank's entry for ``op``; a stand-in adding zeros if this rank has joined instead; else None."""
        key = (op.process_set, op.name)
        entry = self._mine.pop(key, None)
        if entry is not None:
            with self._cond:
                self._in_flight.discard(key)
            return entry
        if self.rank in op.joined and dict(op.meta)["kind"] == "allreduce" and op.mismatch is None:
            zeros = kernels.zeros_like_meta(op.meta)
            return Entry(op.name, op.process_set, "allreduce", op.meta, None, (zeros, zeros), handles.Pending())
        return None

    def _execute(self, group):
        op, entry = group[0]
        comm = self.comm if op.process_set == 0 else self.runtime.extras["process_sets"].comm_of(op.process_set)
        # Horovod's timeline has a row per op; here each fused run is one bar on the engine's row.
        label = f"{entry.kind} {op.name}" + (f" (+{len(group) - 1} fused)" if len(group) > 1 else "")
        span = self.timeline.span(label, tid=1) if self.timeline is not None else contextlib.nullcontext()
        try:
            with span:
                results = kernels.run(entry.kind, comm, group)
        except Exception as exc:  # noqa: BLE001 - the caller gets it from synchronize
            error = exc if isinstance(exc, RuntimeError) else HorovodInternalError(f"{type(exc).__name__}: {exc}")
            for _, e in group:
                e.pending.fail(error)
            return
        for (_, e), result in zip(group, results):
            e.pending.succeed(result)

    def _fail_all(self, exc):
        with self._cond:
            self._failure = exc
            entries = list(self._mine.values()) + self._queue
            self._mine, self._queue = {}, []
            self._in_flight.clear()
        for e in entries:
            if e.pending is not None:
                e.pending.fail(HorovodInternalError(f"the background thread failed: {type(exc).__name__}: {exc}"))


class Announcer:
    """The exchange of a round's announcements: every rank's list, on every rank."""

    def __init__(self, comm):
        self.comm = comm
        self.size, self.rank = comm.Get_size(), comm.Get_rank()
        self._slots = np.zeros((self.size, SLOT_BYTES // 8), np.int64)

    def gather(self, announced):
        """Every rank's announcements, indexed by rank (collective over the engine's communicator).

        One small allreduce through ringtrain's comm layer (on one host, the
        shared-memory board: tens of microseconds where MPI's own Allgather
        takes a millisecond on a busy machine): each rank writes its pickled
        list in its own slot of zeros and the sum is everyone's lists. A list
        too long for its slot is sent again, by every rank, with MPI's
        allgather.
        """
        if self.size == 1:
            return [announced]
        data = pickle.dumps(announced, protocol=pickle.HIGHEST_PROTOCOL) if announced else b""
        slots = self._slots
        slots[...] = 0
        mine = slots[self.rank]
        if len(data) <= SLOT_BYTES - 8:
            mine[0] = len(data)
            mine[1:].view(np.uint8)[:len(data)] = np.frombuffer(data, np.uint8)
        else:
            mine[0] = -1
        allreduce_(slots, op="sum", comm=self.comm)
        lengths = slots[:, 0].tolist()
        if min(lengths) < 0:
            return self.comm.allgather(announced)
        return [pickle.loads(slots[r, 1:].view(np.uint8)[:n].tobytes()) if n else [] for r, n in enumerate(lengths)]


def _problem(op, entry):
    """The error every rank's entry for ``op`` fails with (ranks disagreed, or some joined), or None."""
    if op.mismatch is not None:
        return CollectiveMismatchError(f"{entry.kind} {op.name!r}: ranks submitted different {op.mismatch}; every "
                                       "rank must submit the same op under one name")
    if op.joined and entry.kind != "allreduce":
        return HorovodInternalError(f"{entry.kind} {op.name!r}: rank(s) {list(op.joined)} have joined; only "
                                    "allreduce runs while ranks are joined")
    return None

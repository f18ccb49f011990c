"""One process set's ops on this rank: matched by the set's leader, then run in the leader's order.

The engine (:mod:`ringtrain.torch.engine`) keeps a :class:`Channel` for every
process set this rank belongs to. A channel talks only to the set's
members, over two communicators of its own: ``control`` for the messages
below, ``data`` for the collectives themselves. So a set's ops complete as
soon as its members have submitted them, whatever ranks outside the set
are doing.

The protocol (:mod:`ringtrain.torch.negotiation` holds the matching; one
tag, and MPI keeps each sender's messages in order)::

    member -> leader   ("a", rank, [(key, meta id, meta or None, info), ...])   ops submitted
    leader -> member   ("d", [(key, verdict, payload, stand-in meta), ...])     ops decided, in order
    leader -> member   ("s", {key: missing ranks})                              who keeps an op waiting
    leader -> member   ("c", reason)                                            closed: fail the rest

A member sends each distinct ``meta`` once and then only its id, so an op
the ranks have run before costs a few dozen bytes each way (Horovod's
response cache does the same with a bit per op). The leader decides, sends
the decisions to every member, and every member runs them in that order,
fusing runs of small reductions the same way everywhere.

Who runs it. Whoever holds the channel's driver lock: the caller's own
thread inside ``synchronize`` (no hand-off, the common case), or else the
channel's thread, which takes over ops nobody has come for within one
cycle (``HOROVOD_CYCLE_TIME``, 1 ms) and sleeps, costing nothing, while
the set is idle. Only the driver calls MPI on ``control`` and ``data``.
"""

import collections
import os
import sys
import threading
import time

from . import kernels
from .errors import CollectiveMismatchError, DuplicateNameError, HorovodInternalError
from .handles import Pending
from .negotiation import FAIL, JOIN, RUN, Decision, Table, conflicts, stall_report, user_name

__all__ = ["Entry", "Channel", "CYCLE_S", "TICK_S", "PROBE_S"]

TAG = 7
CYCLE_S = float(os.environ.get("HOROVOD_CYCLE_TIME", 1.0)) / 1000.0
TICK_S = 0.25       # how often a leader inspects its waiting ops (stalls, conflicts, status)
PROBE_S = 1.0       # an op unmatched this long is compared with what the missing ranks submitted
WATCH_S = 0.1       # the thread keeps waking each cycle this long after the set was last busy
SPINS = 40          # polls before a driver waiting for a message starts to sleep
SLOW_S = 0.01       # the longest sleep between polls, once a wait has lasted a while
FUSION_BYTES = int(os.environ.get("HOROVOD_FUSION_THRESHOLD", 64 << 20))
INFO_KINDS = ("allgather", "alltoall")  # the kinds whose members need every member's info to run


class Entry:
    """One submitted op: its key and label, what is announced (``meta``, ``info``) and what the kernel needs."""

    __slots__ = ("key", "label", "kind", "meta", "info", "args", "pending", "submitted")

    def __init__(self, key, label, kind, meta, info, args, pending):
        self.key, self.label, self.kind = key, label, kind
        self.meta, self.info, self.args, self.pending = meta, info, args, pending
        self.submitted = time.monotonic()


class Channel:
    """One process set's queue, its names in flight, its driver and (on the leader) its :class:`Table`.

    Args:
        engine: the :class:`~ringtrain.torch.engine.Engine` (its rank, stall settings, reports, timeline).
        set_id: the process set's id.
        ranks: the set's ranks (of the runtime's communicator), in order.
        data, control: communicators over ``ranks``, in that order, owned by this channel.
    """

    def __init__(self, engine, set_id, ranks, data, control):
        self.engine, self.set_id, self.ranks = engine, set_id, tuple(ranks)
        self.data, self.control = data, control
        self.rank = engine.rank
        self.leader = self.ranks[0]
        self.is_leader = self.rank == self.leader
        self._index = {r: i for i, r in enumerate(self.ranks)}
        self._cond = threading.Condition()
        self._driver = threading.Lock()
        self._driving = False
        self._queue = []                       # submitted, not yet announced
        self._in_flight = set()                # keys from submit until the op completes
        self._mine = {}                        # key -> entry announced, not yet decided
        self._decided = collections.deque()    # (batch, decision, entry) to run in order
        self._batch = 0
        self._sends = []
        self._meta_ids = {}                    # member: meta -> id
        self._metas = {}                       # leader: rank -> {id: meta}
        self._table = Table(self.ranks) if self.is_leader else None
        self._status = {}                      # member: key -> the ranks the leader says are missing
        self._sent_status = {}
        self._closing = None
        self._closed = None
        self._leader_closed = None
        self._stopped = False
        self._parked = False
        self._last_drive = 0.0
        self._inspected = 0.0
        self._last_warning = 0.0
        self._thread = None

    # The caller's side.

    def submit(self, entry):
        """Queue ``entry``; ValueError if its name is in flight here; HorovodInternalError once closed."""
        entry.pending.channel = self
        with self._cond:
            reason = self._closed or self._closing
            if reason is not None:
                raise HorovodInternalError(f"{entry.label}: {reason}")
            if entry.key in self._in_flight:
                raise DuplicateNameError(f"{entry.label}: an op of this name is already in flight on this rank; "
                                         "wait for it (synchronize) or use another name")
            self._in_flight.add(entry.key)
            self._queue.append(entry)
            if self._thread is None:
                self._thread = threading.Thread(target=self._thread_main, daemon=True,
                                                name=f"ringtrain-hvd-set{self.set_id}")
                self._thread.start()
            elif self._parked:
                self._cond.notify()

    def drive(self, pending):
        """Run the set's ops on this thread until ``pending`` is done (or another thread is running them)."""
        while not pending.done():
            if not self._take_driver(blocking=False):
                pending.wait(0.05)  # the channel's thread is running the set: it will finish this op
                continue
            try:
                self._drive_until(pending.done)
            finally:
                self._release_driver()

    def close(self, reason):
        """Stop taking ops: those not yet decided fail with ``reason`` on every member (any thread; returns at once)."""
        with self._cond:
            if self._closing is None and self._closed is None:
                self._closing = reason
            self._cond.notify_all()

    def finish_close(self, timeout=None):
        """Drive until this channel is closed (after :meth:`close`); True when it is."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._closed is None:
            if deadline is not None and time.monotonic() > deadline:
                return False
            if self._take_driver(blocking=True, timeout=0.05):
                try:
                    self._drive_until(lambda: self._closed is not None, deadline)
                finally:
                    self._release_driver()
        return True

    def stop(self):
        """End the channel's thread (after it is closed)."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5)

    def entries(self):
        """This rank's ops in flight, oldest first, with the ranks the leader last said were missing."""
        with self._cond:
            found = list(self._mine.values()) + [e for _, _, e in self._decided] + self._queue
        return [(e, self._status.get(e.key)) for e in sorted(found, key=lambda e: e.submitted)]

    def idle_poll(self, now):
        """Read the leader's mail while the set is idle (the engine's watch calls it): stalls are seen even then."""
        if self._has_work() or not self._take_driver(blocking=False):
            return
        try:
            self._step(now, execute=False)
        finally:
            self._release_driver()

    # Driving.

    def _take_driver(self, blocking, timeout=-1):
        if not self._driver.acquire(blocking, timeout):
            return False
        self._driving = True
        return True

    def _release_driver(self):
        with self._cond:
            self._driving = False
            self._last_drive = time.monotonic()
            if self._has_work():
                self._cond.notify_all()
        self._driver.release()

    def _drive_until(self, done, deadline=None):
        idle, since = 0, time.monotonic()
        while not done():
            now = time.monotonic()
            if deadline is not None and now > deadline:
                return
            if self._step(now):
                idle, since = 0, now
            else:
                idle += 1
                _pause(idle, now - since)

    def _has_work(self):
        return bool(self._queue or self._mine or self._decided or (self._closing and not self._closed))

    def _thread_main(self):
        while self._wait_for_work():
            if not self._take_driver(blocking=False):
                continue
            try:
                self._drive_until(lambda: not self._has_work() or self._stopped)
            finally:
                self._release_driver()

    def _wait_for_work(self):
        """Sleep until there is work nobody has come for within a cycle; False once stopped."""
        with self._cond:
            while not self._stopped:
                now = time.monotonic()
                if self._has_work() and not self._driving:
                    oldest = min((e.submitted for e in self._queue), default=0.0)
                    ready_at = max(oldest, self._last_drive) + CYCLE_S
                    if now >= ready_at or self._closing:
                        return True
                    self._cond.wait(ready_at - now)
                elif self._driving or now - self._last_drive < WATCH_S:
                    self._cond.wait(CYCLE_S if not self._driving else None)
                else:
                    self._parked = True  # asleep without a timeout: submit() wakes it
                    self._cond.wait()
                    self._parked = False
            return False

    def _step(self, now, execute=True):
        """One round of work: announce, read mail, decide (leader), run what is decided. True if anything moved."""
        with self._cond:
            new, self._queue = self._queue, []
            closing = self._closing if self._closed is None else None
        moved = bool(new)
        if new:
            self._announce(new, now)
        moved |= self._receive(now)
        if self.is_leader:
            self._decide(self._table.decide())
        if self._decided and execute:
            self._execute()
            moved = True
        if closing is not None:
            moved |= self._finish_closing(closing)
        if self.is_leader and now - self._inspected >= TICK_S:
            self._inspected = now
            self._inspect(now)
        if self._sends:
            self._sends = [r for r in self._sends if not r.Test()]
        return moved

    # The protocol.

    def _send(self, rank, message):
        self._sends.append(self.control.isend(message, dest=self._index[rank], tag=TAG))

    def _announce(self, entries, now):
        if self._closed is not None:
            for e in entries:
                self._complete(e, error=HorovodInternalError(f"{e.label}: {self._closed}"))
            return
        items = []
        for e in entries:
            self._mine[e.key] = e
            if self.is_leader:
                self._table.announce(self.rank, e.key, e.meta, e.info, now)
                continue
            meta_id = self._meta_ids.get(e.meta)
            new = meta_id is None
            if new:
                meta_id = self._meta_ids[e.meta] = len(self._meta_ids)
            items.append((e.key, meta_id, e.meta if new else None, e.info))
        if items:
            self._send(self.leader, ("a", self.rank, items))

    def _receive(self, now):
        from mpi4py import MPI

        moved = False
        while True:
            message = self.control.improbe(MPI.ANY_SOURCE, TAG)
            if message is None:
                return moved
            moved = True
            kind, *body = message.recv()
            if kind == "a":
                self._heard(body[0], body[1], now)
            elif kind == "d":
                self._batch += 1
                for record in body[0]:
                    self._follow(*record)
            elif kind == "s":
                self._status.update(body[0])
            else:  # the leader has closed the set: so must this member
                self._leader_closed = body[0]
                self.close(body[0])

    def _heard(self, rank, items, now):
        """The leader's side of an announcement."""
        metas = self._metas.setdefault(rank, {})
        for key, meta_id, meta, info in items:
            if meta is not None:
                metas[meta_id] = meta
            if self._closed is not None:  # closed: tell the member at once
                self._send(rank, ("d", [(key, FAIL, (False, f"{user_name(key)!r}: {self._closed}"), None)]))
                continue
            self._table.announce(rank, key, metas[meta_id], info, now)

    def _decide(self, decisions):
        """The leader's side of a decision: send it to every member, and queue it here."""
        if not decisions:
            return
        self._batch += 1
        others = {r: [] for r in self.ranks if r != self.rank}
        for d in decisions:
            if d.verdict == FAIL:
                record = (d.name, FAIL, (d.mismatch, d.error), None)
                for records in others.values():
                    records.append(record)
                self._follow(*record, decision=d)
                continue
            kind = dict(d.meta).get("kind")
            payload = d.result if d.name == JOIN else (d.infos if kind in INFO_KINDS or _grouped(d.meta) else None)
            for r, records in others.items():
                records.append((d.name, RUN, payload, d.meta if r in d.joined else None))
            self._follow(d.name, RUN, payload, d.meta if self.rank in d.joined else None, decision=d)
        for r, records in others.items():
            self._send(r, ("d", records))

    def _follow(self, key, verdict, payload, stand_in, decision=None):
        """Queue one decision for this rank, in order: its own entry, or zeros for a rank that joined."""
        entry = self._mine.pop(key, None)
        if verdict == FAIL:
            if entry is not None:
                mismatch, text = payload
                error = (CollectiveMismatchError if mismatch else HorovodInternalError)(text)
                self._decided.append((self._batch, Decision(key, FAIL, entry.meta, [], error=error), entry))
            return
        if entry is None:
            if stand_in is None:
                raise HorovodInternalError(f"{user_name(key)!r}: decided by the leader, but never submitted here")
            entry = Entry(key, f"allreduce {user_name(key)!r} (zeros for a joined rank)", "allreduce", stand_in,
                          None, kernels.stand_in_args(stand_in), Pending())
        meta = stand_in if stand_in is not None else entry.meta
        result = payload if key == JOIN else None
        infos = payload if key != JOIN else None
        if decision is not None:
            infos = decision.infos
        self._decided.append((self._batch, Decision(key, RUN, meta, infos, result=result), entry))

    def _execute(self):
        """Run the decided ops in order, small reductions of one batch fused."""
        while self._decided:
            batch, decision, entry = self._decided.popleft()
            if decision.verdict == FAIL:
                self._complete(entry, error=decision.error)
                continue
            if decision.name == JOIN:
                self._complete(entry, decision.result)
                continue
            if _grouped(decision.meta):
                for part in reversed(self._parts(decision, entry)):
                    self._decided.appendleft((batch, *part))
                continue
            group = [(decision, entry)]
            if entry.kind in kernels.FUSABLE:
                key, total = kernels.fuse_key(decision.meta), kernels.nbytes(decision.meta)
                while self._decided:
                    b, d, e = self._decided[0]
                    if (b != batch or d.verdict != RUN or e.kind != entry.kind or _grouped(d.meta)
                            or kernels.fuse_key(d.meta) != key or total + kernels.nbytes(d.meta) > FUSION_BYTES):
                        break
                    total += kernels.nbytes(d.meta)
                    group.append(self._decided.popleft()[1:])
            self._run(group)

    def _parts(self, decision, entry):
        """A grouped op as one ``(decision, entry)`` per tensor; the group completes with the last of them."""
        collected = _Collected(entry, self._complete)
        return [(Decision(f"{entry.key}#{i}", RUN, meta, infos),
                 Entry(f"{entry.key}#{i}", entry.label, entry.kind, meta, None, args, _Part(collected, i)))
                for i, (meta, args, infos) in enumerate(kernels.split_parts(decision, entry.args))]

    def _run(self, group):
        entry = group[0][1]
        timeline = self.engine.timeline
        try:
            if timeline is None:
                results = kernels.run(entry.kind, self.data, group)
            else:
                label = f"{entry.label}" + (f" (+{len(group) - 1} fused)" if len(group) > 1 else "")
                with timeline.span(label, tid=1):
                    results = kernels.run(entry.kind, self.data, group)
        except Exception as exc:  # noqa: BLE001 - the caller gets it from synchronize
            error = exc if isinstance(exc, RuntimeError) else HorovodInternalError(f"{type(exc).__name__}: {exc}")
            for _, e in group:
                self._complete(e, error=error)
            return
        for (_, e), result in zip(group, results):
            self._complete(e, result)

    def _complete(self, entry, result=None, error=None):
        # The name is free before anyone waiting hears of it, so a caller may reuse it at once.
        with self._cond:
            self._in_flight.discard(entry.key)
        if error is not None:
            entry.pending.fail(error)
        else:
            entry.pending.succeed(result)

    # Closing, and the leader's inspection.

    def _finish_closing(self, reason):
        """Close: the leader fails what is undecided everywhere; a member waits for the leader's word."""
        if self.is_leader:
            self._decide(self._table.fail_all(reason))
            for r in self.ranks:
                if r != self.rank:
                    self._send(r, ("c", reason))
        elif self._mine and self._leader_closed is None:
            return False
        self._execute()
        with self._cond:
            self._closed = self._leader_closed or reason
            left, self._queue = list(self._mine.values()) + self._queue, []
            self._mine = {}
            self._closing = None
        for e in left:
            self._complete(e, error=HorovodInternalError(f"{e.label}: {self._closed}"))
        return True

    def _inspect(self, now):
        """The leader's watch over its waiting ops: conflicts, who is missing, Horovod's stall warnings."""
        waiting = self._table.waiting(now)
        if not waiting:
            return
        failed = [self._table.fail(key, error) for key, error in
                  conflicts(self.set_id, waiting, self.engine.reports, PROBE_S)]
        for d in failed:
            if d is not None:
                d.mismatch = True
        self._decide([d for d in failed if d is not None])
        status = {key: missing for key, age, missing in waiting if age >= PROBE_S}
        if status and status != self._sent_status:
            self._sent_status = status
            for r in self.ranks:
                if r != self.rank:
                    self._send(r, ("s", status))
            self._status.update(status)
        check_s, shutdown_s = self.engine.stall_times
        if check_s is None or now - self._last_warning < check_s:
            return
        message, shut_down = stall_report(self.set_id, self.ranks, waiting, check_s, shutdown_s)
        if message is None:
            return
        self._last_warning = now
        sys.stderr.write(f"[ringtrain.torch] {'ERROR' if shut_down else 'WARNING'} rank {self.rank}: {message}\n")
        sys.stderr.flush()
        if shut_down:
            late = sorted({r for _, age, missing in waiting if age > shutdown_s for r in missing})
            self.engine.stall_shutdown(f"process set {self.set_id} stalled: rank(s) {late} kept an op waiting "
                                       f"more than {shutdown_s:g}s (HOROVOD_STALL_SHUTDOWN_TIME_SECONDS)")


class _Collected:
    """A grouped op's results: its entry completes when every part has (with the first error, if any)."""

    def __init__(self, entry, complete):
        self.entry, self.complete = entry, complete
        self.results = [None] * len(entry.args)
        self.left = len(entry.args)
        self.error = None

    def done(self, i, result=None, error=None):
        self.results[i] = result
        self.error = self.error or error
        self.left -= 1
        if self.left == 0:
            self.complete(self.entry, self.results, self.error)


class _Part:
    """The completion of one part of a grouped op (what :class:`~ringtrain.torch.handles.Pending` is to an op)."""

    def __init__(self, collected, i):
        self.collected, self.i = collected, i

    def succeed(self, result):
        self.collected.done(self.i, result)

    def fail(self, error):
        self.collected.done(self.i, error=error)


def _grouped(meta):
    return meta[0][0] == "kind" and len(meta) > 1 and meta[1][0] == "parts"


def _pause(idle, waited):
    """Between polls for a message: spin a little, then sleep longer the longer the wait has lasted."""
    if idle < SPINS:
        return
    if waited < 0.1:
        time.sleep(min(CYCLE_S, 2e-5 * 2 ** min(idle - SPINS, 8)))
    else:
        time.sleep(SLOW_S)

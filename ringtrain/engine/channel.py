"""One process set's ops on this rank: announced to every member, run as every member's verdict says.

The engine (:mod:`ringtrain.engine.engine`) keeps a :class:`Channel` for every
process set this rank belongs to. A channel talks only to the set's
members, over two communicators of its own: ``control`` for the messages
below, ``data`` for the collectives themselves. So a set's ops complete as
soon as its members have submitted them, whatever ranks outside the set
are doing.

The protocol (:mod:`ringtrain.engine.negotiation` holds the rules; one tag,
and MPI keeps each sender's messages in order)::

    every member -> every member   ("a", (rank, [(key, record id, record or None, info, data), ...]))
    leader -> every member         ("d", [(key, RUN or FAIL, payload), ...])   the order of the collectives
                                                                                 (FAIL: (mismatch, why))
    leader -> every member         ("c", reason)                                closed: fail the rest
    member -> leader               ("k", rank)                                  closed here too (removal)

Every member hears every announcement, so once a member has heard an op
from every member it knows, as every other member does, whether the op
fails (the ranks disagree), is computed on the spot (a small allreduce,
broadcast or barrier whose data came with the announcements: one message
each way, no collective), or is a collective, which runs in the order the
leader (the set's lowest rank) sends: ranks may submit ops in different
orders, and one thread running blocking collectives must run them in the
same order as its peers. A member sends each distinct op record once and
then only its id, so an op the ranks have run before costs a few dozen
bytes per member (Horovod's response cache does the same with a bit).

Who runs it. Whoever holds the channel's driver lock: the caller's own
thread inside ``synchronize`` (no hand-off, the common case), or else the
channel's thread, which takes over ops nobody has come for within one
cycle (``HOROVOD_CYCLE_TIME``, 1 ms; :mod:`ringtrain.engine.settings`) and sleeps, costing nothing, while
the set is idle. Only the driver calls MPI on ``control`` and ``data``.
"""

import collections
import os
import sys
import threading
import time
import typing

from . import kernels
from .errors import CollectiveMismatchError, DuplicateNameError, HorovodInternalError
from .handles import Pending
from .negotiation import (FAIL, JOIN, JOINED, LOCAL, Announcement, Board, Grouped, conflicts, join_blocks, stall_report,
                          user_name, verdict)

__all__ = ["Entry", "Channel", "Decision", "TICK_S", "PROBE_S"]

TAG = 7
RUN = "run"
TICK_S = 0.25       # how often a leader inspects its waiting ops (stalls, conflicts)
PROBE_S = 1.0       # an op unmatched this long is compared with what the missing ranks submitted
WATCH_S = 0.1       # the thread keeps watching this long after the set was last busy, then sleeps
WATCH_MAX_S = 0.008  # the longest it waits between looks while watching
SPIN_S = 50e-6      # how long a driver waiting for a message spins before it yields the core
YIELD_S = 0.005     # how long it yields before it starts to sleep
SLOW_S = 0.01       # the longest sleep between polls, once a wait has lasted a while
INFO_KINDS = ("allgather", "alltoall")  # the kinds whose kernels need every member's info


class Entry:
    """One submitted op: its key, what is announced (its ``record``, ``info``) and what the kernel needs.

    ``where`` is what errors name it by (a string, or ``(name, process set)``
    made into one only when needed); ``local`` marks an op small enough for
    its data to go with its announcement.
    """

    __slots__ = ("key", "where", "kind", "record", "info", "args", "pending", "submitted", "local")

    def __init__(self, key, where, kind, record, info, args, pending, local=False):
        self.key, self.where, self.kind = key, where, kind
        self.record, self.info, self.args, self.pending = record, info, args, pending
        self.submitted = time.monotonic()
        self.local = local

    @property
    def label(self):
        """How errors name the op: ``allreduce 'loss'``, ``... on process set 2``."""
        if isinstance(self.where, str):
            return self.where
        name, set_id = self.where
        return f"{self.kind} {name!r}" + (f" on process set {set_id}" if set_id else "")


class Decision(typing.NamedTuple):
    """An ordered op as its kernel sees it: the agreed record and every member's ``info``, in member order."""

    name: str
    record: object
    infos: list


class Channel:
    """One process set's queue, names in flight, board of announcements and driver.

    Args:
        engine: the :class:`~ringtrain.engine.engine.Engine` (its rank, stall settings, reports, timeline).
        set_id: the process set's id.
        ranks: the set's ranks (of the runtime's communicator), in order.
        data, control: communicators over ``ranks``, in that order.
    """

    def __init__(self, engine, set_id, ranks, data, control):
        from mpi4py import MPI

        self.engine, self.set_id, self.ranks = engine, set_id, tuple(ranks)
        self.data, self.control = data, control
        self.rank = engine.rank
        self.leader = self.ranks[0]
        self.is_leader = self.rank == self.leader
        self._others = [r for r in self.ranks if r != self.rank]
        self._index = {r: i for i, r in enumerate(self.ranks)}
        self._any_source = MPI.ANY_SOURCE
        self._lock = threading.Lock()          # the queue's; taken bare where nobody waits (cheaper than _cond)
        self._cond = threading.Condition(self._lock)
        self._driver = threading.Lock()
        self._driving = False
        self._queue = []                       # submitted, not yet announced
        self._in_flight = set()                # keys from submit until the op completes
        self._mine = {}                        # key -> this rank's entry, announced, not yet run
        self._board = Board(self.ranks)
        self._ordered = collections.deque()    # (batch, key, RUN or FAIL, payload): the leader's order
        self._batch = 0
        self._answers = []                     # JOINED answers to send with the next announcements
        self._join_order = []                  # leader: ranks in the order their JOIN arrived
        self._to_order = []                    # leader: collectives heard complete, to order in one batch
        self._failed_joined = set()            # keys failed here because a rank has joined (until all have)
        self._sends = []
        self._record_ids = {}                  # id(record) -> (record, the id this rank announces it under)
        self._next_record_id = 0
        self._records = {}                     # rank -> {id: record}
        self._closing = None
        self._closed = None
        self._leader_closed = None
        self._handshake = False                # closing for good: members answer the leader's word
        self._told = False                     # the closing word is sent (leader) or answered (member)
        self._acks = set()
        self._stopped = False
        self._parked = False
        self._last_drive = 0.0
        self._inspected = 0.0
        self._last_warning = 0.0
        self._thread = None
        self._cycle_s = engine.settings.cycle_s
        self._fusion_bytes = engine.settings.fusion_bytes
        self._interval = self._cycle_s

    # The caller's side.

    def submit(self, entry):
        """Queue ``entry``; ValueError if its name is in flight here; HorovodInternalError once closed."""
        entry.pending.channel = self
        with self._lock:
            reason = self._closed or self._closing
            if reason is not None:
                raise HorovodInternalError(f"{entry.label}: {reason}")
            if entry.key in self._in_flight:
                raise DuplicateNameError(f"{entry.label}: an op of this name is already in flight on this rank; "
                                         "wait for it (synchronize) or use another name")
            self._in_flight.add(entry.key)
            self._queue.append(entry)
            if self._thread is None:
                self._start_thread()
            elif self._parked:
                self._cond.notify()

    def _start_thread(self):
        if self._thread is None and not self._stopped:
            self._thread = threading.Thread(target=self._thread_main, daemon=True,
                                            name=f"ringtrain-hvd-set{self.set_id}")
            self._thread.start()

    def drive(self, pending):
        """Run the set's ops on this thread until ``pending`` is done (or another thread is running them)."""
        while not pending.finished:
            if not self._take_driver(blocking=False):
                # Another thread is running the set (the channel's, or the watch reading a leader's mail
                # for a moment): it may finish this op, or hand the set back soon.
                pending.wait(0.002)
                continue
            try:
                self._drive_until(pending.done)
            finally:
                self._release_driver()

    def close(self, reason, handshake=False):
        """Stop taking ops: those not run yet fail with ``reason`` on every member (any thread; returns at once).

        ``handshake``: every member confirms (for a set whose communicators are about to be freed).
        """
        with self._cond:
            self._handshake = self._handshake or handshake
            if self._closing is None and self._closed is None:
                self._closing = reason
            self._start_thread()  # a leader that never submitted must still tell its members
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
        """``[(entry, missing ranks)]``: this rank's ops in flight, oldest first (for the engine's watch)."""
        found = list(self._mine.values()) + list(self._queue)
        waiting = {key: missing for key, _, missing in self._board.waiting(time.monotonic())}
        return [(e, waiting.get(e.key, [])) for e in sorted(found, key=lambda e: e.submitted)]

    def idle_poll(self, now):
        """A leader reads its mail while it has nothing to run (the engine's watch calls it), to see stalls."""
        if not self.is_leader or self._has_work() or not self._take_driver(blocking=False):
            return
        try:
            self._step(now)
        finally:
            self._release_driver()

    # Driving.

    def _take_driver(self, blocking, timeout=-1):
        if not self._driver.acquire(blocking, timeout):
            return False
        self._driving = True
        return True

    def _release_driver(self):
        self._driving = False
        self._last_drive = time.monotonic()
        self._driver.release()
        if self._has_work():  # left for the thread (which, watching, would look again within its interval)
            with self._cond:
                self._cond.notify_all()

    def _drive_until(self, done, deadline=None):
        since = now = time.monotonic()
        while not done():
            moved = self._step(now, done)
            now = time.monotonic()
            if moved:  # (a step that moved may have finished the op: no pause before done() is asked again)
                since = now
            elif now - since > SPIN_S:
                if deadline is not None and now > deadline:
                    return
                _pause(now - since, self._cycle_s)

    def _has_work(self):
        return bool(self._queue or self._mine or self._ordered or (self._closing and not self._closed))

    def _thread_main(self):
        while self._wait_for_work():
            if not self._take_driver(blocking=False):
                continue
            self._interval = self._cycle_s
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
                    ready_at = max(oldest, self._last_drive) + self._cycle_s
                    if now >= ready_at or self._closing:
                        return True
                    self._cond.wait(ready_at - now)
                elif self._driving or now - self._last_drive < WATCH_S:
                    # Watching while callers run the set's ops themselves: each look that finds nothing
                    # for this thread to do doubles the time to the next, so a loop of blocking ops is
                    # not slowed by a thread that keeps waking for the interpreter lock.
                    self._cond.wait(self._interval)
                    self._interval = min(2 * self._interval, WATCH_MAX_S)
                else:
                    self._parked = True  # asleep without a timeout: submit() wakes it
                    self._cond.wait()
                    self._parked = False
            return False

    def _step(self, now, done=None):
        """One round of work: announce, read mail (until ``done()``), order (leader), run. True if anything moved."""
        moved = False
        if self._queue:
            with self._lock:
                new, self._queue = self._queue, []
            self._announce(new, now)
            moved = True
        closing = self._closing if self._closed is None else None
        if self._others:
            moved |= self._receive(now, done)
        if self._answers:
            self._send_all(("a", (self.rank, self._answers)))
            self._answers = []
        if self._to_order:
            self._flush_orders()
        if self._ordered:
            moved |= self._run_ordered(now)
            if self._to_order:  # ops heard complete while those ran (the next of a name): ordered at once
                self._flush_orders()
        if closing is not None:
            moved |= self._finish_closing(closing, now)
        if self.is_leader and now - self._inspected >= TICK_S:
            self._inspected = now
            self._inspect(now)
        if self._sends:
            self._sends = [r for r in self._sends if not r.Test()]
        return moved

    # Announcing and hearing.

    def _send(self, rank, message):
        request = self.control.isend(message, dest=self._index[rank], tag=TAG)
        if not request.Test():
            self._sends.append(request)

    def _send_all(self, message):
        for r in self._others:
            request = self.control.isend(message, dest=self._index[r], tag=TAG)
            # Testing at once pushes the message out: MPI may otherwise move it only at this rank's next call.
            if not request.Test():
                self._sends.append(request)

    def _announce(self, entries, now):
        if self._closed is not None:
            for e in entries:
                self._complete(e, error=HorovodInternalError(f"{e.label}: {self._closed}"))
            return
        items, complete = [], []
        for e in entries:
            self._mine[e.key] = e
            data = self._data_of(e)
            if e.key in self._failed_joined:
                self._mine.pop(e.key)
                self._complete(e, error=HorovodInternalError(f"{e.label}: a rank has joined; only allreduce runs "
                                                             "while ranks are joined"))
                continue
            if self._board.add(self.rank, e.key, Announcement(e.record, e.info, e.args[0] if e.local else None),
                               now):
                complete.append(e.key)
            if e.key == JOIN and self.is_leader:
                self._join_order.append(self.rank)
            if not self._others:
                continue
            record_id, new = self._record_id(e.record)
            items.append((e.key, record_id, e.record if new else None, e.info, data))
            if e.key == JOIN:  # from now on this rank answers the ops it has not submitted: it adds zeros
                self._answer_all(now, complete)
        if items:
            self._send_all(("a", (self.rank, items)))
        if JOIN in self._board:
            self._check_joined([e.key for e in entries] if JOIN not in self._mine else self._board.keys(), now)
        for key in complete:
            if self._board.complete(key):
                self._heard_all(key, now)

    def _record_id(self, record):
        """``(id, new)``: the id ``record`` is announced under, and whether it must go with it this once."""
        kept, record_id = self._record_ids.get(id(record), (None, None))  # one record per distinct op (ops): cheap keys
        if kept is record:
            return record_id, False
        if len(self._record_ids) >= 4096:  # ever-new shapes: start the ids again (each is sent with its record,
            self._record_ids.clear()       # so the members' tables of ids stay as small)
            self._next_record_id = 0
        self._next_record_id += 1
        self._record_ids[id(record)] = (record, self._next_record_id)  # kept alive: its id is not reused
        return self._next_record_id, True

    def _data_of(self, entry):
        """A small op's bytes, sent with its announcement (an allreduce's input; a broadcast's, from its root)."""
        if not entry.local or not self._others:
            return None
        if entry.kind == "broadcast" and self.ranks[entry.record.root] != self.rank:
            return None
        return kernels.raw_bytes(entry.args[0])

    def _receive(self, now, done=None):
        """Read and act on the messages that have arrived; stop early once ``done()`` (the caller's op finished:
        the rest wait for the next step, and the caller goes back to its program one MPI call sooner)."""
        moved = False
        while True:
            message = self.control.improbe(self._any_source, TAG)
            if message is None:
                return moved
            moved = True
            kind, body = message.recv()
            if kind == "a":
                self._heard(*body, now)
                if done is not None and done():
                    return True
            elif kind == "d":
                self._batch += 1
                self._ordered.extend((self._batch, *order) for order in body)
            elif kind == "k":  # a member's answer to the leader's word that the set is closed
                self._acks.add(body)
            else:  # the leader has closed the set: so must this member
                self._leader_closed = body
                self.close(body)

    def _heard(self, rank, items, now):
        records = self._records.setdefault(rank, {})
        complete = []
        for key, record_id, record, info, data in items:
            if record is not None:
                records[record_id] = record
            else:
                record = records[record_id]
            if key in self._failed_joined:
                continue  # failed here already: a rank has joined, and only allreduces run
            if self._board.add(rank, key, Announcement(record, info, data), now):
                complete.append(key)
            if key == JOIN:
                if self.is_leader:
                    self._join_order.append(rank)
                self._check_joined(self._board.keys(), now)
                continue
            if JOIN in self._board:
                if JOIN in self._mine and not self._board.has(key, self.rank) and record.kind == "allreduce":
                    self._answer(key, now, complete)
                self._check_joined([key], now)
        for key in complete:
            if self._board.complete(key):
                self._heard_all(key, now)

    def _answer_all(self, now, complete):
        for key in self._board.keys():
            announced = self._board.partial(key)
            kind = next((a.record.kind for a in announced.values()), None)
            if key != JOIN and not self._board.has(key, self.rank) and kind == "allreduce":
                self._answer(key, now, complete)

    def _check_joined(self, keys, now):
        """Fail at once the ops (not allreduces) that a rank which has joined will never submit."""
        joined = list(self._board.partial(JOIN))
        if not joined:
            return
        for key in keys:
            if key == JOIN:
                continue
            ranks = join_blocks(key, joined, self._board.partial(key))
            if ranks is None:
                continue
            entry = self._mine.pop(key, None)
            if entry is not None:
                self._complete(entry, error=HorovodInternalError(
                    f"{_label_of(key)}: rank(s) {ranks} have joined; only allreduce runs while ranks are joined"))
            self._board.drop(key)
            self._failed_joined.add(key)

    def _answer(self, key, now, complete):
        """This rank has joined: it answers an op it did not submit with JOINED (zeros, for an allreduce)."""
        record_id, new = self._record_id(JOINED)
        self._answers.append((key, record_id, JOINED if new else None, None, None))
        if self._board.add(self.rank, key, Announcement(JOINED), now):
            complete.append(key)

    def _heard_all(self, key, now):
        """Every member has announced ``key``: fail it, compute it here, or (a collective) leave it to be ordered."""
        if key == JOIN:
            if self.is_leader:
                self._to_order.append((JOIN, RUN, self._join_order[-1]))
                self._join_order = []
            return
        announced = self._board.announcements(key)
        v = verdict(key, self.ranks, announced)
        if v.action == LOCAL:
            self._run_local(key, v, announced, now)
        elif v.action == FAIL:
            entry = self._mine.pop(key, None)
            if entry is not None:
                self._complete(entry, error=(CollectiveMismatchError if v.mismatch else HorovodInternalError)(v.error))
            self._done(key, now)
        elif self.is_leader:
            self._to_order.append((key, RUN, None))  # sent with the others heard in this step: they may fuse

    def _done(self, key, now):
        if self._board.take(key, now):
            self._heard_all(key, now)

    def _run_local(self, key, v, announced, now):
        """A small op whose data every rank has: the result is computed here, as on every member."""
        entry = self._mine.pop(key, None)
        if entry is not None:
            data = [announced[r].data for r in self.ranks]  # (a rank that joined announced JOINED, with no data)
            out = entry.args[1] if len(entry.args) > 1 else None
            timeline = self.engine.timeline
            try:
                if timeline is None:
                    result = kernels.run_local(v.record, data, out)
                else:
                    with timeline.span(entry.label + " (local)", tid=1):
                        result = kernels.run_local(v.record, data, out)
            except Exception as exc:  # noqa: BLE001 - the caller gets it from synchronize
                self._complete(entry, error=_as_runtime_error(exc))
            else:
                self._complete(entry, result)
        self._done(key, now)

    def _flush_orders(self):
        orders, self._to_order = self._to_order, []
        self._order(orders)

    def _order(self, orders):
        """The leader's side: send the order to every member, and follow it here."""
        if self._others:
            self._send_all(("d", orders))
        self._batch += 1
        self._ordered.extend((self._batch, *order) for order in orders)

    def _run_ordered(self, now):
        """Run the ordered ops whose announcements have all arrived, in order, small reductions of a batch fused."""
        moved = False
        while self._ordered:
            batch, key, action, payload = self._ordered[0]
            if action == FAIL:
                self._ordered.popleft()
                entry = self._mine.pop(key, None)
                if entry is not None:
                    mismatch, text = payload
                    self._complete(entry, error=(CollectiveMismatchError if mismatch else HorovodInternalError)(text))
                self._done(key, now)
                moved = True
                continue
            if not self._board.complete(key):
                return moved  # an announcement the leader has heard is still on its way here
            self._ordered.popleft()
            moved = True
            if key == JOIN:
                entry = self._mine.pop(key, None)
                self._complete(entry, payload)
                self._done(key, now)
                self._failed_joined.clear()  # every rank has joined: none will submit those ops again
                continue
            group = [self._decision(key)]
            decision, entry = group[0]
            if entry.kind in kernels.FUSABLE and type(decision.record) is not Grouped:
                group += self._fusable(batch, decision.record)
            self._run(group)
            for d, _ in group:
                self._done(d.name, now)
        return moved

    def _decision(self, key):
        """``(Decision, entry)`` for an ordered op: this rank's entry, or zeros if it answered JOINED."""
        announced = self._board.announcements(key)
        record = next(a.record for a in announced.values() if a.record != JOINED)
        infos = [announced[r].info for r in self.ranks]
        entry = self._mine.pop(key, None)
        if announced[self.rank].record == JOINED:
            entry = Entry(key, f"allreduce {user_name(key)!r} (zeros for a joined rank)", "allreduce", record, None,
                          kernels.stand_in_args(record), Pending())
        return Decision(key, record, infos), entry

    def _fusable(self, batch, record):
        """The ordered ops right after this one that fuse with it (the same on every member)."""
        key, total, group = record.fuse_key(), record.nbytes, []
        while self._ordered:
            b, k, action, _ = self._ordered[0]
            if b != batch or action != RUN or not self._board.complete(k):
                break
            other = next(a.record for a in self._board.announcements(k).values() if a.record != JOINED)
            if (type(other) is not type(record) or other.fuse_key() != key
                    or total + other.nbytes > self._fusion_bytes):
                break
            self._ordered.popleft()
            total += other.nbytes
            group.append(self._decision(k))
        return group

    def _run(self, group):
        decision, entry = group[0]
        if type(decision.record) is Grouped:
            results = kernels.GroupResults(len(entry.args), lambda values, error: self._complete(entry, values, error))
            parts = [(Decision(f"{entry.key}#{i}", record, infos),
                      Entry(f"{entry.key}#{i}", entry.label, entry.kind, record, None, args, results.part(i)))
                     for i, (record, args, infos) in enumerate(kernels.split_parts(decision, entry.args))]
            self._run_parts(parts, entry.kind)
            return
        timeline = self.engine.timeline
        try:
            if timeline is None:
                results = kernels.run(entry.kind, self.data, group)
            else:
                name = entry.label + (f" (+{len(group) - 1} fused)" if len(group) > 1 else "")
                with timeline.span(name, tid=1):
                    results = kernels.run(entry.kind, self.data, group)
        except Exception as exc:  # noqa: BLE001 - the caller gets it from synchronize
            for _, e in group:
                self._complete(e, error=_as_runtime_error(exc))
            return
        for (_, e), result in zip(group, results):
            self._complete(e, result)

    def _run_parts(self, parts, kind):
        """A grouped op's tensors, run one after another, runs of compatible reductions fused."""
        i = 0
        while i < len(parts):
            group = [parts[i]]
            i += 1
            if kind in kernels.FUSABLE:
                first = group[0][0].record
                key, total = first.fuse_key(), first.nbytes
                while (i < len(parts) and parts[i][0].record.fuse_key() == key
                       and total + parts[i][0].record.nbytes <= self._fusion_bytes):
                    total += parts[i][0].record.nbytes
                    group.append(parts[i])
                    i += 1
            self._run(group)

    def _complete(self, entry, result=None, error=None):
        # The name is free before anyone waiting hears of it, so a caller may reuse it at once. (No lock:
        # a set's discard is atomic, and no submit can be adding this key while its op is in flight.)
        self._in_flight.discard(entry.key)
        if error is not None:
            entry.pending.fail(error)
        else:
            entry.pending.succeed(result)

    # Closing, and the leader's inspection.

    def _finish_closing(self, reason, now):
        """Close: the leader fails what has not run everywhere; a member waits for the leader's word.

        With ``handshake`` (the set is being removed, and its communicators
        freed) every member also waits for the leader's word and answers it,
        and the leader waits for every answer: nothing is left on its way on
        a communicator whose id MPI may give to the next one.
        """
        if self.is_leader:
            if not self._told:
                if self._to_order:
                    self._flush_orders()
                ordered = {key for _, key, _, _ in self._ordered}
                self._order([(key, FAIL, (False, f"{_label_of(key)}: {reason}")) for key in self._board.keys()
                             if key not in ordered])
                if self._others:
                    self._send_all(("c", reason))
                self._told = True
            if self._handshake and len(self._acks) < len(self._others):
                return False
        else:
            if self._leader_closed is None and (self._handshake or self._mine or self._ordered):
                return False
            if self._handshake and not self._told:
                self._send(self.leader, ("k", self.rank))
                self._told = True
        self._run_ordered(now)
        with self._cond:
            self._closed = self._leader_closed or reason
            left, self._queue = list(self._mine.values()) + self._queue, []
            self._mine = {}
            self._closing = None
        for e in left:
            self._complete(e, error=HorovodInternalError(f"{e.label}: {self._closed}"))
        return True

    def _inspect(self, now):
        """The leader's watch over ops not every member has announced: conflicts, Horovod's stall warnings."""
        waiting = self._board.waiting(now)
        if not waiting:
            return
        failed = conflicts(self.set_id, waiting, self.engine.reports, PROBE_S)
        if failed:
            self._order([(key, FAIL, (True, error)) for key, error in failed])
        check_s, shutdown_s = self.engine.stall_times
        if check_s is None or now - self._last_warning < check_s:
            return
        message, shut_down = stall_report(self.set_id, self.ranks, waiting, check_s, shutdown_s)
        if message is None:
            return
        self._last_warning = now
        sys.stderr.write(f"[ringtrain.engine] {'ERROR' if shut_down else 'WARNING'} rank {self.rank}: {message}\n")
        sys.stderr.flush()
        if shut_down:
            late = sorted({r for _, age, missing in waiting if age > shutdown_s for r in missing})
            self.engine.stall_shutdown(f"process set {self.set_id} stalled: rank(s) {late} kept an op waiting "
                                       f"more than {shutdown_s:g}s (HOROVOD_STALL_SHUTDOWN_TIME_SECONDS)")


def _label_of(key):
    return f"{key.partition('.')[0]} {user_name(key)!r}"


def _as_runtime_error(exc):
    return exc if isinstance(exc, RuntimeError) else HorovodInternalError(f"{type(exc).__name__}: {exc}")


def _pause(waited, cycle_s):
    """Between polls for a message: spin, then yield the core, then sleep longer the longer the wait has lasted.

    A peer that answers within microseconds is caught spinning; yielding
    (as ringtrain's shared-memory barrier does) keeps that latency while
    giving the core to whoever needs it when ranks outnumber cores; a wait
    past a few milliseconds means a late peer, and sleeping costs nothing.
    """
    if waited < YIELD_S:
        os.sched_yield()
    elif waited < 0.1:
        time.sleep(cycle_s)
    else:
        time.sleep(SLOW_S)

"""The protocol one process set's members speak: announce, hear, join, order, fuse, run, close, inspect.

Only the thread that drives a set's channel (:mod:`ringtrain.engine.channel`:
the caller's own, inside ``synchronize``, or the channel's thread) runs a
:class:`Protocol`, so nothing here takes a lock: the state below is the
driver's alone. It talks only to the set's members, over two communicators
of its own: ``control`` for the messages below, ``data`` for the
collectives themselves. So a set's ops complete as soon as its members have
submitted them, whatever ranks outside the set are doing.

The messages (:mod:`ringtrain.engine.negotiation` holds the rules; read
with any tag, so MPI keeps each sender's messages in order)::

    every member -> every member   ("a", (rank, [(key, record id, record or None, info, data), ...]
                                          [, {key: conflicts of its name passed} if any]))
                                   or one small allreduce's, raw (ALONE_TAG: rank, record id, key, data)
    leader -> every member         ("d", [(key, RUN or FAIL, payload), ...])   the order of the collectives
                                                                                 (FAIL: (mismatch, why), or for an
                                                                                 unmatched op: (mismatch, why,
                                                                                 partner, ranks announced))
    leader -> every member         ("c", reason)                                closed: fail the rest
    member -> every member         ("g", rank)                                  closing on a shutdown: its last
                                                                                 announcement is sent
    member -> leader               ("k", rank)                                  closed here too (removal)
    member -> leader               ("w", (rank, key, why, partner))             withdraw its undecided op (it
                                                                                 conflicts with another set's)

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
"""

import collections
import typing

from . import kernels
from .alone import ALONE_TAG, LonePath, as_runtime_error, parse_alone
from .errors import CollectiveMismatchError, HorovodInternalError
from .handles import Countdown, Entry, Pending
from .negotiation import (FAIL, JOIN, JOINED, LOCAL, Announcement, Board, Grouped, conflicts, join_blocks, op_label,
                          user_name, verdict)

__all__ = ["Decision", "Protocol", "TICK_S", "PROBE_S"]

TAG = 7
RUN = "run"
TICK_S = 0.25       # how often a leader inspects its waiting ops (stalls, conflicts)
PROBE_S = 1.0       # an op unmatched this long is compared with what the missing ranks submitted
RECORD_IDS = 4096    # the most op records a rank keeps ids for (then it starts again)
LAST_WORD_S = 1.0   # how long a set closing on a shutdown waits for its members' "g" (a rank that never drives)


class Decision(typing.NamedTuple):
    """An ordered op as its kernel sees it: the agreed record and every member's ``info``, in member order."""

    name: str
    record: object
    infos: list


class Protocol(LonePath):
    """One process set's announcements, board, order and runs on this rank: the driving thread's alone.

    Args:
        channel: the set's :class:`~ringtrain.engine.channel.Channel`: the queue it takes submitted ops
            from, the names in flight it frees, whether the set is closing, and where it says it has closed.
        engine: the :class:`~ringtrain.engine.core.Engine` (its rank, settings, reports, timeline).
        set_id: the process set's id.
        ranks: the set's ranks (of the runtime's communicator), in order.
        data, control: communicators over ``ranks``, in that order.
    """

    def __init__(self, channel, engine, set_id, ranks, data, control):
        from mpi4py import MPI

        self.channel, self.engine, self.set_id, self.ranks = channel, engine, set_id, tuple(ranks)
        self.data, self.control = data, control
        self.rank = engine.rank
        self.leader = self.ranks[0]
        self.is_leader = self.rank == self.leader
        self._others = [r for r in self.ranks if r != self.rank]
        self._index = {r: i for i, r in enumerate(self.ranks)}
        self._any_source, self._any_tag, self._byte = MPI.ANY_SOURCE, MPI.ANY_TAG, MPI.BYTE
        self._status = MPI.Status()
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
        self._lones = {}                       # (id(record), the name's UTF-8 length) -> what lone calls keep
        self._lone_bytes = 0                   # (alone._Lone: the buffers they hold, bounded)
        self._next_record_id = 0
        self._records = {}                     # rank -> {id: record}
        self._leader_closed = None
        self._told = False                     # the closing word is sent (leader) or answered (member)
        self._closing_since = None
        self._gone = set()                     # members whose last announcement here has arrived ("g", "c")
        self._acks = set()
        self._inspected = 0.0
        self._awaited = {}                     # key -> [(deadline, callback)]: run once its op is decided here
        self._deferred = {}                    # key -> this rank's entry failed as a conflict, its error held back
        self._fusion_bytes = engine.settings.fusion_bytes

    def busy(self):
        """Whether ops are announced here and not yet run (read from any thread: a hint, not a promise)."""
        return bool(self._mine or self._ordered or self._awaited)

    def in_flight(self, now):
        """``[(entry, missing ranks)]`` of this rank's announced ops (for the engine's watch: reads copies)."""
        waiting = {key: missing for key, _, missing in self._board.waiting(now)}
        return [(e, waiting.get(e.key, [])) for e in list(self._mine.values())]

    def step(self, now, done=None):
        """One round of work: announce, read mail (until ``done()``), order (leader), run. True if anything moved."""
        moved = False
        new = self.channel.take_queue()
        if new:
            self._announce(new, now)
            moved = True
        closing = self.channel.closing_reason()
        if self._others:
            moved |= self._receive(now, done)
        if self.channel.requests:
            self._requests(self.channel.take_requests(), now)
        if self._awaited:
            self._check_awaited(now)
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
        closed = self.channel.closed
        if closed is not None:
            for e in entries:
                self._complete(e, error=HorovodInternalError(f"{e.label}: {closed}"))
            return
        items, complete, passed = [], [], self._passed(entries)
        for e in entries:
            self._mine[e.key] = e
            data = self._data_of(e)
            if e.key in self._failed_joined:
                self._mine.pop(e.key)
                self._complete(e, error=HorovodInternalError(f"{e.label}: a rank has joined; only allreduce runs "
                                                             "while ranks are joined"))
                continue
            announcement = Announcement(e.record, e.info, e.args[0] if e.local else None, passed.get(e.key, 0))
            if self._board.add(self.rank, e.key, announcement, now):
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
            self._send_all(("a", (self.rank, items, passed) if passed else (self.rank, items)))
        if JOIN in self._board:
            self._check_joined([e.key for e in entries] if JOIN not in self._mine else self._board.keys(), now)
        for key in complete:
            if self._board.complete(key):
                self._heard_all(key, now)

    def _passed(self, entries):
        """key -> how many conflicts of its name this rank has passed (:meth:`_fail`), for those it has any."""
        passed = self.engine.conflicts_passed
        return {e.key: passed[user_name(e.key)] for e in entries if user_name(e.key) in passed} if passed else {}

    def _record_id(self, record):
        """``(id, new)``: the id ``record`` is announced under, and whether it must go with it this once."""
        kept, record_id = self._record_ids.get(id(record), (None, None))  # one record per distinct op (ops): cheap keys
        if kept is record:
            return record_id, False
        if len(self._record_ids) >= RECORD_IDS:  # ever-new shapes: start the ids again (each is sent with its
            self._record_ids.clear()             # record, so the members' tables of ids stay as small)
            self._lones.clear()                  # (the lone announcements hold the old ids)
            self._lone_bytes = 0
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
            message = self._next_message()
            if message is None:
                return moved
            moved = True
            kind, body = message
            self._act(kind, body, now)
            if kind == "a" and done is not None and done():
                return True

    def _next_message(self):
        """The next message a member sent as ``(kind, body)``, or None; one announced alone comes raw."""
        status = self._status
        message = self.control.improbe(self._any_source, self._any_tag, status)
        if message is None:
            return None
        if status.Get_tag() != ALONE_TAG:
            return message.recv()
        rank, record_id, name, data = parse_alone(self._receive_alone(message))
        return "a", (rank, [(name.decode(errors="surrogatepass"), record_id, None, None, data)])

    def _act(self, kind, body, now):
        """Act on one message from a member."""
        if kind == "a":
            self._heard(now, *body)
        elif kind == "d":
            self._batch += 1
            self._ordered.extend((self._batch, *order) for order in body)
        elif kind == "w":
            self._withdrawn(*body)
        elif kind == "k":  # a member's answer to the leader's word that the set is closed
            self._acks.add(body)
        elif kind == "g":
            self._gone.add(body)
        else:  # the leader has closed the set: so must this member
            self._gone.add(self.leader)
            self._leader_closed = body
            self.channel.close(body)

    def _heard(self, now, rank, items, passed=None):
        """``rank`` announced ``items``; ``passed``: key -> conflicts of its name the rank had passed, if any."""
        records = self._records.setdefault(rank, {})
        complete = []
        for key, record_id, record, info, data in items:
            if record is not None:
                records[record_id] = record
            else:
                record = records[record_id]
            if key in self._failed_joined:
                continue  # failed here already: a rank has joined, and only allreduces run
            if self._board.add(rank, key, Announcement(record, info, data, passed.get(key, 0) if passed else 0), now):
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
                    f"{self._label_of(key)}: rank(s) {ranks} have joined; only allreduce runs while ranks are joined"))
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

    # Conflicts across process sets (negotiation.conflicts): both ops fail, and neither rank goes on early.

    def _withdraw(self, key, submitted, why, partner, confirm):
        """Ask the leader to fail this rank's op ``key`` another set's leader found in conflict, if undecided;
        and tell that leader (``confirm``: its rank, its op's error) it was, so it fails its own.

        Sent on the control communicator after the op's announcement and
        before any later op of its name, so the leader cannot take it for another.
        """
        entry = self._mine.get(key) or self._deferred.get(key)  # (failed as a conflict, not told yet: confirmed)
        runs = self._ordered_as(key, RUN) or any(order[0] == key for order in self._to_order)
        if entry is None or entry.submitted != submitted or self._board.complete(key) or runs:
            return  # decided since, or a later op of that name: the conflict was seen in a stale report
        self.engine.confirm(confirm[0], partner, confirm[1], (self.set_id, key))
        if key not in self._mine:
            return
        if self.is_leader:
            self._withdrawn(self.rank, key, why, partner)
        else:
            self._send(self.leader, ("w", (self.rank, key, why, partner)))

    def _ordered_as(self, key, action):
        """Whether op ``key`` is in the leader's order with ``action`` (RUN: matched, in no conflict whatever a
        report said; FAIL: failed already), not yet carried out here."""
        return any(k == key and a == action for _, k, a, _ in self._ordered)

    def _withdrawn(self, rank, key, why, partner):
        """The leader's side: ``rank`` withdrew its op ``key``; fail it on every member if it is undecided and
        waits for a rank that submitted the partner (``(set, key, its ranks)``) instead."""
        failing = self._ordered_as(key, FAIL)  # (found here too)
        waits_for_them = any(not self._board.has(key, r) for r in partner[2] if r in self._index)
        if self._board.has(key, rank) and not self._board.complete(key) and not failing and waits_for_them:
            self._order([(key, FAIL, (True, why, partner, tuple(self._board.partial(key))))])

    def _confirmed(self, key, rank, error, theirs):
        """The leader's side: ``rank`` confirmed its op ``theirs`` (``(set, key)``) conflicts with op ``key``
        here (:meth:`_inspect`; ``error``: its error, and when the board first heard it): fail it, if it
        still waits for that rank."""
        error, since = error
        failing = self._ordered_as(key, FAIL)
        if self._board.since(key) == since and not self._board.complete(key) and not self._board.has(key, rank) \
                and not failing:
            self._order([(key, FAIL, (True, error, theirs, tuple(self._board.partial(key))))])

    def _fail(self, entry, now, mismatch, text, partner=None):
        """Fail ``entry`` as the leader ordered; one that conflicts with an op on another set (``partner``) only
        once this rank has seen every op of its name on its other sets decided: a rank that went on before
        could announce its next op of that name on a set where one, failed by its leader, is still pending.
        Only the ops heard by then, or announced before their ranks went on past a conflict of that name as
        often as this one (:meth:`Engine.conflict_passed`): a later one is a member's next op, which waits
        for this rank's. (Either alone misses one: a message not read yet; a member whose count is not this
        rank's.)"""
        error = (CollectiveMismatchError if mismatch else HorovodInternalError)(text)
        if partner is None:
            return self._complete(entry, error=error)
        name = user_name(entry.key)
        self._deferred[entry.key] = entry

        def deliver():  # (on whichever driver's thread decides the last of those ops: a dict's pop is atomic)
            self._deferred.pop(entry.key, None)
            self.engine.conflict_passed(name)
            self._complete(entry, error=error)
        self.engine.after_decided(name, self.set_id, (now, self.engine.conflicts_passed.get(name, 0)), deliver)

    def _requests(self, requests, now):
        """Other threads' requests: withdraw an op, fail one whose conflict is confirmed, or run a callback once
        an op is decided here."""
        for what, *args in requests:
            if what == "withdraw":
                self._withdraw(*args)
            elif what == "confirmed":
                self._confirmed(*args)
            else:  # ("after", name, (heard, passed), callback): each op of that name heard by then or announced
                name, (heard, passed), callback = args  # before its rank passed more conflicts is decided once it
                keys = [k for k in self._board.keys() if user_name(k) == name and (  # leaves the board (5 probes)
                    self._board.since(k) <= heard or any(a.passed <= passed for a in self._board.partial(k).values()))]
                countdown = Countdown(len(keys), callback)
                for key in keys:
                    self._awaited.setdefault(key, []).append((now + 5 * PROBE_S, countdown.one))

    def _check_awaited(self, now):
        for key in [key for key, waiting in self._awaited.items() if waiting[0][0] <= now]:
            for _, callback in self._awaited.pop(key):
                callback()

    def _done(self, key, now, ranks=None):
        """Op ``key`` is decided: the announcements of ``ranks`` (default all) leave the board."""
        for _, callback in self._awaited.pop(key, ()) if self._awaited else ():
            callback()
        if self._board.take(key, now, ranks):
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
                self._complete(entry, error=as_runtime_error(exc, entry.label))
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
                    self._fail(entry, now, *payload[:3])
                self._done(key, now, *payload[3:])
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
        if entry.kind == "call":  # an engine change (a process set added or removed, the timeline stopped)
            try:
                result = self.engine.run_call(decision.record, entry.args, self.data)
            except Exception as exc:  # noqa: BLE001 - the caller gets it from synchronize
                return self._complete(entry, error=as_runtime_error(exc, entry.label))
            return self._complete(entry, result)
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
                self._complete(e, error=as_runtime_error(exc, e.label))
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

    def _label_of(self, key):
        """How errors name op ``key`` here, from what its members announced (an engine change by what it is)."""
        return op_label(key, [a.record for a in self._board.partial(key).values()])

    def _complete(self, entry, result=None, error=None):
        # The name is free before anyone waiting hears of it, so a caller may reuse it at once. (No lock:
        # a set's discard is atomic, and no submit can be adding this key while its op is in flight.)
        self.channel.in_flight.discard(entry.key)
        if error is not None:
            entry.pending.fail(error)
        else:
            entry.pending.succeed(result)

    # Closing, and the leader's inspection.

    def _finish_closing(self, reason, now):
        """Close: the leader fails what has not run everywhere; a member waits for the leader's word.

        With ``handshake`` (the set is being removed, its communicators freed) every member also waits for
        the leader's word and answers it, and the leader waits for every answer: nothing is left on its way
        on a communicator whose id MPI may give to the next one.
        """
        if self._closing_since is None:
            self._closing_since = now
            if not self.channel.handshake and self._others:
                self._send_all(("g", self.rank))
        if self._hears_last_words(now):
            return False
        if self.is_leader:
            if not self._told:
                if self._to_order:
                    self._flush_orders()
                ordered = {key for _, key, _, _ in self._ordered}
                self._order([(key, FAIL, (False, f"{self._label_of(key)}: {reason}")) for key in self._board.keys()
                             if key not in ordered])
                if self._others:
                    self._send_all(("c", self.engine.as_told(reason)))
                self._told = True
            if self.channel.handshake and len(self._acks) < len(self._others):
                return False
        else:
            if self._leader_closed is None and (self.channel.handshake or self._mine or self._ordered):
                return False
            if self.channel.handshake and not self._told:
                self._send(self.leader, ("k", self.rank))
                self._told = True
        self._run_ordered(now)
        closed = self._leader_closed or reason
        left = list(self._mine.values()) + self.channel.set_closed(closed)
        self._mine = {}
        for e in left:
            self._complete(e, error=HorovodInternalError(f"{e.label}: {closed}"))
        self._requests(self.channel.take_requests(), now)  # (none come once the set has closed)
        self._check_awaited(float("inf"))  # nothing will be decided here now
        return True

    def _hears_last_words(self, now):
        """Whether to keep reading before failing what is left: on a shutdown (not a failure, not a set's
        removal) a member may have finished an op computed on the spot and shut down at once, while its
        peers still wait for a third member's announcement of it, sent and on its way. Each member sends
        "g" after its last announcement (the leader's "c" says as much), on the same communicator, so once
        every member an op waits for has said so, nothing more will come for it."""
        if self.engine.failed or self.channel.handshake or now - self._closing_since > LAST_WORD_S:
            return False
        for key, entry in self._mine.items():
            announced = self._board.partial(key)
            if entry.local and any(r not in announced and r not in self._gone for r in self._others):
                return True
        return False

    def _inspect(self, now):
        """The leader's watch over ops not every member has announced: conflicts, Horovod's stall warnings."""
        waiting = self._board.waiting(now)
        if not waiting:
            return
        failed, elsewhere = conflicts(self.set_id, self.ranks, waiting, self.engine.reports, PROBE_S)
        here = [(key, FAIL, (True, error, None, tuple(self._board.partial(key)))) for key, error, p in failed if not p]
        if here:
            self._order(here)
        errors = {key: error for key, error, _ in failed}  # (one across sets fails once a rank confirms it)
        for rank, set_id, key, submitted, why, partner in elsewhere:  # (the op's since: this one, not a later)
            self.engine.withdraw(rank, set_id, key, submitted, why, partner, (errors[partner[1]],
                                                                              self._board.since(partner[1])))
        self.engine.stall_check(self.set_id, self.ranks, waiting, now)

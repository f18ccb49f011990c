"""Who drives a process set's ops: the queue any thread submits to, and the thread that runs them when nobody does.

The engine (:mod:`ringtrain.engine.core`) keeps a :class:`Channel` for every
process set this rank belongs to. Any thread may call its public methods
(submit, drive, close, the watch's looks); they share the queue, the names in
flight and whether the set is closing, under the channel's lock. What a
set's members say to each other is the :class:`~ringtrain.engine.protocol.Protocol`
(:mod:`ringtrain.engine.protocol`), which only the thread holding the driver
lock runs, and which therefore takes no lock of its own.

Who runs it. Whoever holds the channel's driver lock: the caller's own
thread inside ``synchronize`` (no hand-off, the common case), or else the
channel's thread, which takes over ops nobody has come for within one
cycle (``HOROVOD_CYCLE_TIME``, 1 ms; :mod:`ringtrain.engine.settings`) and
sleeps, costing nothing, while the set is idle. Only the driver calls MPI on
the set's communicators.
"""

import os
import threading
import time

from .errors import DuplicateNameError, HorovodInternalError
from .handles import Entry
from .protocol import Protocol

__all__ = ["Channel", "Entry"]

WATCH_S = 0.1       # the thread keeps watching this long after the set was last busy, then sleeps
WATCH_MAX_S = 0.008  # the longest it waits between looks while watching
SPIN_S = 50e-6      # how long a driver waiting for a message spins before it yields the core
YIELD_S = 0.005     # how long it yields before it starts to sleep
SLOW_S = 0.01       # the longest sleep between polls, once a wait has lasted a while


class Channel:
    """One process set's queue, names in flight and driver; its :class:`~ringtrain.engine.protocol.Protocol`.

    Args:
        engine: the :class:`~ringtrain.engine.core.Engine` (its rank, settings, reports, timeline).
        set_id: the process set's id.
        ranks: the set's ranks (of the runtime's communicator), in order.
        data, control: communicators over ``ranks``, in that order.
    """

    def __init__(self, engine, set_id, ranks, data, control):
        self.engine, self.set_id = engine, set_id
        self.protocol = Protocol(self, engine, set_id, ranks, data, control)
        self.leader, self.is_leader = self.protocol.leader, self.protocol.is_leader
        self._lock = threading.Lock()          # the queue's; taken bare where nobody waits (cheaper than _cond)
        self._cond = threading.Condition(self._lock)
        self._driver = threading.Lock()
        self._driving = False
        self._queue = []                       # submitted, not yet announced
        self.requests = []                     # other threads' requests for the driver (Protocol._requests)
        self.in_flight = set()                 # keys from submit until the op completes
        self._closing = None
        self.closed = None                     # why the set's ops fail, once it has closed
        self.handshake = False                 # closing for good: members answer the leader's word
        self._stopped = False
        self._parked = False
        self._last_drive = 0.0
        self._thread = None
        self._cycle_s = engine.settings.cycle_s
        self._interval = self._cycle_s

    # What the protocol asks of the queue (on the driver's thread).

    def take_queue(self):
        """The ops submitted since the last call (the driver announces them)."""
        if not self._queue:
            return self._queue
        with self._lock:
            new, self._queue = self._queue, []
        return new

    def take_requests(self):
        """Other threads' requests since the last call: ops to withdraw or fail in a conflict, callbacks to run
        once an op is decided."""
        with self._lock:
            taken, self.requests = self.requests, []
        return taken

    def queued(self):
        """Whether ops are queued, not yet announced (a hint: another thread may be adding one)."""
        return bool(self._queue)

    def closing_reason(self):
        """Why the set is closing, while it is and has not closed; else None."""
        return self._closing if self.closed is None else None

    def set_closed(self, reason):
        """The set has closed with ``reason``: no op is taken from now on; returns the ops still queued."""
        with self._cond:
            self.closed = reason
            left, self._queue = self._queue, []
            self._closing = None
        return left

    # The caller's side.

    def submit(self, entry):
        """Queue ``entry``; ValueError if its name is in flight here; HorovodInternalError once closed."""
        entry.pending.channel = self
        with self._lock:
            reason = self.closed or self._closing
            if reason is not None:
                raise HorovodInternalError(f"{entry.label}: {reason}")
            if entry.key in self.in_flight:
                raise DuplicateNameError(f"{entry.label}: an op of this name is already in flight on this rank; "
                                         "wait for it (synchronize) or use another name")
            self.in_flight.add(entry.key)
            self._queue.append(entry)
            if self._thread is None:
                self._start_thread()
            elif self._parked:
                self._cond.notify()

    def request(self, *request):
        """Ask the driver for something only it may do (:meth:`Protocol._requests`); False once the set has closed.

        ``("withdraw", key, submitted, why, partner, confirm)``: if this
        rank's op ``key`` is the one submitted at ``submitted`` and still
        undecided (another set's leader found it in conflict), tell that leader
        (``confirm``) and have this set's leader fail it.
        ``("confirmed", key, rank, error, theirs)``: ``rank`` confirmed the
        conflict of this set's op ``key``: the leader fails it with ``error``.
        ``("after", name, (heard, passed), callback)``: call ``callback`` once
        every op of that name now on the board, heard by ``heard`` or announced
        by a rank that had passed at most ``passed`` conflicts of it, is decided.
        """
        with self._lock:
            if self.closed is not None:
                return False
            self.requests.append(request)
            if self._thread is None:
                self._start_thread()
            elif self._parked:
                self._cond.notify()
        return True

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
                alone = self._alone(pending)
                if alone is None or not self.protocol.run_alone(alone, SPIN_S, YIELD_S):
                    self._drive_until(pending.done)
            finally:
                self._release_driver()

    def run_now(self, entry):
        """Run ``entry``, a blocking op no other thread has seen, on this thread; return once it has finished.

        A small allreduce on an idle set runs alone straight away: it is
        never queued, so no handle, no queue and no look at the queue stand
        between the caller and its peers. Anything else is submitted and
        driven as ``synchronize`` drives it.
        """
        pending = entry.pending
        pending.channel = self
        if self._claim_alone(entry):
            try:
                if not self.protocol.run_alone(entry, SPIN_S, YIELD_S):
                    self._drive_until(pending.done)
            finally:
                self._release_driver()
        else:
            self.submit(entry)
        if not pending.finished:
            pending.complete()

    def _claim_alone(self, entry):
        """Take the driver and put ``entry``'s name in flight if the set is idle and ``entry`` may run alone."""
        if not self._idle() or not self._driver.acquire(False):
            return False
        try:
            if self.protocol.can_run_alone(entry):
                with self._lock:  # (another thread may have submitted since: its op goes first, through the queue)
                    claimed = self._idle()
                    if claimed:
                        self.in_flight.add(entry.key)
                if claimed:
                    self._driving = True
                    return True
        except BaseException:  # (a Ctrl-C here must not leave the set without a driver for good)
            self._driver.release()
            raise
        self._driver.release()
        return False

    def _idle(self):
        """Nothing queued or in flight on this rank, and the set open."""
        return not (self._queue or self.in_flight or self._closing is not None or self.closed is not None)

    def _alone(self, pending):
        """The entry of ``pending`` taken off the queue if it is the only op and may run alone, else None."""
        queue = self._queue
        if len(queue) != 1 or queue[0].pending is not pending or self._closing is not None or self.closed is not None \
                or not self.protocol.can_run_alone(queue[0]):
            return None
        with self._lock:
            if len(self._queue) != 1:  # another thread submitted meanwhile
                return None
            return self._queue.pop()

    def close(self, reason, handshake=False):
        """Stop taking ops: those not run yet fail with ``reason`` on every member (any thread; returns at once).

        ``handshake``: every member confirms (for a set whose communicators are about to be freed).
        """
        with self._cond:
            self.handshake = self.handshake or handshake
            if self._closing is None and self.closed is None:
                self._closing = reason
            self._start_thread()  # a leader that never submitted must still tell its members
            self._cond.notify_all()

    def finish_close(self, timeout=None):
        """Drive until this channel is closed (after :meth:`close`); True when it is."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.closed is None:
            if deadline is not None and time.monotonic() > deadline:
                return False
            if self._take_driver(blocking=True, timeout=0.05):
                try:
                    self._drive_until(lambda: self.closed is not None, deadline)
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
        found = self.protocol.in_flight(time.monotonic()) + [(e, []) for e in list(self._queue)]
        return sorted(found, key=lambda pair: pair[0].submitted)

    def idle_poll(self, now):
        """A leader reads its mail while it has nothing to run (the engine's watch calls it), to see stalls."""
        if not self.is_leader or self._has_work() or not self._take_driver(blocking=False):
            return
        try:
            self.protocol.step(now)
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
            moved = self.protocol.step(now, done)
            now = time.monotonic()
            if moved:  # (a step that moved may have finished the op: no pause before done() is asked again)
                since = now
            elif now - since > SPIN_S:
                if deadline is not None and now > deadline:
                    return
                _pause(now - since, self._cycle_s)

    def _has_work(self):
        return bool(self._queue or self.requests or self.protocol.busy() or (self._closing and not self.closed))

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

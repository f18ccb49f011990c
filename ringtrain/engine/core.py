"""The engine behind Horovod's collectives: one per :func:`~ringtrain.engine.runtime.init`, and its failure model.

The contract.

* **Collective calls.** Every op (``allreduce``, ``allgather``,
  ``broadcast``, ``alltoall``, ``reducescatter``, ``barrier``, their
  async and grouped forms) is collective over its process set: every
  member must submit an op of the same name (unnamed ops are named
  ``noname.<n>`` by a counter per process set, kind and thread, so ranks
  making the same unnamed calls in the same order on the same thread
  match, and two threads' unnamed ops never pair: :class:`Names
  <ringtrain.engine.negotiation.Names>`). ``join`` is collective over
  every rank; so are ``init``, ``shutdown``, ``add_process_set``,
  ``remove_process_set`` and ``stop_timeline``, in the same order everywhere.
* **Ordering.** Within a process set, ranks may submit named ops in any
  order. Each member tells every other member what it submits
  (:mod:`ringtrain.engine.channel`); once a member has heard an op from every
  member it knows, as they all do, whether it fails (they disagree), is
  computed on the spot (a small CPU allreduce, broadcast or barrier: its
  data came with the announcements), or is a collective, which every member
  runs in the order the set's leader (its lowest rank) sends. Process sets
  do not wait on each other: each has a channel with communicators of its
  own, so a set's ops complete as soon as its members have submitted them,
  whatever ranks outside it do (sleep, compute, or wait in another set's op).
* **Threading.** ``synchronize`` (and every blocking op) runs its process
  set's work on the caller's thread when no other thread is; a channel's
  own thread runs ops nobody has come for within a cycle
  (``HOROVOD_CYCLE_TIME``, default 1 ms), and sleeps while the set is idle.
  One watch thread per engine wakes four times a second. MPI must grant
  ``MPI_THREAD_MULTIPLE`` (mpi4py's default): several threads call it, each
  on communicators of its own.
* **Disagreement.** Ranks that submit one name with different kinds,
  process sets, dtypes, shapes, ops, factors (NaN on every rank agrees),
  roots, trailing dimensions or grouped lengths all get a
  :class:`CollectiveMismatchError` (a ``HorovodInternalError``). A rank
  that refuses an op on its own arguments (bad splits, an unsupported
  tensor) raises ``ValueError``, and its peers get an error naming it.
  A name is in flight from submit until its op completes (synchronized or
  not): submitting it again meanwhile raises ``ValueError`` on that rank.

What fails how.

* **A rank that raises** (an uncaught exception, Ctrl-C): its traceback is
  printed, every other rank's pending and later ops fail with a
  ``HorovodInternalError`` naming the rank, the error and the op, and after
  :data:`GRACE_S` the job is ended with ``MPI_Abort``. A rank killed by a
  signal is ended by ``mpirun``, which ends the job.
* **A rank that shuts down** (``hvd.shutdown()``, or the end of its
  script, ``sys.exit`` included): as in Horovod, every other rank's ops
  still pending and later ones fail ("rank R has been shut down"); ops
  this rank left pending fail on it. ``shutdown`` never waits for another
  rank (``MPI_Finalize`` waits for the ranks still running, as MPI does).
* **A stall** (some members never submit an op): every
  ``HOROVOD_STALL_CHECK_TIME_SECONDS`` (60) the set's leader prints
  Horovod's warning naming the op and the missing ranks;
  ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS`` (default off) then shuts the
  engine down on every rank, failing the waiting ops;
  ``HOROVOD_STALL_CHECK_DISABLE=1`` turns both off.
* **ringtrain's bound** (``ringtrain.comm.set_timeout``,
  ``RINGTRAIN_TIMEOUT``; off by default): an op of this rank that has not
  finished within it fails, the rank prints one line naming the op and the
  ranks that have not submitted it, and the job is ended with ``MPI_Abort``.
* **Helpers that run around the engine** (``broadcast_parameters``,
  ``broadcast_object``, ``allgather_object``, ``broadcast_optimizer_state``,
  the ``DistributedOptimizer``'s reductions, ``SyncBatchNorm``) are plain
  collectives on a communicator, called inside :meth:`Engine.helper`: one
  called once the engine is broken raises ``HorovodInternalError`` at once;
  one that is inside MPI when a peer shuts down, fails or stalls can never
  return (nothing interrupts a blocking MPI call), so after
  :data:`HELPER_GRACE_S` the rank prints a line naming it and the job is
  ended with ``MPI_Abort``; past ringtrain's bound the same, naming it.
"""

import itertools
import sys
import threading
import time

from ..comm.guard import HINT, get_timeout
from ..failure import describe
from .channel import Channel
from .handles import Countdown, Entry
from .protocol import PROBE_S, TICK_S
from .errors import HorovodInternalError
from .handles import Pending
from .negotiation import Call, Names, Refused, op_key, stall_report, thread_label

__all__ = ["Engine", "Entry", "GRACE_S", "HELPER_GRACE_S"]

NOTICE_TAG = 11
GRACE_S = 1.5  # between a failure and MPI_Abort: time for every rank to print how its ops failed
# A helper still inside MPI this long after a peer left cannot be waiting for anything but that peer: a peer
# that had done its part before it left lets the helper return within moments, even on a loaded machine.
HELPER_GRACE_S = 5.0
SHUT_DOWN_HERE = "ringtrain's engine has been shut down on this rank; call hvd.init() again"


class Engine:
    """The channels of the process sets this rank is in, the notices between ranks, and the watch.

    Collective over ``comm`` (the runtime's communicator): every rank builds one in ``init``. ``sets``
    (:class:`~ringtrain.engine.process_sets.ProcessSets`) owns the communicators the channels run over;
    ``settings`` (:class:`~ringtrain.engine.settings.Settings`) is what the environment set, read once.
    """

    def __init__(self, comm, sets, settings):
        self.user_comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.sets = sets
        self.settings = settings
        self.stall_times = settings.stall_times
        for note in settings.notes:
            sys.stderr.write(f"[ringtrain.engine] WARNING {note}\n")
        self.names = Names()
        self.reports = {}           # rank -> [(process set, key, submitted)] it has waited on longest (conflicts)
        self.conflicts_passed = {}  # name -> how many conflicts of it across sets this rank's callers were told of
        self.timeline = None        # a ringtrain Timeline while start_timeline is on
        self.timeline_path = None
        self.broken = None          # why ops fail now, once this engine is shutting down
        self.failed = False         # a rank failed: the job is ending, so nothing is freed
        self._told = (None, None)   # (this rank's shutdown, as its peers read it)
        self._peer_gone = None      # when word came that a peer shut down, failed or stalled
        self._helpers = {}          # token -> (label, started): helpers inside their collectives now
        self._tokens = itertools.count()
        self._notices = comm.Dup()
        self._notice_lock = threading.Lock()
        self._sends = []
        self.channels = {0: Channel(self, 0, range(self.size), *sets.engine_comms(0))}
        self._stop = threading.Event()
        self._reported = []
        self._warned = {}           # set id -> when its leader last printed a stall warning
        self._watch = threading.Thread(target=self._watch_main, name="ringtrain-hvd-watch", daemon=True)
        self._watch.start()

    # Submitting.

    def channel(self, set_id):
        channel = self.channels.get(set_id)
        if channel is None:
            raise ValueError(f"process set {set_id} is not registered on this rank; call hvd.add_process_set()")
        return channel

    def submit(self, set_id, entry):
        """Queue ``entry`` on its process set's channel (HorovodInternalError once the engine is broken)."""
        self._channel_for(set_id, entry).submit(entry)
        return entry.pending

    def run_now(self, set_id, entry):
        """:meth:`submit` ``entry`` and wait for it on this thread (:meth:`Channel.run_now
        <ringtrain.engine.channel.Channel.run_now>`): its Pending, finished."""
        self._channel_for(set_id, entry).run_now(entry)
        return entry.pending

    def _channel_for(self, set_id, entry):
        """The channel ``entry`` goes to (HorovodInternalError once the engine is broken)."""
        if self.broken is not None:
            raise HorovodInternalError(f"{entry.label}: {self.broken}")
        channel = self.channels.get(set_id)
        return self.channel(set_id) if channel is None else channel  # (channel() explains a missing one)

    def call(self, what, detail=(), args=()):
        """Run the engine change ``what`` on every rank, in the same order as every other op of set 0.

        Collective over every rank; returns :meth:`run_call`'s result. ``detail`` is what the ranks must
        agree on; ``args`` what this rank's change needs (the set to register, the events to write).
        """
        from .handles import register, synchronize

        key = op_key("call", self.names.next(0, "call"))
        entry = Entry(key, what, "call", Call(what, tuple(detail)), None, tuple(args), Pending())
        return synchronize(register(self.submit(0, entry)))

    def run_call(self, record, args, comm):
        """An engine change, on the thread driving set 0, when its turn comes (``comm``: every rank's)."""
        if record.what == "add_process_set":
            ps, ranks = args[0], record.detail
            set_id = self.sets.register(ps, ranks, comm)
            if self.rank in ranks:
                self.add_channel(set_id, ranks, *self.sets.engine_comms(set_id))
            return ps
        if record.what == "remove_process_set":
            set_id, = record.detail
            self.drop_channel(set_id, f"process set {set_id} was removed")
            self.sets.unregister(set_id)
            return True
        from ..training.timeline import Timeline  # stop_timeline: rank 0 writes every rank's events

        events, path = args
        everyone = comm.gather(events, root=0)
        if comm.Get_rank() == 0 and path:
            Timeline.write(path, everyone)
        return True

    def add_process_set(self, ps):
        """Register ``ps`` on every rank (collective over every rank); returns it."""
        problem = self.sets.problem(ps)
        if problem is not None:
            self.refuse("add_process_set", problem)
            raise ValueError(problem)
        return self.call("add_process_set", tuple(ps.ranks), (ps,))

    def remove_process_set(self, ps):
        """Unregister ``ps`` on every rank and free its communicators (collective over every rank)."""
        set_id = self.sets.removable(ps)
        return self.call("remove_process_set", (set_id,))

    def refuse(self, kind, problem, set_id=0, name=None):
        """Tell a set's leader this rank refused an op on its own arguments, so every member fails it too.

        The caller then raises ``ValueError(problem)`` on this rank; nothing waits for this op here.
        """
        name = self.names.next(set_id, kind, thread_label(threading.current_thread())) if name is None else name
        entry = Entry(op_key(kind, name), f"{kind} {name!r}", kind, Refused(kind, problem), None, (), Pending())
        try:
            self.submit(set_id, entry)
        except (HorovodInternalError, ValueError):
            pass  # broken, not a member, or the name is in flight: the caller's ValueError says enough

    def helper(self, label):
        """A context for a helper's collectives on a communicator of its own (see the module docstring).

        Raises HorovodInternalError at once if the engine is broken (a peer
        has shut down or failed: the helper would wait for it for ever).
        """
        return _Helper(self, label)

    # Process sets' channels (made and dropped inside run_call(), on every rank in the same order).

    def add_channel(self, set_id, ranks, data, control):
        """Start the channel of a process set this rank is in, over two communicators of ``ranks``."""
        self.channels[set_id] = Channel(self, set_id, ranks, data, control)

    def drop_channel(self, set_id, reason):
        """Close a process set's channel on every member: its undecided ops fail (collective over the set)."""
        channel = self.channels.pop(set_id, None)
        if channel is not None:
            channel.close(reason, handshake=True)
            channel.finish_close()
            channel.stop()

    # The failure model.

    def shutdown(self):
        """Fail what is pending and tell every rank this one has shut down; the channels' threads end."""
        if self.broken is None:
            told = f"rank {self.rank} has been shut down (ops after a rank's shutdown fail, as in Horovod)"
            self._told = (SHUT_DOWN_HERE, told)
            self._tell_everyone(told, failure=False)
            self._break(SHUT_DOWN_HERE, failure=False)
        for set_id in sorted(self.channels):
            self.channels[set_id].finish_close(timeout=30.0)
        for channel in self.channels.values():
            channel.stop()
        self._stop.set()
        self._watch.join(5)
        self.channels = {}

    def as_told(self, reason):
        """``reason`` as another rank should read it: this rank's own shutdown is, there, this rank's."""
        return self._told[1] if reason == self._told[0] else reason

    def fail_job(self, reason):
        """This rank failed: every rank's ops fail with ``reason`` (the job is about to be aborted)."""
        self._tell_everyone(reason, failure=True)
        self._break(reason, failure=True)

    def stall_shutdown(self, reason):
        """A set's leader saw an op wait past HOROVOD_STALL_SHUTDOWN_TIME_SECONDS: shut down on every rank."""
        self._tell_everyone(reason, failure=False)
        self._break(reason, failure=False)
        self._peer_gone = self._peer_gone or time.monotonic()

    def excepthook(self, previous):
        """``sys.excepthook`` while the engine runs: print, fail every rank's ops, then end the job."""
        def hook(exc_type, exc, tb):
            previous(exc_type, exc, tb)
            if self.size == 1 or self._stop.is_set():
                return
            secondary = self.failed
            reason = f"rank {self.rank} raised {describe(exc)}"
            sys.stderr.write(f"rank {self.rank}: {describe(exc)}\n")
            self.fail_job(reason)
            if not secondary:  # the first failure: let every rank hear of it and print its op's error
                deadline = time.monotonic() + GRACE_S
                for channel in list(self.channels.values()):
                    channel.finish_close(timeout=max(0.0, deadline - time.monotonic()))
                time.sleep(max(0.0, deadline - time.monotonic()))
            sys.stdout.flush()
            sys.stderr.flush()
            self.user_comm.Abort(1)

        return hook

    def _break(self, reason, failure):
        if failure:
            self.failed = True
        if self.broken is None:
            self.broken = reason
        for channel in list(self.channels.values()):
            channel.close(reason)

    def _tell_everyone(self, reason, failure):
        for r in range(self.size):
            if r != self.rank:
                self._notice(r, ("p", self.rank, reason, failure))

    def _read_notices(self):
        """Act on the notices other ranks sent: ``("r", rank, waiting)`` its report of ops it has waited on;
        ``("w", leader, set, key, submitted, why, partner, error)`` withdraw that op of this rank's (a leader
        found a conflict); ``("y", rank, (set, key), error, theirs)`` its op ``theirs`` was undecided, so fail
        ``key`` here; ``("p", rank, reason, failure)`` a peer shut down or failed."""
        from mpi4py import MPI

        with self._notice_lock:
            while True:
                message = self._notices.improbe(MPI.ANY_SOURCE, NOTICE_TAG)
                if message is None:
                    break
                kind, rank, *body = message.recv()
                if kind == "r":
                    self.reports[rank] = body[0]
                elif kind == "w":
                    self._withdraw(*body[:5], (rank, body[5]))
                elif kind == "y":
                    self._confirmed(rank, *body)
                else:
                    self._peer_gone = self._peer_gone or time.monotonic()
                    if self.broken is None or (body[1] and not self.failed):
                        self._break(body[0], failure=body[1])
            self._sends = [r for r in self._sends if not r.Test()]

    # The watch: notices, idle leaders' mail, reports, and ringtrain's bound.

    def _watch_main(self):
        while not self._stop.wait(TICK_S):
            try:
                self._read_notices()
                now = time.monotonic()
                for channel in list(self.channels.values()):
                    channel.idle_poll(now)
                self._report(now)
                self._check_bound(now)
                self._check_helpers(now)
            except Exception as exc:  # noqa: BLE001 - a watch that dies silently would hide every later stall
                if self._stop.is_set():
                    return
                sys.stderr.write(f"[ringtrain.engine] rank {self.rank}: the watch thread failed: {describe(exc)}\n")
                return

    def _report(self, now):
        """Tell every rank which ops this one has waited on for long (so leaders can name a conflict)."""
        waiting = sorted((c.set_id, e.key, e.submitted) for c in list(self.channels.values())
                         for e, _ in c.entries() if now - e.submitted >= PROBE_S)
        if waiting == self._reported:
            return
        self._reported = self.reports[self.rank] = waiting
        for r in range(self.size):
            if r != self.rank:
                self._notice(r, ("r", self.rank, waiting))

    def withdraw(self, rank, set_id, key, submitted, why, partner, error):
        """Have ``rank`` withdraw its op ``key`` on ``set_id``, the one it submitted at ``submitted``: a set's
        leader (this rank) found it conflicts with its op ``partner`` (``(set, key, ranks)``), which it fails
        with ``error`` (its error, and which op of that name: Protocol._confirmed) once ``rank`` confirms
        that op is still undecided there
        (:func:`~ringtrain.engine.negotiation.conflicts`; what a rank reported may be stale)."""
        if rank == self.rank:
            return self._withdraw(set_id, key, submitted, why, partner, (rank, error))
        self._notice(rank, ("w", self.rank, set_id, key, submitted, why, partner, error))

    def _withdraw(self, set_id, key, submitted, why, partner, confirm):
        channel = self.channels.get(set_id)
        if channel is not None:
            channel.request("withdraw", key, submitted, why, partner, confirm)

    def confirm(self, leader, partner, error, theirs):
        """Tell ``leader`` this rank's op ``theirs`` (``(set, key)``) was undecided when asked to withdraw it:
        the leader fails its op ``partner`` (``(set, key, ranks)``) with ``error`` (Protocol._withdraw)."""
        if leader == self.rank:
            return self._confirmed(self.rank, partner[:2], error, theirs)
        self._notice(leader, ("y", self.rank, partner[:2], error, theirs))

    def _confirmed(self, rank, partner, error, theirs):
        channel = self.channels.get(partner[0])
        if channel is not None:
            channel.request("confirmed", partner[1], rank, error, theirs)

    def _notice(self, rank, message):
        with self._notice_lock:
            self._sends.append(self._notices.isend(message, dest=rank, tag=NOTICE_TAG))

    def after_decided(self, name, but, since, callback):
        """Call ``callback`` once every op named ``name`` on this rank's sets other than ``but`` has been
        decided there (failed or run): those on their boards now that were heard by ``since[0]`` or announced
        by ranks that had passed at most ``since[1]`` conflicts of that name (any thread; see Protocol._fail)."""
        channels = [c for set_id, c in list(self.channels.items()) if set_id != but]
        countdown = Countdown(len(channels), callback)
        for channel in channels:
            if not channel.request("after", name, since, countdown.one):
                countdown.one()

    def conflict_passed(self, name):
        """This rank's caller is told of a conflict of ``name`` across process sets (Protocol._fail; any thread)."""
        with self._notice_lock:
            self.conflicts_passed[name] = self.conflicts_passed.get(name, 0) + 1

    def stall_check(self, set_id, ranks, waiting, now):
        """A set's leader's look at its ``waiting`` ops: Horovod's stall warning, and its shutdown."""
        check_s, shutdown_s = self.stall_times
        if check_s is None or now - self._warned.get(set_id, 0.0) < check_s:
            return
        message, shut_down = stall_report(set_id, ranks, waiting, check_s, shutdown_s)
        if message is None:
            return
        self._warned[set_id] = now
        sys.stderr.write(f"[ringtrain.engine] {'ERROR' if shut_down else 'WARNING'} rank {self.rank}: {message}\n")
        sys.stderr.flush()
        if shut_down:
            late = sorted({r for _, age, missing in waiting if age > shutdown_s for r in missing})
            self.stall_shutdown(f"process set {set_id} stalled: rank(s) {late} kept an op waiting "
                                f"more than {shutdown_s:g}s (HOROVOD_STALL_SHUTDOWN_TIME_SECONDS)")

    def _check_bound(self, now):
        bound = get_timeout(self.user_comm)
        if bound is None or self.size == 1:
            return
        for channel in list(self.channels.values()):
            for entry, missing in channel.entries():
                if now - entry.submitted > bound:
                    return self._time_out(channel, entry, missing, bound)

    def _time_out(self, channel, entry, missing, bound):
        who = (f"; rank(s) {missing} have not submitted it" if missing else
               f"; process set {channel.set_id}'s leader (rank {channel.leader}) has not matched it")
        line = f"rank {self.rank}: {entry.label} did not finish within {bound:g}s{who} ({HINT})"
        entry.pending.fail(HorovodInternalError(line))
        self._end(line, f"rank {self.rank} timed out: {entry.label} did not finish within {bound:g}s{who}",
                  min(GRACE_S, bound))

    def _check_helpers(self, now):
        """End the job when a helper is stuck in MPI: past ringtrain's bound, or after a peer has gone."""
        if not self._helpers or self.size == 1:
            return
        bound = get_timeout(self.user_comm)
        for label, started in list(self._helpers.values()):
            if bound is not None and now - started > bound:
                what = f"{label} did not finish within {bound:g}s"
                return self._end(f"rank {self.rank}: {what} ({HINT})", f"rank {self.rank} timed out: {what}",
                                 min(GRACE_S, bound))
            gone = self._peer_gone
            if gone is not None and now - max(gone, started) > HELPER_GRACE_S:
                line = f"rank {self.rank}: {label} cannot finish: {self.broken}; ending the job"
                return self._end(line, line, GRACE_S)

    def _end(self, line, reason, grace):
        """Print ``line``, fail every rank's ops with ``reason``, give them ``grace`` to print theirs, abort."""
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
        self.fail_job(reason)
        time.sleep(grace)
        sys.stdout.flush()
        self.user_comm.Abort(1)


class _Helper:
    """The context of :meth:`Engine.helper`: registered with the watch while it runs (cheap: it wraps hooks)."""

    __slots__ = ("engine", "label", "token")

    def __init__(self, engine, label):
        self.engine, self.label, self.token = engine, label, None

    def __enter__(self):
        engine = self.engine
        if engine.broken is not None:
            raise HorovodInternalError(f"{self.label}: {engine.broken}")
        self.token = next(engine._tokens)
        engine._helpers[self.token] = (self.label, time.monotonic())
        return self

    def __exit__(self, *exc_info):
        self.engine._helpers.pop(self.token, None)
        return False

"""Matching ops across the ranks of a process set by name (pure: no MPI, no threads).

Every member of a process set tells every other member what it submits:
an :class:`Announcement` under the op's key, whose ``record`` is what
every member must agree on (a frozen record per kind: :class:`Allreduce`'s
dtype, shape, op and factors, :class:`Broadcast`'s root, ...), ``info``
what may differ (an allgather's rows, an alltoall's splits) and ``data`` a
small op's bytes. Every member keeps
the announcements on a :class:`Board`; once every member has announced an
op, :func:`verdict` says, the same on every rank, what becomes of it:

* ``FAIL``: the ranks disagree (kind, dtype, shape, op, factors, root,
  trailing dimensions, grouped length), one refused it on its own
  arguments, or it is not an allreduce while a rank has joined;
* ``LOCAL``: a small allreduce, broadcast or barrier whose data came with
  the announcements: every rank computes the result itself, no collective;
* ``ORDERED``: a collective. Ranks may submit ops in different orders, so
  the set's leader (its lowest rank) decides the order in which every
  member runs these, and sends it.

Names are per kind, as in Horovod (an allreduce and a broadcast may share
one): the key of an op is ``"<kind>.<name>"``; unnamed ops are named
``noname.<n>`` by a counter per process set, kind and thread
(:class:`Names`), so ranks making the same unnamed calls in the same order
on the same thread match, and two threads' unnamed ops never pair.
"""

import dataclasses
import math
import threading
import typing
import weakref

__all__ = ["Allreduce", "Reducescatter", "Allgather", "Alltoall", "Broadcast", "Barrier", "Join", "Joined",
           "Refused", "Grouped", "Call", "Announcement", "Verdict", "Board", "Names", "thread_label", "verdict",
           "first_difference", "same_value", "op_key", "user_name", "op_label", "join_blocks", "Conflicts", "conflicts",
           "stall_report", "JOIN", "JOINED", "FAIL", "LOCAL", "ORDERED"]

FAIL, LOCAL, ORDERED = "fail", "local", "ordered"


# The op records: what every member must agree on, one frozen record per kind (Horovod's Request). Records
# compare by value; a rank sends each distinct one once, then only its id (the channel).

@dataclasses.dataclass(frozen=True, slots=True)
class _Reduction:
    dtype: str
    shape: tuple
    op: str
    prescale: float
    postscale: float
    device: str

    @property
    def nbytes(self):
        """The size in bytes of the array it describes."""
        return math.prod(self.shape) * _itemsize(self.dtype)

    def fuse_key(self):
        """What reductions fused into one buffer must share: everything but the shape.

        Factors are compared by ``repr``, so NaN factors fuse alike on every rank.
        """
        return (self.kind, self.dtype, self.op, repr(self.prescale), repr(self.postscale), self.device)


@dataclasses.dataclass(frozen=True, slots=True)
class Allreduce(_Reduction):
    kind: typing.ClassVar[str] = "allreduce"


@dataclasses.dataclass(frozen=True, slots=True)
class Reducescatter(_Reduction):
    kind: typing.ClassVar[str] = "reducescatter"


@dataclasses.dataclass(frozen=True, slots=True)
class Allgather:
    dtype: str
    trailing_shape: tuple
    device: str
    kind: typing.ClassVar[str] = "allgather"


@dataclasses.dataclass(frozen=True, slots=True)
class Alltoall:
    dtype: str
    trailing_shape: tuple
    device: str
    kind: typing.ClassVar[str] = "alltoall"


@dataclasses.dataclass(frozen=True, slots=True)
class Broadcast:
    dtype: str
    shape: tuple
    root: int           # a rank of the process set's communicator
    device: str
    kind: typing.ClassVar[str] = "broadcast"


@dataclasses.dataclass(frozen=True, slots=True)
class Barrier:
    kind: typing.ClassVar[str] = "barrier"


@dataclasses.dataclass(frozen=True, slots=True)
class Join:
    kind: typing.ClassVar[str] = "join"


@dataclasses.dataclass(frozen=True, slots=True)
class Joined:
    """A joined rank's answer to an op it did not submit (it adds zeros to an allreduce)."""

    kind: typing.ClassVar[str] = "joined"


@dataclasses.dataclass(frozen=True, slots=True)
class Refused:
    """A rank refused an op of ``kind`` on its own arguments: every member fails it with ``problem``."""

    kind: str
    problem: str


@dataclasses.dataclass(frozen=True, slots=True)
class Grouped:
    """A grouped op: one record per array, run as one op (compared by count, then part by part)."""

    kind: str
    parts: tuple


@dataclasses.dataclass(frozen=True, slots=True)
class Call:
    """An engine change every member runs in the global set's order: a process set added or removed, the
    timeline stopped. ``detail`` is what the ranks must agree on (the set's ranks, its id)."""

    what: str
    detail: tuple = ()
    kind: typing.ClassVar[str] = "call"


def _itemsize(dtype):
    return 2 if dtype == "bfloat16" else _ITEMSIZES.setdefault(dtype, _numpy_itemsize(dtype))


def _numpy_itemsize(dtype):
    import numpy as np

    return np.dtype(dtype).itemsize


_ITEMSIZES = {}


class Announcement(typing.NamedTuple):
    """What a member announced for an op: its record, what may differ (``info``), a small op's ``data``, and
    how many conflicts of its name across process sets the member had passed (``Protocol._fail``)."""

    record: object
    info: object = None
    data: object = None
    passed: int = 0


# The key join() announces. A rank that has joined answers every allreduce it
# did not submit with JOINED (it adds zeros) until every rank has joined.
JOIN = "join.__ringtrain__"
JOINED = Joined()


def op_key(kind, name):
    """The key ops are matched by: ``"<kind>.<name>"`` (pure)."""
    return f"{kind}.{name}"


def user_name(key):
    """The name the user gave (or ``noname.<n>``) from an op's key (pure)."""
    return key.partition(".")[2]


def op_label(key, records=()):
    """How errors name op ``key``: ``allreduce 'loss'``, or an engine change by what it is (pure).

    ``records``: the op's records heard so far; an engine change (a
    :class:`Call`: ``add_process_set``, ``remove_process_set``) has no name
    of the user's, only a counter's, so it is named by what it does.
    """
    call = next((r for r in records if isinstance(r, Call)), None)
    return call.what if call is not None else f"{key.partition('.')[0]} {user_name(key)!r}"


class Names:
    """Names for unnamed ops, counted per process set, kind and submitting thread.

    Unnamed ops match by the order in which they are submitted, which
    only one thread can fix: two threads that submit in one order on one
    rank and in another on the next would pair one thread's op with the
    other's, silently, if the shapes agree. So each thread's unnamed ops
    are named apart: ``noname.<n>`` for the main thread (Horovod's names),
    ``noname.<thread name>.<n>`` for another; threads the interpreter did
    not start (a framework's autograd workers) share ``noname.foreign.<n>``.
    A thread's ops then pair only with those of the thread of the same name
    on the other ranks (threads started in the same order get the same
    names); one that has no counterpart is reported by the stall inspector
    and fails at ringtrain's bound, like any op a rank never submits.
    """

    def __init__(self):
        self._counts = {}

    def next(self, process_set, kind, thread=None):
        """The next name for an unnamed op; ``thread`` is :func:`thread_label`'s (None: the main thread's)."""
        key = (process_set, kind, thread)
        n = self._counts.get(key, 0)
        self._counts[key] = n + 1
        return f"noname.{n}" if thread is None else f"noname.{thread}.{n}"


def thread_label(thread):
    """What names the unnamed ops of ``thread`` apart (None for the main thread), fixed at its first op.

    A thread's name, and, for the second and later of the live threads of
    one name (in the order they were started), ``#k``: two threads called
    alike would otherwise count their ops as one thread, and pair with each
    other's across ranks. No label a live thread holds is given again.
    Threads started in the same order, and alive together, on every rank get
    the same labels; where a twin ended on one rank and not on another before
    a thread's first op, the labels differ and the ops wait for each other
    (the stall inspector and the bound see to them), never pairing wrongly.
    """
    if thread is threading.main_thread():
        return None
    if isinstance(thread, threading._DummyThread):  # started outside the interpreter: no name of its own
        return "foreign"
    label = _LABELS.get(thread)
    if label is None:
        twins = [t for t in threading.enumerate() if t.name == thread.name]  # (in the order they started)
        k = twins.index(thread) if thread in twins else 0
        held = {held for t, held in list(_LABELS.items()) if t is not thread and t.is_alive()}
        while (label := thread.name if k == 0 else f"{thread.name}#{k}") in held:
            k += 1  # (a twin that ended left its place to one started later: never share a live thread's count)
        _LABELS[thread] = label
    return label


_LABELS = weakref.WeakKeyDictionary()  # thread -> its label, fixed at its first unnamed op


def same_value(a, b):
    """Equality in which NaN equals NaN, elementwise through tuples (pure): ranks that all pass NaN agree."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    return a == b


def first_difference(records):
    """``"<field>: <a> and <b>"`` for the first field on which ``records`` disagree, or None (pure).

    A grouped op's parts are compared by count (``grouped length``), then array by array.
    """
    first = records[0]
    for other in records[1:]:
        if not _same_record(other, first):
            return _difference(first, other)
    return None


def _same_record(a, b):
    return a == b or (type(a) is type(b) and all(same_value(getattr(a, f.name), getattr(b, f.name))
                                                 for f in dataclasses.fields(a)))


def _difference(first, other):
    if type(first) is not type(other):
        return f"kind: {_kind(first)} and {_kind(other)}"
    if isinstance(first, Grouped) and len(first.parts) != len(other.parts):
        return f"grouped length: {len(first.parts)} and {len(other.parts)}"
    if isinstance(first, Grouped):
        i, a, b = next((i, a, b) for i, (a, b) in enumerate(zip(first.parts, other.parts))
                       if not _same_record(a, b))
        return f"tensor {i} {_difference(a, b)}"
    for f in dataclasses.fields(first):
        mine, theirs = getattr(first, f.name), getattr(other, f.name)
        if not same_value(mine, theirs):
            field = "arguments" if isinstance(first, Call) and f.name == "detail" else f.name.replace("_", " ")
            return f"{field}: {mine} and {theirs}"
    return None


def _kind(record):
    """A record's kind as a mismatch names it: a grouped op with its count (one tensor against a group of two)."""
    return f"grouped {record.kind} of {len(record.parts)} tensor(s)" if isinstance(record, Grouped) else record.kind


@dataclasses.dataclass(slots=True)
class Verdict:
    """What every member does with an op every member has announced (the same on every rank)."""

    action: str               # FAIL, LOCAL or ORDERED
    record: object = None     # the agreed record (the first present member's)
    error: str = None         # FAIL: why, the same text on every rank
    mismatch: bool = False    # FAIL because ranks disagreed (a CollectiveMismatchError)
    joined: tuple = ()        # ranks that answered JOINED: they add zeros


def verdict(key, members, by_rank):
    """The verdict on op ``key`` from every member's :class:`Announcement`, in member order (pure).

    Args:
        key: the op's key.
        members: the set's ranks, in order.
        by_rank: rank -> announcement, for every member.
    """
    record = by_rank[members[0]].record
    if type(record) is not Refused and record is not JOINED and _agree(record, members, by_rank):
        # The common case: every member agrees, and none has joined or refused.
        return Verdict(_action(record, members, members, by_rank), record)
    label = op_label(key, [by_rank[r].record for r in members])
    for rank in members:
        refused = by_rank[rank].record
        if type(refused) is Refused:
            return Verdict(FAIL, error=f"{label}: rank {rank} refused it: {refused.problem}", mismatch=True)
    joined = tuple(r for r in members if by_rank[r].record == JOINED)
    present = [r for r in members if r not in joined]
    records = [by_rank[r].record for r in present]
    record = records[0]
    if joined and record.kind != "allreduce":
        return Verdict(FAIL, error=f"{label}: rank(s) {list(joined)} have joined; only allreduce runs while ranks "
                                   "are joined")
    if not all(m == record for m in records):
        difference = first_difference(records)
        if difference is not None:
            return Verdict(FAIL, error=f"{label}: ranks submitted different {difference}; every rank must submit "
                                       "the same op under one name", mismatch=True)
    return Verdict(_action(record, members, present, by_rank), record, joined=joined)


def _agree(record, members, by_rank):
    for r in members:  # (a loop, not all() over a generator: this runs for every op)
        if by_rank[r].record != record:
            return False
    return True


def _action(record, members, present, by_rank):
    """LOCAL when the data every rank needs came with the announcements, else ORDERED (pure)."""
    kind = record.kind
    if kind == "barrier":
        return LOCAL
    if kind == "allreduce" and type(record) is Allreduce:
        # A rank sends its data only for a small CPU op, so data from every rank means one.
        for r in present:
            if by_rank[r].data is None:
                return ORDERED
        return LOCAL
    if kind == "broadcast":
        return LOCAL if by_rank[members[record.root]].data is not None else ORDERED
    return ORDERED


class _Entry:
    __slots__ = ("by_rank", "since", "later")

    def __init__(self, since):
        self.by_rank, self.since, self.later = {}, since, []


class Board:
    """The announcements a member has heard for ops not every member has announced yet, or not yet run.

    A rank may announce a name again as soon as its own op of that name has
    completed, before a slower member has heard every announcement of the
    first; such an announcement waits its turn (``later``) on the board.

    Args:
        members: the set's ranks, in order.
    """

    def __init__(self, members):
        self.members = tuple(members)
        self._entries = {}  # key -> _Entry, in first-announced order

    def __len__(self):
        return len(self._entries)

    def empty(self):
        return not self._entries

    def __contains__(self, key):
        return key in self._entries

    def add(self, rank, key, announcement, now):
        """Record ``rank``'s announcement of ``key``; True when every member has now announced it."""
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _Entry(now)
        if rank in entry.by_rank:
            entry.later.append((rank, announcement))
            return False
        entry.by_rank[rank] = announcement
        return len(entry.by_rank) == len(self.members)

    def has(self, key, rank):
        """Whether ``rank``'s (current) announcement of ``key`` is on the board."""
        entry = self._entries.get(key)
        return entry is not None and rank in entry.by_rank

    def announcements(self, key):
        """rank -> announcement of ``key`` (a complete op's, once :meth:`add` said so)."""
        return self._entries[key].by_rank

    def partial(self, key):
        """rank -> announcement of ``key`` heard so far (empty if none)."""
        entry = self._entries.get(key)
        return entry.by_rank if entry is not None else {}

    def drop(self, key):
        """Forget ``key`` and any announcement of it waiting its turn (its op failed here without a match)."""
        self._entries.pop(key, None)

    def since(self, key):
        """When the board heard ``key``'s op first (what tells it from a later op of that name), or None."""
        entry = self._entries.get(key)
        return None if entry is None else entry.since

    def complete(self, key):
        entry = self._entries.get(key)
        return entry is not None and len(entry.by_rank) == len(self.members)

    def take(self, key, now, ranks=None):
        """Remove ``key``'s announcements (its op is done); True if the next ones of that name are now complete.

        ``ranks``: the ranks whose announcements the op had where it was
        decided (a leader failed it unmatched); a later announcement of
        another rank, heard here first, is kept for the next op of that name.
        """
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        kept = [] if ranks is None else [(r, a) for r, a in entry.by_rank.items() if r not in ranks]
        if not kept and not entry.later:
            return False
        successor = self._entries[key] = _Entry(now)
        for rank, announcement in kept + entry.later:
            if rank in successor.by_rank:
                successor.later.append((rank, announcement))
            else:
                successor.by_rank[rank] = announcement
        return len(successor.by_rank) == len(self.members)

    def waiting(self, now):
        """``[(key, seconds waited, missing ranks)]`` of the ops not every member has announced, oldest first.

        Safe to call from another thread than the one adding (it reads a copy).
        """
        return [(key, now - e.since, [r for r in self.members if r not in e.by_rank])
                for key, e in list(self._entries.items()) if len(e.by_rank) < len(self.members)]

    def keys(self):
        return list(self._entries)


def join_blocks(key, joined, announced):
    """The ranks that have joined, if ``key`` must fail because of them, else None (pure).

    Only allreduces run while ranks are joined (they add zeros); any other
    op fails at once, without waiting for a match, once a rank that has
    joined (``joined``, in the order heard) has not submitted it: it never will.
    """
    if not joined:
        return None
    record = next((a.record for a in announced.values() if a.record != JOINED), None)
    if record is None or record.kind == "allreduce":
        return None
    if all(j in announced and announced[j].record != JOINED for j in joined):
        return None
    return sorted(joined)


class Conflicts(typing.NamedTuple):
    """What :func:`conflicts` found: ops this set's leader fails, and ops of other sets their ranks must withdraw."""

    failed: list      # [(key, error, partner)]: this set's ops, failed on every member; partner: the
    #                   ``(set, key)`` it conflicts with when that is on another set, else None
    elsewhere: list   # [(rank, set, key, submitted, error, partner)]: ``rank``'s op ``key`` on another set, the
    #                   one it submitted at ``submitted`` (its clock), for that rank to withdraw; partner:
    #                   ``(this set, key, the ranks that submitted it)``: only an op that waits for one of
    #                   them is withdrawn (an op merely waiting for a late rank is not in conflict)


def conflicts(process_set, members, waiting, reports, probe_s):
    """What to fail for ops a missing rank submitted differently: another kind, or another process set (pure).

    Both ops of a conflict fail, so that neither, left waiting, pairs with
    the next op of its kind and name, one step off, silently. A partner on
    this set fails here; a partner on another set (whose leader may not see
    the conflict: its own missing ranks' ops may have failed by then) is
    returned in ``elsewhere``, for the ranks that submitted it to withdraw.

    Args:
        process_set, members: the id and ranks of the set ``waiting`` belongs to.
        waiting: :meth:`Board.waiting`'s list.
        reports: rank -> ``[(process set, key, submitted)]`` of the ops that rank has waited on longest.
        probe_s: how long an op waits before it is compared (ops in flight in
            different orders are not conflicts; only ops that stay unmatched are).
    """
    found, elsewhere, waiting_here = {}, [], {key: missing for key, _, missing in waiting}
    for key, age, missing in waiting:
        if age < probe_s or user_name(key).startswith("noname.") or key in found:  # unnamed: two sets, two ops
            continue
        theirs = {}  # missing rank -> the first op of this name it reports otherwise
        for rank in missing:
            other = next((o for o in reports.get(rank, ()) if user_name(o[1]) == user_name(key)
                          and o[:2] != (process_set, key)), None)
            if other is not None:
                theirs[rank] = other
        if not theirs:
            continue
        rank, (their_set, partner, _) = next(iter(theirs.items()))
        if their_set != process_set:
            found[key] = (_conflict(key, partner, [rank], their_set, process_set), (their_set, partner))
            here = tuple(r for r in members if r not in missing)
            why = _conflict(partner, key, list(here), process_set, their_set)
            elsewhere += [(r, their_set, partner, theirs[r][2], why, (process_set, key, here))
                          for r in sorted(theirs) if theirs[r][:2] == (their_set, partner)]
            continue
        found[key] = (_conflict(key, partner, [rank], their_set, process_set), None)
        # The ranks missing from the partner that submitted this op instead: if any, its ranks fail it now
        # too, whatever its age and the reports so far.
        by = [r for r in waiting_here.get(partner, ()) if r not in missing]
        if by and partner not in found:
            found[partner] = (_conflict(partner, key, by, process_set, process_set), None)
    return Conflicts([(key, *found[key]) for key in found], elsewhere)


def _conflict(key, theirs, ranks, their_set, process_set):
    """The error of op ``key`` whose name ``ranks`` submitted as op ``theirs`` on set ``their_set`` (pure)."""
    mine, other = key.partition(".")[0], theirs.partition(".")[0]
    who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"
    return (f"{mine} {user_name(key)!r}: {who} submitted it as {other} on process set {their_set}, not {mine} on "
            f"process set {process_set}; every rank must submit the same op under one name")


def stall_report(process_set, ranks, waiting, warn_s, shutdown_s):
    """Horovod's stall warning for ``waiting`` ops older than ``warn_s``, and whether to shut down (pure).

    Returns ``(message, shut_down)``; message is None when nothing has waited
    that long. ``shutdown_s`` of 0 never shuts down; ranks marked ``!`` have
    kept an op waiting longer than it.
    """
    missing, stalled = {}, set()
    for key, age, absent in waiting:
        if age <= warn_s:
            continue
        for rank in absent:
            missing.setdefault(rank, []).append(key)
            if shutdown_s and age > shutdown_s:
                stalled.add(rank)
    if not missing:
        return None, False
    lines = [f"process set {process_set} (ranks {list(ranks)}): one or more tensors were submitted to be reduced, "
             "gathered or broadcasted by subset of ranks and are waiting for remainder of ranks for more than "
             f"{warn_s:g} seconds. This may indicate that different ranks are trying to submit different tensors "
             "or that only subset of ranks is submitting tensors, which will cause deadlock.", "Missing ranks:"]
    for rank in sorted(missing):
        names = missing[rank]
        shown = ", ".join(names[:6]) + (" ..." if len(names) > 6 else "")
        lines.append(f"{rank}{'!' if rank in stalled else ''}: [{shown}]")
    if stalled:
        lines.append(f'One or more rank (marked by "!") is stalled for longer than {shutdown_s:g} seconds. '
                     "Will shutdown.")
    return "\n".join(lines), bool(stalled)

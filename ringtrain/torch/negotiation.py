"""Matching ops across the ranks of a process set by name, as Horovod's coordinator does (pure: no MPI, no threads).

Every process set has a leader, its lowest rank. Each member tells the
leader what it submits: an announcement ``(name, meta, info)``, where
``meta`` is what every member must agree on (kind, dtype, shape, op, root,
...) as ``(field, value)`` pairs and ``info`` what may differ (an
allgather's rows, an alltoall's splits). The leader keeps them in a
:class:`Table`; :meth:`Table.decide` returns the ops every member has now
announced, in the order they were first announced, each a
:class:`Decision` to run or to fail. The leader sends the same decisions,
in the same order, to every member, and every member runs them in that
order: ranks may submit named ops in any order, and ranks that disagree on
an op all get the same error instead of waiting for ever.

Names are per kind, as in Horovod (an allreduce and a broadcast may share
one): the key of an op is ``"<kind>.<name>"``, and unnamed ops are named
``noname.<n>`` by a counter per process set and kind (:class:`Names`), so
ranks making the same unnamed calls in the same order match.
"""

import dataclasses
import math

__all__ = ["Decision", "Table", "Names", "first_difference", "same_value", "refusal", "op_key", "user_name",
           "conflicts", "stall_report", "JOIN", "RUN", "FAIL"]

# The name join() announces. A rank that has joined counts as present for
# every other allreduce until every rank has joined (it adds zeros).
JOIN = "join.__ringtrain__"
RUN, FAIL = "run", "fail"


def op_key(kind, name):
    """The key ops are matched by: ``"<kind>.<name>"`` (pure)."""
    return f"{kind}.{name}"


def user_name(key):
    """The name the user gave (or ``noname.<n>``) from an op's key (pure)."""
    return key.partition(".")[2]


class Names:
    """Names for unnamed ops: ``noname.<n>``, counted per process set and kind."""

    def __init__(self):
        self._counts = {}

    def next(self, process_set, kind):
        n = self._counts.get((process_set, kind), 0)
        self._counts[(process_set, kind)] = n + 1
        return f"noname.{n}"


def same_value(a, b):
    """Equality in which NaN equals NaN, elementwise through tuples (pure): ranks that all pass NaN agree."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    return a == b


def first_difference(metas):
    """``"<field>: <a> and <b>"`` for the first field on which ``metas`` disagree, or None (pure).

    A grouped op's ``parts`` are compared by count (``grouped length``), then tensor by tensor.
    """
    first = metas[0]
    for other in metas[1:]:
        if not same_value(other, first):
            return _difference(first, other)
    return None


def _difference(first, other):
    mine = dict(first)
    for field, value in other:
        if field not in mine or same_value(mine[field], value):
            continue
        if field == "parts":
            if len(mine[field]) != len(value):
                return f"grouped length: {len(mine[field])} and {len(value)}"
            i, a, b = next((i, a, b) for i, (a, b) in enumerate(zip(mine[field], value)) if not same_value(a, b))
            return f"tensor {i} {_difference(a, b)}"
        return f"{field}: {mine[field]} and {value}"
    return f"fields: {[f for f, _ in first]} and {[f for f, _ in other]}"


def refusal(meta):
    """The message of a rank that refused an op on its own arguments (its ``refused`` field), or None (pure)."""
    for field, value in meta:
        if field == "refused":
            return value
    return None


@dataclasses.dataclass
class Decision:
    """What every member does with one op: run it, or fail it with ``error``."""

    name: str                 # the op's key
    verdict: str              # RUN or FAIL
    meta: tuple               # the agreed fields (the first announcer's)
    infos: list               # each member's info, in member order (None for a member that joined)
    joined: tuple = ()        # members that did not announce it but have joined: they add zeros
    error: object = None      # why it failed (FAIL), the same text on every rank
    result: object = None     # JOIN's result: the rank that joined last
    mismatch: bool = False    # failed because ranks disagreed (CollectiveMismatchError)


@dataclasses.dataclass
class _Waiting:
    by_rank: dict             # rank -> (meta, info), in announcement order
    since: float              # when the first announcement arrived (the leader's clock)


class Table:
    """The ops announced to a process set's leader that not every member has announced yet.

    Args:
        members: the set's ranks, in order.
    """

    def __init__(self, members):
        self.members = tuple(members)
        self._waiting = {}  # key -> _Waiting; dicts keep insertion (first-announced) order
        self._joined = {}   # rank -> order of its join, until every member has joined
        self._order = 0

    def __len__(self):
        return len(self._waiting)

    def announce(self, rank, name, meta, info, now):
        """Record that ``rank`` submitted op ``name``."""
        waiting = self._waiting.get(name)
        if waiting is None:
            waiting = self._waiting[name] = _Waiting({}, now)
        waiting.by_rank[rank] = (meta, info)
        if name == JOIN and rank not in self._joined:
            self._order += 1
            self._joined[rank] = self._order

    def decide(self):
        """The ops now decided, in first-announced order, taken out of the table."""
        decided = []
        for name, waiting in list(self._waiting.items()):
            decision = self._decision(name, waiting.by_rank)
            if decision is not None:
                del self._waiting[name]
                decided.append(decision)
        return decided

    def _decision(self, name, by_rank):
        missing = [r for r in self.members if r not in by_rank]
        kind = dict(next(iter(by_rank.values()))[0]).get("kind")
        # Only allreduces run while a rank is joined; any other op fails at
        # once on the ranks that announced it, without waiting for a match.
        if self._joined and name != JOIN and kind != "allreduce":
            return self._make(name, by_rank, FAIL, error=f"{kind} {user_name(name)!r}: rank(s) "
                              f"{sorted(self._joined)} have joined; only allreduce runs while ranks are joined")
        if name == JOIN:
            if missing:
                return None
            last = max(self._joined, key=self._joined.get)
            self._joined.clear()
            return self._make(name, by_rank, RUN, result=last)
        if any(r not in self._joined for r in missing):
            return None
        return self._make(name, by_rank, RUN, joined=tuple(missing))

    def _make(self, name, by_rank, verdict, joined=(), error=None, result=None):
        present = [r for r in self.members if r in by_rank]
        metas = [by_rank[r][0] for r in present]
        mismatch = False
        if verdict == RUN:
            error = _disagreement(name, present, metas)
            verdict, mismatch = (RUN, False) if error is None else (FAIL, True)
        infos = [by_rank[r][1] if r in by_rank else None for r in self.members]
        return Decision(name, verdict, metas[0], infos, joined, error, result, mismatch)

    def fail_all(self, error):
        """Fail every op still waiting with ``error`` (the set is closing); returns the decisions."""
        decided = [self._make(name, w.by_rank, FAIL, error=f"{_label(name, w.by_rank)}: {error}")
                   for name, w in self._waiting.items()]
        self._waiting.clear()
        return decided

    def fail(self, name, error):
        """Fail one waiting op with ``error``; its decision, or None if it is not waiting."""
        waiting = self._waiting.pop(name, None)
        if waiting is None:
            return None
        return self._make(name, waiting.by_rank, FAIL, error=error)

    def waiting(self, now):
        """``[(key, seconds waited, missing ranks)]`` of the ops not yet decided, oldest first."""
        return [(name, now - w.since, [r for r in self.members if r not in w.by_rank and r not in self._joined])
                for name, w in self._waiting.items()]


def _label(name, by_rank):
    kind = dict(next(iter(by_rank.values()))[0]).get("kind", "op")
    return f"{kind} {user_name(name)!r}"


def _disagreement(name, ranks, metas):
    """The error every member fails with when ranks disagree on an op, or None (pure)."""
    for rank, meta in zip(ranks, metas):
        refused = refusal(meta)
        if refused is not None:
            return f"{_label(name, {rank: (meta, None)})}: rank {rank} refused it: {refused}"
    difference = first_difference(metas)
    if difference is None:
        return None
    return (f"{_label(name, {ranks[0]: (metas[0], None)})}: ranks submitted different {difference}; every "
            "rank must submit the same op under one name")


def conflicts(process_set, waiting, reports, probe_s):
    """``[(key, error)]`` for ops a missing rank submitted differently: another kind, or another process set (pure).

    Args:
        process_set: the id of the set ``waiting`` belongs to.
        waiting: :meth:`Table.waiting`'s list.
        reports: rank -> ``[(process set, key)]`` of the ops that rank has waited on longest.
        probe_s: how long an op waits before it is compared (ops in flight in
            different orders are not conflicts; only ops that stay unmatched are).
    """
    found = []
    for key, age, missing in waiting:
        if age < probe_s:
            continue
        for rank in missing:
            other = next(((ps, k) for ps, k in reports.get(rank, ()) if user_name(k) == user_name(key)
                          and (ps, k) != (process_set, key)), None)
            if other is not None:
                mine, theirs = key.partition(".")[0], other[1].partition(".")[0]
                found.append((key, f"{mine} {user_name(key)!r}: rank {rank} submitted it as {theirs} on process "
                                   f"set {other[0]}, not {mine} on process set {process_set}; every rank must "
                                   "submit the same op under one name"))
                break
    return found


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

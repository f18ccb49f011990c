"""Matching ops across ranks by name, as Horovod's coordinator does (pure: no MPI).

Each round every rank announces the ops it has been given since the last
round: ``(name, process set, meta, info)``. ``meta`` is what every rank must
agree on (kind, dtype, shape, op, root, ...), as ``(field, value)`` pairs;
``info`` is what may differ (an allgather's first dimension, an alltoall's
splits). Every rank merges everyone's announcements in rank order into its
own :class:`Table`, so every table is the same, and :meth:`Table.merge`
returns the ops that every member has now announced, in the order they were
first announced: every rank then runs them in that same order.
"""

import dataclasses

__all__ = ["Ready", "Table", "first_difference", "SHUTDOWN", "JOIN"]

SHUTDOWN = "__ringtrain_shutdown__"  # the name shutdown() announces; ready when every rank has
# The name join() announces. A rank that has joined counts as present for
# every other op until every rank has joined (it adds zeros to allreduces).
JOIN = "__ringtrain_join__"


@dataclasses.dataclass
class Ready:
    """An op every member of its process set has announced."""

    name: str
    process_set: int
    meta: tuple               # the agreed fields (rank ``ranks[0]``'s, when they disagree)
    infos: list               # each member's info, in member order
    ranks: tuple              # the members, in order
    mismatch: str = None      # None, or what differs between ranks
    joined: tuple = ()        # members that did not announce it but have joined
    last_joined: int = -1     # for JOIN: the rank that joined last


def first_difference(metas):
    """``"<field>: <a> and <b>"`` for the first field on which ``metas`` disagree, or None (pure)."""
    first = metas[0]
    for other in metas[1:]:
        if other == first:
            continue
        mine = dict(first)
        for field, value in other:
            if mine.get(field, value) != value:
                return f"{field}: {mine[field]} and {value}"
        return f"fields: {[f for f, _ in first]} and {[f for f, _ in other]}"
    return None


class Table:
    """Every announced op that not every member has announced yet, in first-announced order.

    Args:
        members: ``f(process_set) -> tuple of ranks``, the ranks that must announce an op of that set.
    """

    def __init__(self, members):
        self._members = members
        self._waiting = {}  # (process set, name) -> {rank: (meta, info)}; dicts keep insertion order
        self._joined = {}   # rank -> (round, rank) of its join, until every rank has joined
        self._rounds = 0

    def __len__(self):
        return len(self._waiting)

    def waiting(self):
        """``[(name, process set, ranks that announced it)]`` for ops not yet ready (for stall reports)."""
        return [(name, ps, sorted(by_rank)) for (ps, name), by_rank in self._waiting.items()]

    def merge(self, announcements):
        """Add every rank's announcements (a list indexed by rank); return the ops now ready, in order."""
        self._rounds += 1
        for rank, announced in enumerate(announcements):
            for name, ps, meta, info in announced:
                self._waiting.setdefault((ps, name), {})[rank] = (meta, info)
                if name == JOIN:
                    self._joined.setdefault(rank, (self._rounds, rank))
        ready = []
        for key, by_rank in list(self._waiting.items()):
            ps, name = key
            ranks = tuple(self._members(ps))
            missing = tuple(r for r in ranks if r not in by_rank)
            # Only allreduces run while a rank is joined; any other op fails at
            # once on the ranks that announced it, without waiting for a match.
            refused = bool(self._joined) and name not in (JOIN, SHUTDOWN) and _kind(by_rank) != "allreduce"
            if missing and not refused and (name == JOIN or any(r not in self._joined for r in missing)):
                continue
            del self._waiting[key]
            present = [r for r in ranks if r in by_rank]
            metas = [by_rank[r][0] for r in present]
            op = Ready(name, ps, metas[0], [by_rank[r][1] if r in by_rank else None for r in ranks], ranks,
                       first_difference(metas), tuple(sorted(self._joined)) if refused else missing)
            if name == JOIN:
                op.last_joined = max(self._joined.values())[1]
                self._joined.clear()
            ready.append(op)
        return ready


def _kind(by_rank):
    """The kind of op one rank announced (ranks that disagree on it are caught as a mismatch)."""
    meta = next(iter(by_rank.values()))[0]
    return dict(meta).get("kind")

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

__all__ = ["Ready", "Table", "first_difference", "SHUTDOWN"]

SHUTDOWN = "__ringtrain_shutdown__"  # the name shutdown() announces; ready when every rank has


@dataclasses.dataclass
class Ready:
    """An op every member of its process set has announced."""

    name: str
    process_set: int
    meta: tuple               # the agreed fields (rank ``ranks[0]``'s, when they disagree)
    infos: list               # each member's info, in member order
    ranks: tuple              # the members, in order
    mismatch: str = None      # None, or what differs between ranks


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

    def __len__(self):
        return len(self._waiting)

    def waiting(self):
        """``[(name, process set, ranks that announced it)]`` for ops not yet ready (for stall reports)."""
        return [(name, ps, sorted(by_rank)) for (ps, name), by_rank in self._waiting.items()]

    def merge(self, announcements):
        """Add every rank's announcements (a list indexed by rank); return the ops now ready, in order."""
        for rank, announced in enumerate(announcements):
            for name, ps, meta, info in announced:
                self._waiting.setdefault((ps, name), {})[rank] = (meta, info)
        ready = []
        for key, by_rank in list(self._waiting.items()):
            ps, name = key
            ranks = tuple(self._members(ps))
            if len(by_rank) < len(ranks) or any(r not in by_rank for r in ranks):
                continue
            del self._waiting[key]
            metas = [by_rank[r][0] for r in ranks]
            ready.append(Ready(name, ps, metas[0], [by_rank[r][1] for r in ranks], ranks,
                               first_difference(metas)))
        return ready

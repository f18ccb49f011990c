"""A per-rank timeline of each step's phases, in Chrome's trace format.

Like Horovod's timeline: open the file in https://ui.perfetto.dev or
chrome://tracing. Each rank is a process row (``pid`` = rank), each phase of
each step (data, forward+backward, then allreduce and optimizer, or, sharded,
reduce-scatter, optimizer and allgather) a bar on it. With
overlap, the communication thread is a second row of the rank (``tid`` 1)
with one bar per gradient bucket, under the backward it hides behind.
"""

import contextlib
import json
import os
import time

from ..io.rundir import create_new

__all__ = ["Timeline", "THREAD_NAMES"]

THREAD_NAMES = {0: "main", 1: "communication"}


class Timeline:
    """Collects ``(name, step, start, duration)`` spans for one rank; cheap when disabled."""

    def __init__(self, rank, enabled=True, clock=time.perf_counter):
        self.rank = rank
        self.enabled = enabled
        self.events = []
        self._clock = clock
        self._origin = clock()

    @contextlib.contextmanager
    def span(self, name, step=None, tid=0):
        """Record the body as one span named ``name`` on thread row ``tid`` (safe from any thread)."""
        if not self.enabled:
            yield
            return
        start = self._clock()
        try:
            yield
        finally:
            end = self._clock()
            # list.append is atomic, so the communication thread may record too.
            self.events.append({"name": name, "ph": "X", "pid": self.rank, "tid": tid,
                                "ts": round((start - self._origin) * 1e6, 3),
                                "dur": round((end - start) * 1e6, 3),
                                "args": {} if step is None else {"step": step}})

    @staticmethod
    def trace(per_rank_events):
        """A Chrome trace object from every rank's events (a list indexed by rank)."""
        events = []
        for rank, rank_events in enumerate(per_rank_events):
            events.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
                           "args": {"name": f"rank {rank}"}})
            for tid in sorted({e["tid"] for e in rank_events}):
                events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid,
                               "args": {"name": THREAD_NAMES.get(tid, f"thread {tid}")}})
            events.extend(rank_events)
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    @staticmethod
    def write(path, per_rank_events):
        """Write the trace for every rank's events to ``path`` (JSON, replaced atomically).

        The temporary file is new (never written through a symbolic link) and
        is removed if the write fails, a full disk included.
        """
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        tmp = f"{path}.tmp-{os.getpid()}"
        try:
            with os.fdopen(create_new(tmp), "w") as fh:
                json.dump(Timeline.trace(per_rank_events), fh)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

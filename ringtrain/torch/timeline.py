"""``start_timeline`` / ``stop_timeline``: the engine's ops as ringtrain's Chrome trace.

Every rank records a bar per op (a fused run is one bar) on its engine's
row; ``stop_timeline`` gathers them on the engine's thread and rank 0
writes one trace (:class:`ringtrain.training.timeline.Timeline`), each rank
a process row, as Horovod's timeline shows every rank's ops.
"""

from ..training.timeline import Timeline
from . import handles, runtime
from .ops_async import engine, submit

__all__ = ["start_timeline", "stop_timeline"]


def start_timeline(file_path, mark_cycles=False):
    """Start recording every op this rank runs; ``stop_timeline`` writes them to ``file_path`` (collective)."""
    eng = engine()
    eng.timeline = Timeline(runtime.rank())
    eng.timeline_path = str(file_path)


def stop_timeline():
    """Stop recording; rank 0 writes every rank's ops to the path given to ``start_timeline`` (collective)."""
    eng = engine()
    timeline, path = eng.timeline, getattr(eng, "timeline_path", None)
    eng.timeline = None
    events = timeline.events if timeline is not None else []

    def gather(comm):
        everyone = comm.gather(events, root=0)
        if comm.Get_rank() == 0 and path:
            Timeline.write(path, everyone)
        return True

    handles.synchronize(handles.register(submit("call", None, None, (("kind", "stop_timeline"),), None, (gather,))))

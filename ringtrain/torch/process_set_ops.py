"""Adding and removing process sets: collective, run on the engine's thread."""

from . import handles, runtime
from .ops_async import submit
from .process_sets import ProcessSet

__all__ = ["add_process_set", "remove_process_set"]


@runtime.ready_hook
def _add_initial(rt):
    for ps in rt.extras.pop("initial_sets", []):
        add_process_set(ps)


def add_process_set(process_set):
    """Register a process set (a :class:`ProcessSet`, a list of ranks or a communicator) on every rank.

    Collective: every rank must call it, in the same order as other
    process-set changes. Returns the registered :class:`ProcessSet`.
    """
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    return _add(ps)


def remove_process_set(process_set):
    """Unregister a process set on every rank and free its communicator (collective)."""
    if process_set.process_set_id == 0:
        raise ValueError("the global process set cannot be removed")
    return _remove(process_set)


def _add(ps):
    """Register ``ps`` on every rank: its communicator is made on the engine's thread (collective)."""
    registry = runtime.current().extras["process_sets"]
    if ps.mpi_comm is not None:
        from mpi4py import MPI

        world = runtime.communicator().Get_group()
        ps.ranks = sorted(MPI.Group.Translate_ranks(ps.mpi_comm.Get_group(), range(ps.mpi_comm.Get_size()), world))
    if not ps.ranks or ps.ranks[0] < 0 or ps.ranks[-1] >= runtime.size():
        raise ValueError(f"add_process_set: ranks must lie in 0..{runtime.size() - 1}, got {ps.ranks}")
    if ps.process_set_id is not None:
        raise ValueError(f"add_process_set: {ps} is already registered")
    ranks = tuple(ps.ranks)

    def make(comm):
        from mpi4py import MPI

        group = comm.Get_group().Incl(list(ranks))
        sub = comm.Create(group)  # collective over every rank of the engine's communicator
        group.Free()
        ps_id = registry.next_id
        registry.next_id += 1
        ps.process_set_id = ps_id
        registry.sets[ps_id] = ps
        if sub != MPI.COMM_NULL:
            registry.comms[ps_id] = sub
        return ps

    meta = (("kind", "add_process_set"), ("ranks", ranks))
    return handles.synchronize(handles.register(submit("call", None, None, meta, None, (make,))))


def _remove(ps):
    """Unregister ``ps`` on every rank and free its communicator (collective)."""
    registry = runtime.current().extras["process_sets"]
    ps_id = ps.process_set_id
    if ps_id not in registry.sets:
        raise ValueError(f"remove_process_set: {ps} is not registered")

    def drop(comm):
        from ..comm import release

        registry.sets.pop(ps_id, None)
        sub = registry.comms.pop(ps_id, None)
        if sub is not None:
            release(sub)
        ps.process_set_id = None
        return True

    meta = (("kind", "remove_process_set"), ("id", ps_id))
    return handles.synchronize(handles.register(submit("call", None, None, meta, None, (drop,))))

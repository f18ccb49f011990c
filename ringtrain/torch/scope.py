"""Which ranks a helper runs over: a process set's communicator, or the runtime's.

Horovod's helpers take ``process_set=`` (default: every rank). This is the
one place that turns that argument into an mpi4py communicator, so
:mod:`~ringtrain.torch.optimizer`, :mod:`~ringtrain.torch.functions` and
:mod:`~ringtrain.torch.sync_batch_norm` agree on it.
"""

from . import runtime

__all__ = ["communicator_of", "included", "set_rank"]

# (runtime communicator, process set id, ranks) -> this module's communicator over those ranks.
_subsets = {}


def _is_global(process_set):
    return process_set is None or getattr(process_set, "process_set_id", None) == 0


def included(process_set=None):
    """Whether this rank belongs to ``process_set`` (every rank belongs to the global one)."""
    if _is_global(process_set):
        return True
    return bool(process_set.included())


def communicator_of(process_set=None):
    """The communicator of ``process_set``: the runtime's for the global set (ValueError before ``init``).

    A subset gets a communicator of its own, made from the runtime's on
    first use (collective over the set's ranks) and kept: the engine's
    communicators belong to the engine's thread, and two threads must never
    run collectives on one communicator.
    """
    if _is_global(process_set):
        return runtime.communicator()
    if getattr(process_set, "process_set_id", None) is None:
        raise ValueError(f"{process_set!r} is not registered; call hvd.add_process_set() on every rank")
    world = runtime.communicator()
    key = (world.py2f(), process_set.process_set_id, tuple(process_set.ranks))
    comm = _subsets.get(key)
    if comm is None:
        group = world.Get_group().Incl(list(process_set.ranks))
        comm = _subsets[key] = world.Create_group(group)
        group.Free()
    return comm


def set_rank(process_set, rank):
    """``rank`` (of the runtime, as Horovod's ``root_rank`` is given) as a rank of ``process_set``'s communicator.

    Raises:
        ValueError: on every rank of the set, for a rank outside it (passed
            on as it is, it could name another member of the set's
            communicator and broadcast the wrong rank's values).
    """
    if _is_global(process_set):
        return rank
    ranks = list(process_set.ranks)
    if rank not in ranks:
        raise ValueError(f"root_rank {rank} is not in the process set (ranks {ranks})")
    return ranks.index(rank)

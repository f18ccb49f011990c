"""Which ranks a helper runs over: a process set's communicator, or the runtime's.

Horovod's helpers take ``process_set=`` (default: every rank). This is the
one place that turns that argument into an mpi4py communicator, so
:mod:`~ringtrain.torch.optimizer`, :mod:`~ringtrain.torch.functions` and
:mod:`~ringtrain.torch.sync_batch_norm` agree on it.
"""

from . import runtime

__all__ = ["communicator_of", "included"]


def _is_global(process_set):
    return process_set is None or getattr(process_set, "process_set_id", None) == 0


def included(process_set=None):
    """Whether this rank belongs to ``process_set`` (every rank belongs to the global one)."""
    if _is_global(process_set):
        return True
    return bool(process_set.included())


def communicator_of(process_set=None):
    """The communicator of ``process_set``: the runtime's for the global set (ValueError before ``init``)."""
    if _is_global(process_set):
        return runtime.communicator()
    for attribute in ("communicator", "comm", "mpi_comm"):
        comm = getattr(process_set, attribute, None)
        if comm is not None:
            return comm() if callable(comm) else comm
    raise ValueError(f"{process_set!r} has no communicator: was it registered with add_process_set?")

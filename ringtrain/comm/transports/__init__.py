"""The transport registry: every transport by name, made through one function.

As ChainerMN's ``create_communicator`` does for communicators: the caller
names a transport (the size policy, :func:`ringtrain.comm.policy.choose_transport`,
picks the name), and a wrong name lists the right ones. Adding a transport is
a new module with a :class:`~ringtrain.comm.transports.base.Transport` subclass and one
line in :data:`TRANSPORTS`.
"""

from .base import LocalTransport
from .cuda_ipc import CudaIpcTransport
from .hierarchical import HierarchicalTransport
from .mpi import MpiTransport
from .ring import RingTransport
from .shm import WindowTransport

__all__ = ["TRANSPORTS", "create_transport"]

# name -> Transport subclass. "shm" is the name users know the window by (--allreduce shm).
TRANSPORTS = {
    "shm": WindowTransport,
    "cuda-ipc": CudaIpcTransport,
    "ring": RingTransport,
    "mpi": MpiTransport,
    "hierarchical": HierarchicalTransport,
    "local": LocalTransport,
}


def create_transport(name, comm, **options):
    """A transport by name over ``comm``; collective (some transports set up shared state).

    One rank always gets a :class:`~ringtrain.comm.transports.base.LocalTransport`.
    ``options`` go to the transport's ``create`` (the windows take
    ``shared_bytes``). Returns None where the transport cannot serve ``comm``
    (a window across hosts, CUDA IPC where the ranks cannot map each other's
    memory); every rank gets the same answer.

    Raises:
        ValueError: for an unknown name, listing the known ones.
    """
    if name not in TRANSPORTS:
        raise ValueError(f"unknown transport {name!r}; choose one of {', '.join(sorted(TRANSPORTS))}")
    if comm.Get_size() == 1:
        return LocalTransport(comm)
    return TRANSPORTS[name].create(comm, **options)

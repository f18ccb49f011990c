"""The transport registry: every transport by name, made through one function.

As ChainerMN's ``create_communicator`` does for communicators: the caller
names a transport (the size policy, :func:`ringtrain.comm.policy.choose_transport`,
picks the name), and a wrong name lists the right ones. Adding a transport is
a new module with a :class:`~ringtrain.comm.transports.base.Transport` subclass and one
line in :data:`TRANSPORTS`.
"""

from ..policy import choose_transport
from .base import LocalTransport
from .cuda_ipc import CudaIpcTransport
from .hierarchical import HierarchicalTransport
from .mpi import MpiTransport
from .ring import RingTransport
from .shm import WindowTransport

__all__ = ["TRANSPORTS", "create_transport", "open_transport", "same_host"]

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
    ``options`` go to the transport's ``create``: ``device`` (None for host
    buffers, else the GPU the buffers live on) and ``shared_bytes`` (room the
    windows keep for :meth:`share`). Returns None where the transport cannot
    serve ``comm`` (a window across hosts, CUDA IPC where the ranks cannot map
    each other's memory); every rank gets the same answer.

    Raises:
        ValueError: for an unknown name, listing the known ones.
    """
    if name not in TRANSPORTS:
        raise ValueError(f"unknown transport {name!r}; choose one of {', '.join(sorted(TRANSPORTS))}")
    if comm.Get_size() == 1:
        return LocalTransport(comm)
    return TRANSPORTS[name].create(comm, **options)


def same_host(comm):
    """Whether every rank of ``comm`` shares one host (collective)."""
    from mpi4py import MPI

    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    everyone = bool(comm.allreduce(int(node.Get_size() == comm.Get_size()), op=MPI.MIN))
    node.Free()
    return everyone


def open_transport(choice, comm, nbytes, device=None, one_host=None, cache=None, shared_bytes=0):
    """The transport the size policy picks under ``choice`` for ``nbytes`` on ``device``, made over ``comm``.

    The one place a transport is chosen and made: the collectives (through
    :meth:`ringtrain.comm.state.CommState.transport_for`) and the sharded
    step both come here. Collective on first use: every rank calls it with
    the same ``choice``, ``nbytes`` and kind of device.

    Args:
        choice: one of :data:`ringtrain.comm.policy.TRANSPORT_CHOICES` ("auto" is the size policy).
        comm: the communicator.
        nbytes: the buffer's size.
        device: None for host buffers, else the GPU index the buffer lives on.
        one_host: a function answering whether every rank shares one host
            (called only where the choice depends on it); default :func:`same_host`.
        cache: a dict to keep made transports in, keyed by ``(name, device)``:
            a GPU transport and a host one never share a slot (a hierarchical
            transport on CuPy arrays reduces within the host through CUDA IPC,
            on NumPy arrays through the shared-memory window). None is cached
            too (the transport cannot serve ``comm``), so it is not asked again.
        shared_bytes: room for ``share()`` in a window (the sharded step's buffers).

    Returns:
        The transport, or None where ``choice`` cannot apply ("shm" across
        hosts) or the transport cannot serve ``comm``.
    """
    one_host = one_host or (lambda: same_host(comm))
    name = choose_transport(choice, nbytes, one_host() if choice in ("auto", "shm") else False, device is not None)
    if name is None:
        return None
    key = (name, device)
    if cache is not None and key in cache:
        return cache[key]
    transport = create_transport(name, comm, device=device, shared_bytes=shared_bytes)
    if cache is not None:
        cache[key] = transport
    return transport

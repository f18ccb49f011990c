"""GPU arrays staged through pinned host memory, for MPI that cannot read device memory.

Written once for every collective that needs it (the small-call exchange,
the host-staged allreduce, the broadcast). The pinned buffers belong to the
communicator's state (:meth:`ringtrain.comm.state.CommState.buffer`): they
grow to the largest size seen and are reused, so steady-state calls allocate
nothing.
"""

from .. import backend

__all__ = ["pinned_like", "download", "upload"]


def pinned_like(state, x, name="gpu-host"):
    """A reused pinned host array with ``x``'s dtype and length (``name`` keeps separate uses apart)."""
    xp = backend.get_array_module(x)
    return state.buffer(name, x.nbytes, xp, pinned=True)[:x.nbytes].view(x.dtype)


def download(x, host):
    """Copy the CuPy array ``x`` into the host array ``host``; returns ``host``.

    The stream is synchronised first: a kernel still writing ``x`` would
    race the copy, and MPI reads ``host`` as soon as this returns.
    """
    backend.synchronize(x)
    x.get(out=host)
    return host


def upload(host, x):
    """Copy ``host`` back into the CuPy array ``x``; returns ``x``.

    ``set`` may be asynchronous from pinned memory, and the host buffer is
    reused by the next call: the copy must be done before this returns.
    """
    x.set(host)
    backend.synchronize(x)
    return x

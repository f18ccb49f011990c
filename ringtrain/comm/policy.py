"""The size policy: which transport serves a buffer, with every threshold in one place.

Pure: no MPI. :func:`choose_transport` is the only decision; each threshold
carries the measurement behind it, so a new measurement changes one line.
"""

import warnings

__all__ = ["choose_transport", "transport_choice", "TRANSPORT_CHOICES", "ALGORITHMS", "SMALL_BYTES",
           "WINDOW_BYTES", "RING_BYTES", "SEGMENT_BYTES", "SMALL_VALUES"]

# At or below this many bytes, "auto" is latency-bound and carries the data
# with the header (not a transport: see ringtrain.comm.collectives): on the
# shared-memory board on one host, by recursive doubling across hosts.
# Where doubling and the ring cross (docs/performance.md, "The figures behind
# the size policy and the small-call paths").
SMALL_BYTES = 64 << 10
# Up to this many bytes on one host, "auto" reduces through the shared-memory
# window: one copy less per byte than any message-passing path. Larger buffers
# go in several rounds with two barriers each, and on a busy host one late rank
# stalls every barrier; and even idle the ring is level from 8 MiB, because its
# large messages MPICH copies once between processes, and both are then at the
# memory-bandwidth floor (the window against the ring by size: the performance
# page's section named above).
WINDOW_BYTES = 4 << 20
# Below this many bytes (and above SMALL_BYTES, off the window), "auto" hands
# the data to MPI's own collectives; from here up, the ring, which loses to MPI
# on mid-sized buffers and wins on large ones, where MPI's temporary buffer
# leaves glibc's heap for fresh mmap'd, page-faulting memory (figures: the
# performance page's section named above).
RING_BYTES = 4 << 20
# Ring pipeline segment: about half the development machine's 2 MiB L2 cache,
# the fastest of the sizes measured (the performance page's section above).
SEGMENT_BYTES = 1 << 20
# float64 values Transport.sum_small carries (the sharded step's metrics).
SMALL_VALUES = 16

# The user's choices (``transport=`` in the API, ``--allreduce`` on the command
# line); "auto" is the size policy below, "shm" the shared-memory window.
TRANSPORT_CHOICES = ("auto", "ring", "mpi", "hierarchical", "shm")
ALGORITHMS = TRANSPORT_CHOICES  # the old name, kept for importers


def transport_choice(transport, algorithm, who):
    """The choice from ``transport=``, or from the deprecated ``algorithm=`` it replaces (pure, but warns).

    Raises:
        TypeError: when both are given and differ.
    """
    if algorithm is None:
        return transport
    warnings.warn(f"{who}: algorithm= is deprecated; use transport={algorithm!r}", DeprecationWarning,
                  stacklevel=3)
    if transport != "auto" and transport != algorithm:
        raise TypeError(f"{who}: got transport={transport!r} and algorithm={algorithm!r}; pass transport= only")
    return algorithm


def choose_transport(algorithm, nbytes, one_host, gpu=False):
    """The transport that serves a buffer of ``nbytes`` under the choice ``algorithm`` (pure).

    Args:
        algorithm: one of :data:`TRANSPORT_CHOICES`.
        nbytes: the buffer's size.
        one_host: whether every rank of the communicator shares one host.
        gpu: whether the buffer is in GPU memory: the peer window is then
            CUDA IPC ("cuda-ipc") instead of the shared-memory window.

    Returns:
        A name in :data:`ringtrain.comm.transports.TRANSPORTS`, or None where
        ``algorithm`` cannot apply ("shm" across hosts).
    """
    if gpu:
        return _on_gpu(algorithm, nbytes, one_host)
    if algorithm == "auto":
        if one_host and nbytes <= WINDOW_BYTES:
            return "shm"
        return "mpi" if nbytes < RING_BYTES else "ring"
    if algorithm == "shm":
        return "shm" if one_host else None
    if algorithm in ("ring", "mpi", "hierarchical"):
        return algorithm
    raise ValueError(f"unknown transport {algorithm!r}; choose one of {', '.join(TRANSPORT_CHOICES)}")


def _on_gpu(algorithm, nbytes, one_host):
    # The peer window on GPUs is CUDA IPC, at any size. Without a CUDA-aware
    # MPI every other transport stages through host memory, far slower than
    # mapping a peer's device memory (figures: docs/performance.md and
    # docs/gpu.md, from scripts/gpu_acceptance.sh).
    if algorithm in ("auto", "shm") and one_host:
        return "cuda-ipc"
    if algorithm == "shm":
        return None
    return choose_transport(algorithm, nbytes, one_host=False)

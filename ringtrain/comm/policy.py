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
# Measured with `ringtrain bench allreduce` at 2 ranks on the 2-core
# development machine (MPICH 5, shared memory): doubling and the ring cross
# between 32 and 64 KiB.
SMALL_BYTES = 64 << 10
# Up to this many bytes on one host, "auto" reduces through the shared-memory
# window: one copy less per byte than any message-passing path, 2.1-2.6x MPI's
# Allreduce for a 2.6 MiB gradient at 2 ranks. Larger buffers go in several
# rounds with two barriers each, and on a busy host one late rank stalls every
# barrier; and even idle the ring is level from 8 MiB, because its large
# messages MPICH copies once between processes. With the counter barrier
# (ringtrain.comm.arena.SharedArena.sync), idle, 2 ranks, median of 180
# calls: 4 MiB window 0.38 ms against the ring's 0.52; 8 MiB 1.2-1.5 against
# 1.2-1.3; 16 MiB 3.4 against 2.8; 64 MiB 12.9 against 12.6. Both are at
# this machine's memory-bandwidth floor there: the two ranks copying a
# 64 MiB buffer each at the same time take 7.5-8.5 ms, and an allreduce
# moves at least 1.5 buffers' worth per rank.
WINDOW_BYTES = 4 << 20
# Below this many bytes (and above SMALL_BYTES, off the window), "auto" hands
# the data to MPI's own collectives; from here up, the ring. At 2 ranks the
# ring lost to MPI by 15-60% from 128 KiB to 2 MiB, tied at 4-8 MiB, and wins
# from 16 MiB (by 3x from 32 MiB, where MPI's temporary buffer leaves glibc's
# heap for fresh mmap'd, page-faulting memory).
RING_BYTES = 4 << 20
# Ring pipeline segment. 64 MiB at 2 ranks: 6.0 GB/s unsegmented, 6.8 GB/s at
# 256 KiB, 7.6 GB/s at 1 MiB segments (about half the 2 MiB L2 cache).
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
    # MPI every other transport stages through host memory: the old
    # host-staged path moved 2.8-4.3 GB/s on an H200, where a CUDA IPC probe
    # moved 179 GB/s at 256 MiB. (This transport's own figures come from
    # scripts/gpu_acceptance.sh on a GPU; none ran it while it was written.)
    if algorithm in ("auto", "shm") and one_host:
        return "cuda-ipc"
    if algorithm == "shm":
        return None
    return choose_transport(algorithm, nbytes, one_host=False)

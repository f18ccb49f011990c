"""The shared-memory segments a failed job leaves in /dev/shm, found and removed.

MPICH's ranks on one host share memory through files in ``/dev/shm``
(``mpich_shm_*``); Open MPI's are ``vader_segment.*`` and ``sm_segment.*``.
A job that ends in ``MPI_Abort`` or SIGKILL never unlinks them, and
``/dev/shm`` is memory: in a container with the default 64 MiB, about 30
aborted jobs stop MPI from starting at all. After a failed job the launcher
removes the segments that job made on this host, and nothing else: a segment
is removed only if it appeared while the job ran, belongs to this user, and
no live process maps it (a segment some other job still uses is mapped).

:func:`leftovers` is the pure decision; the rest reads the file system.
"""

import contextlib
import glob
import os
import time

__all__ = ["SHM_DIR", "PATTERNS", "segments", "mapped_paths", "leftovers", "sweep"]

SHM_DIR = "/dev/shm"
PATTERNS = ("mpich_shm_*", "vader_segment.*", "sm_segment.*")


def segments(directory=SHM_DIR):
    """``{path: mtime}`` of this user's MPI segments in ``directory``."""
    found = {}
    for pattern in PATTERNS:
        for path in glob.glob(os.path.join(directory, pattern)):
            with contextlib.suppress(OSError):
                st = os.lstat(path)
                if st.st_uid == os.getuid():
                    found[path] = st.st_mtime
    return found


def mapped_paths():
    """Every file some live process we may inspect has mapped (``/proc/PID/maps``)."""
    mapped = set()
    for maps in glob.glob("/proc/[0-9]*/maps"):
        with contextlib.suppress(OSError, IndexError), open(maps) as fh:
            mapped.update(line.split(None, 5)[5].strip() for line in fh if len(line.split(None, 5)) > 5)
    return mapped


def leftovers(before, after, mapped, since):
    """The segments a job that started at ``since`` left behind (pure).

    Args:
        before: ``{path: mtime}`` from just before the job started.
        after: ``{path: mtime}`` now that it has ended.
        mapped: paths some live process still maps.
        since: when the job started (``time.time()``).

    Returns:
        The sorted paths that are new (or were made again) since ``since``
        and that nobody maps.
    """
    return sorted(path for path, mtime in after.items()
                  if (path not in before or before[path] != mtime) and mtime >= since - 1 and path not in mapped)


def sweep(before, since, directory=SHM_DIR, settle=1.0):
    """Remove what the failed job that started at ``since`` left in ``directory``; returns the paths removed.

    An aborted job's ranks may still be exiting when mpiexec returns: give
    them up to ``settle`` seconds to unmap before judging a segment abandoned.
    """
    deadline = time.monotonic() + settle
    new = leftovers(before, segments(directory), set(), since)
    while True:
        mapped = mapped_paths()
        if not mapped.intersection(new) or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    found = leftovers(before, segments(directory), mapped, since)
    removed = []
    for path in found:
        with contextlib.suppress(OSError):
            os.unlink(path)
            removed.append(path)
    return removed

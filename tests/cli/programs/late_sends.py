"""A slow link made to order, for tests of a member whose messages arrive late.

Imported by tests/cli/programs/hvd_failures.py (its sibling) and by
tests/mpi/test_engine_ops.py (``cli.programs.late_sends``, tests/ being on
the path there).
"""

import time


class LateTo:
    """A communicator whose raw sends to one rank leave ``delay`` seconds late."""

    def __init__(self, comm, dest, delay):
        self._comm, self._dest, self._delay = comm, dest, delay

    def Isend(self, buf, dest, tag):  # noqa: N802 - mpi4py's name
        if dest == self._dest:
            time.sleep(self._delay)
        return self._comm.Isend(buf, dest=dest, tag=tag)

    def __getattr__(self, name):
        return getattr(self._comm, name)

"""``ringtrain train`` with slow steps, that lingers on its way out (as MPI's finalisation or a slow disk may).

Usage::

    python slow_exit.py DIR SECONDS [ringtrain train flags...]

Each rank writes ``DIR/pid-R`` when it starts and ``DIR/exiting-R`` once
``ringtrain.cli.main`` has returned, then sleeps SECONDS before exiting with
main's status: a window in which a test sends a second signal. With
``SLOW_EXIT_RANKS=1`` (a comma-separated list) only those ranks linger; the
others go straight on to exit, and wait in MPI's finalisation for them.
"""

import os
import sys
import time

from mpi4py import MPI

import ringtrain.training.startup
from ringtrain.cli import main

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from slow_train import slowed  # noqa: E402


def mark(directory, name):
    path = os.path.join(directory, name)
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.rename(path + ".tmp", path)


if __name__ == "__main__":
    directory, seconds, flags = sys.argv[1], float(sys.argv[2]), sys.argv[3:]
    rank = MPI.COMM_WORLD.Get_rank()
    build = ringtrain.training.startup.build_model
    ringtrain.training.startup.build_model = lambda *a, **kw: slowed(build(*a, **kw), 0.01)
    mark(directory, f"pid-{rank}")
    status = main(["train", *flags])
    mark(directory, f"exiting-{rank}")
    lingering = os.environ.get("SLOW_EXIT_RANKS")
    if lingering is None or str(rank) in lingering.split(","):
        time.sleep(seconds)
    sys.exit(status)

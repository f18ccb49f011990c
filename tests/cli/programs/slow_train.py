"""``ringtrain train`` exactly as the command line runs it, but each step at least SECONDS long.

Usage::

    python slow_train.py SECONDS [ringtrain train flags...]

Each rank first prints ``rank R pid P`` (so a test can signal one rank), then
runs ``ringtrain.cli.main(["train", ...])`` with the model's
``loss_and_grad`` slowed by a sleep, and exits with its status. The sleep
changes no number, so a slow run ends bitwise as a plain one would.
"""

import os
import sys
import time

from mpi4py import MPI

import ringtrain.training.loop
import ringtrain.training.startup
from ringtrain.cli import main


def slowed(model, seconds):
    inner = model.loss_and_grad

    def loss_and_grad(x, y, on_grad=None):
        time.sleep(seconds)
        return inner(x, y, on_grad=on_grad)

    model.loss_and_grad = loss_and_grad
    return model


if __name__ == "__main__":
    seconds, flags = float(sys.argv[1]), sys.argv[2:]
    sys.stdout.write(f"rank {MPI.COMM_WORLD.Get_rank()} pid {os.getpid()}\n")
    sys.stdout.flush()
    build = ringtrain.training.startup.build_model
    ringtrain.training.startup.build_model = lambda *a, **kw: slowed(build(*a, **kw), seconds)
    sys.exit(main(["train", *flags]))

"""``python -m ringtrain.horovod SCRIPT [ARGS]``: run an unmodified Horovod script on ringtrain.

    mpirun -np 2 python -m ringtrain.horovod pytorch_mnist.py --epochs 1
    python -m ringtrain.horovod pytorch_mnist.py --num-proc 2       # the script's horovod.run starts mpirun
    mpirun -np 2 python -m ringtrain.horovod -m pytest test_torch.py

The script runs as ``python SCRIPT`` would run it (``__name__`` is
``"__main__"``, ``sys.argv`` and ``sys.path[0]`` as Python sets them), except
that ``import horovod`` and ``import horovod.torch as hvd`` in this process get
ringtrain (see :mod:`ringtrain.horovod.imports`). ``-m MODULE`` runs a module
the same way. Under mpirun, an exception that escapes the script on one rank
aborts the whole job once MPI is running, so no peer waits for it.
"""

import os
import runpy
import sys
import traceback

from .imports import install
from .runner import run_worker

USAGE = "usage: python -m ringtrain.horovod SCRIPT [ARGS] | -m MODULE [ARGS]"


def _abort_if_in_a_job(exc):
    """Abort the MPI job after an escaped exception when MPI runs with peers; else let Python report it."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not mpi.Is_initialized() or mpi.Is_finalized() or mpi.COMM_WORLD.Get_size() == 1:
        return
    traceback.print_exception(exc)
    rank = mpi.COMM_WORLD.Get_rank()
    print(f"rank {rank}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
    mpi.COMM_WORLD.Abort(1)


def main(argv):
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] == "--worker" and len(argv) in (2, 3):
        install()
        return run_worker(argv[1], argv[2] if len(argv) == 3 else None)
    if argv[0] == "-m" and len(argv) < 2:
        print(f"python -m ringtrain.horovod: -m needs a module name ({USAGE})", file=sys.stderr)
        return 2
    if argv[0] != "-m" and not os.path.isfile(argv[0]):
        print(f"python -m ringtrain.horovod: can't open file {argv[0]!r} ({USAGE})", file=sys.stderr)
        return 2
    install()
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))  # as `python SCRIPT` sets it
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001 - a rank that stops alone strands its peers
        _abort_if_in_a_job(exc)
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

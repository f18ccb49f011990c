"""``ringtrain train`` with one fault injected on one rank, using only the library.

Usage::

    python faulty_train.py FAULT RANK STEP [ringtrain train flags...]

FAULT, on rank RANK only:

* ``none``: no fault (a reference run through the same code path).
* ``kill``: SIGKILL itself at the start of step STEP.
* ``sleep``: sleep 120 s in step STEP (a stalled rank).
* ``raise``: raise RuntimeError in step STEP.
* ``nan``: a NaN in the input batch of step STEP, so that rank's local
  gradients are NaN and the reduced ones too.
* ``nan-from``: the same at every step from STEP on.
* ``diverge``: nudge one parameter in step STEP, so the replicas differ
  (the digest check at the next checkpoint must catch it).
* ``enospc``: the STEP-th checkpoint save (counting from 0) fails with
  ``OSError(ENOSPC)`` after writing a few bytes. Only rank 0 writes.
* ``sleep-load``: sleep 120 s before loading the data (STEP is ignored): a
  rank stalled at start-up, while the others wait in data loading's
  collectives.

Steps count calls of ``loss_and_grad``, so STEP is the trainer's global step
in a fresh run. Like the CLI, the whole run is under ``abort_on_error``; a
user error agreed by every rank prints ``rank R: error: ...`` on every rank
and exits 2. At the end every rank prints ``rank R digest <sha256>`` of its
parameters; like the CLI, it exits 3 when the final checkpoint was not written,
and 4 (one line from rank 0) when training diverged.
"""

import errno
import os
import signal
import sys
import time

from mpi4py import MPI

import ringtrain.io.checkpoint
import ringtrain.training.loop
import ringtrain.training.startup
from ringtrain.cli import build_parser
from ringtrain.commands.train import DIVERGED, FINAL_CHECKPOINT_MISSING
from ringtrain.commands.train import config_from_args
from ringtrain.errors import UsageError
from ringtrain.failure import abort_on_error
from ringtrain.training.replicas import params_digest


def inject(model, fault, at):
    """Make ``model`` misbehave at one step: its ``loss_and_grad`` is replaced on the instance.

    The model stays what it was (a FlatModel keeps the fast paths), so the
    faulty run takes the same strategy as the straight run it is compared with.
    """
    inner = model.loss_and_grad
    calls = [0]

    def loss_and_grad(x, y, on_grad=None):
        step, calls[0] = calls[0], calls[0] + 1
        if step == at or (fault == "nan-from" and step >= at):
            if fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif fault == "sleep":
                time.sleep(120)
            elif fault == "raise":
                raise RuntimeError(f"injected fault at step {step}")
            elif fault == "diverge":
                first = next(iter(model.params.values()))
                first.reshape(-1)[0] += 1.0
            elif fault in ("nan", "nan-from"):
                # In the input, not the returned gradients: with overlap the
                # gradients are reduced inside backward, before we could touch them.
                x = x.copy()
                x[0, 0] = float("nan")
        return inner(x, y, on_grad=on_grad)

    model.loss_and_grad = loss_and_grad
    return model


def install(fault, at):
    if fault == "enospc":
        write, saves = ringtrain.io.checkpoint._write_npz, [0]

        def failing_write(fileobj, arrays, meta):
            saves[0] += 1
            if saves[0] - 1 == at:
                fileobj.write(b"PK\x03\x04" + bytes(4096))  # a partial file, as a full disk leaves
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return write(fileobj, arrays, meta)

        ringtrain.io.checkpoint._write_npz = failing_write
    elif fault == "sleep-load":
        load = ringtrain.training.startup.load_sharded

        def slow_load(*args, **kwargs):
            time.sleep(120)
            return load(*args, **kwargs)

        ringtrain.training.startup.load_sharded = slow_load
    elif fault != "none":
        build = ringtrain.training.startup.build_model
        ringtrain.training.startup.build_model = lambda *a, **kw: inject(build(*a, **kw), fault, at)


def main(argv):
    fault, rank, at, flags = argv[0], int(argv[1]), int(argv[2]), argv[3:]
    comm = MPI.COMM_WORLD
    try:
        with abort_on_error(comm):
            if comm.Get_rank() == rank:
                install(fault, at)
            cfg = config_from_args(build_parser().parse_args(["train", *flags]))
            try:
                result = ringtrain.training.loop.train(cfg, comm)
            except ringtrain.training.loop.Diverged as exc:  # every rank at the same step, as the CLI takes it
                if comm.Get_rank() == 0:
                    print(f"ringtrain: error: {exc.advice}", file=sys.stderr, flush=True)
                return DIVERGED
            # One write per line: print() writes the newline separately, and
            # ranks finishing together could interleave their lines.
            sys.stdout.write(f"rank {comm.Get_rank()} digest {params_digest(result.params)}\n")
            sys.stdout.flush()
            if result.checkpoint is None:
                sys.stdout.write(f"rank {comm.Get_rank()} newest {result.newest_checkpoint}\n")
                sys.stdout.flush()
                return FINAL_CHECKPOINT_MISSING
    except UsageError as exc:
        print(f"rank {comm.Get_rank()}: error: {exc}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

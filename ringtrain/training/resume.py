"""Resuming a run: rank 0 finds and checks a checkpoint, every rank receives it.

A checkpoint is a plain dict of arrays plus metadata (:mod:`ringtrain.checkpoint`).
Only rank 0 reads the disk (on a cluster the run directory may be on its
local disk alone); it broadcasts what it read, so every replica starts from
the same bits, whether from a checkpoint or from rank 0's fresh parameters.

:func:`resume` is collective: every rank calls it once, at start-up.
"""

import dataclasses
import os

from .. import backend
from ..checkpoint import latest_valid_checkpoint, read_checkpoint
from ..comm.collectives import broadcast_
from ..errors import UsageError
from ..failure import agree

__all__ = ["Position", "resume", "find_checkpoint"]


@dataclasses.dataclass(frozen=True)
class Position:
    """Where training stands: the next step to take and the data order's place."""

    step: int = 0             # optimizer steps taken in all
    epoch: int = 0            # epochs completed
    step_in_epoch: int = 0    # steps taken in the current epoch
    nonfinite_streak: int = 0  # non-finite steps in a row just before this point


def find_checkpoint(resume_from, run_dir, warn):
    """On rank 0: the checkpoint to resume from as ``(path, arrays, metadata)``, or None.

    Args:
        resume_from: ``"auto"`` (the newest valid checkpoint of ``run_dir``),
            ``"none"``, a checkpoint file, or a run or checkpoints directory.
        run_dir: this run's directory.
        warn: called with a line for each damaged checkpoint passed over.
    """
    if resume_from == "none":
        return None
    if resume_from == "auto":
        directory = os.path.join(run_dir, "checkpoints")
        return latest_valid_checkpoint(directory, warn=warn) if os.path.isdir(directory) else None
    if os.path.isdir(resume_from):
        sub = os.path.join(resume_from, "checkpoints")
        found = latest_valid_checkpoint(sub if os.path.isdir(sub) else resume_from, warn=warn)
        if found is None:
            raise UsageError(f"--resume {resume_from}: no valid checkpoint there")
        return found
    arrays, meta = read_checkpoint(resume_from)
    return resume_from, arrays, meta


def _check_fits(found, params):
    path, arrays, _ = found
    for name, p in params.items():
        a = arrays.get(f"params/{name}")
        if a is None or a.shape != tuple(p.shape) or a.dtype != p.dtype:
            raise UsageError(f"checkpoint {path} does not fit this model (parameter {name}); "
                             "use --resume none or a matching --model/--hidden")


def _find_on_root(comm, resume_from, run_dir, params, log):
    found, problem = None, None
    if comm.Get_rank() == 0:
        try:
            found = find_checkpoint(resume_from, run_dir, log.warn)
            if found is not None:
                _check_fits(found, params)
        except UsageError as exc:
            problem = str(exc)
    agree(comm, problem)
    return found


def resume(comm, resume_from, run_dir, params, opt, log):
    """Rank 0 loads and checks a checkpoint, then every rank receives it (collective).

    Without a checkpoint, rank 0's initial parameters are broadcast so every
    replica starts identical.

    Returns:
        The :class:`Position` to continue from (all zeros for a fresh run).
    """
    found = _find_on_root(comm, resume_from, run_dir, params, log)
    header = None
    if found is not None:
        path, arrays, meta = found
        header = {"path": path, "meta": meta,
                  "optim": {k[len("optim/"):]: v for k, v in arrays.items() if k.startswith("optim/")}}
        for name, p in params.items():
            p[...] = backend.get_array_module(p).asarray(arrays[f"params/{name}"])
    header = comm.bcast(header, root=0)
    for name in params:
        broadcast_(params[name], root=0, comm=comm)
    if header is None:
        return Position()
    opt.load_state_dict(header["optim"])
    meta = header["meta"]
    if meta.get("world_size") not in (None, comm.Get_size()):
        log.warn(f"resuming a {meta['world_size']}-rank run on {comm.Get_size()} ranks: "
                 "the data order differs, so results will not match the original run exactly")
    log.print(f"resumed from {header['path']} at step {meta['step']} (epoch {meta['epoch']})")
    return Position(meta["step"], meta["epoch"], meta["step_in_epoch"], meta.get("nonfinite_streak", 0))

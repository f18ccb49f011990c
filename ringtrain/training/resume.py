"""Resuming a run: rank 0 finds and checks a checkpoint, every rank receives it.

A checkpoint is a plain dict of arrays plus metadata (:mod:`ringtrain.io.checkpoint`).
Only rank 0 reads the disk (on a cluster the run directory may be on its
local disk alone); it broadcasts what it read, so every replica starts from
the same bits, whether from a checkpoint or from rank 0's fresh parameters.

A resume takes only what fits. The checkpoint's recorded configuration is
compared with this run's through :data:`ringtrain.training.config.RESUME_RULES`:
a setting that shapes the model, the data, the data order or the optimizer
state must be the same (else one line, exit 2, naming the setting and the
ways out); a setting that only steers the future may change, and the changes
are listed in one notice line.

Lineages. Every start that does not continue the run directory's own
history (a fresh start, ``--resume none``, ``--resume PATH``) begins a new
lineage: an id recorded in each checkpoint's metadata and in the run
directory's ``lineage.json`` (written atomically by rank 0 before the first
step). ``--resume auto`` takes the newest valid checkpoint of the directory's
current lineage, so checkpoints an earlier lineage left at higher steps are
never mistaken for this run's progress; before the new lineage's first
checkpoint it falls back to the checkpoint the lineage started from.

:func:`resume` is collective: every rank calls it once, at start-up.
"""

import contextlib
import dataclasses
import json
import os
import uuid

from .. import backend
from ..data.sharding import EpochPart
from ..io.checkpoint import CheckpointError, check_formats, latest_valid_checkpoint, read_checkpoint
from ..comm.collectives import broadcast_
from ..errors import UsageError
from ..failure import agree
from ..io.rundir import write_json_atomic
from ..io.safeio import KiB, read_regular
from .config import flag_name, resume_differences

__all__ = ["Position", "Lineage", "resume", "position_from_meta", "data_position", "DATA_POSITION", "find_checkpoint",
           "read_lineage", "write_lineage", "LINEAGE_NAME"]

LINEAGE_NAME = "lineage.json"


@dataclasses.dataclass(frozen=True)
class Position:
    """Where training stands: the next step to take and the data order's place.

    ``parts`` is the position in samples: the current epoch so far as
    :class:`~ringtrain.data.sharding.EpochPart` records (rank count, samples
    of its order consumed), which :meth:`ringtrain.data.sharding.EpochPlan.schedule`
    continues at any rank count.
    """

    step: int = 0             # optimizer steps taken in all
    epoch: int = 0            # epochs completed
    step_in_epoch: int = 0    # steps taken in the current epoch, at whatever rank counts
    nonfinite_streak: int = 0  # non-finite steps in a row just before this point
    parts: tuple = ()         # the current epoch so far, as EpochPart records


# The checkpoint metadata key of the position in samples (see data_position).
DATA_POSITION = "data_position"


def data_position(epoch, parts):
    """The checkpoint metadata that records where the data order stands (pure, plain JSON).

    ``{"epoch": E, "parts": [[ranks, samples], ...]}``: the samples of epoch
    E's order consumed so far, in stretches at one rank count each.
    """
    return {"epoch": int(epoch), "parts": [[int(p.ranks), int(p.samples)] for p in parts]}


def position_from_meta(meta, batch_size, ranks):
    """The :class:`Position` a checkpoint's metadata records (pure).

    A checkpoint from before the position was recorded in samples holds its
    epoch's steps and the rank count that took them (or nothing, then this
    run's ``ranks``): the same position, in samples.

    Raises:
        ValueError: metadata that cannot be a position (a damaged or crafted file).
    """
    epoch, index = meta["epoch"], meta["step_in_epoch"]
    recorded = meta.get(DATA_POSITION)
    if recorded is None:
        then = meta.get("world_size") or ranks
        parts = (EpochPart(then, index * then * batch_size),) if index else ()
    else:
        try:
            if recorded["epoch"] != epoch:
                raise ValueError(f"it is for epoch {recorded['epoch']!r}, not {epoch}")
            parts = tuple(EpochPart(*_counts(pair)) for pair in recorded["parts"])
        except (TypeError, KeyError) as exc:
            raise ValueError(f"expected {{'epoch': E, 'parts': [[ranks, samples], ...]}} ({exc})") from None
        steps = 0
        for part in parts:
            if part.ranks < 1 or part.samples % (part.ranks * batch_size):
                raise ValueError(f"{part.samples} samples is not a whole number of steps of {part.ranks} rank(s) "
                                 f"x batch size {batch_size}")
            steps += part.samples // (part.ranks * batch_size)
        if steps != index:
            raise ValueError(f"its parts add up to {steps} steps and step_in_epoch is {index}")
    return Position(meta["step"], epoch, index, meta.get("nonfinite_streak", 0), parts)


def _counts(pair):
    ranks, samples = pair
    if not (_count(ranks) and _count(samples)):
        raise TypeError(f"{pair!r:.40} is not a pair of counts")
    return ranks, samples


@dataclasses.dataclass(frozen=True)
class Lineage:
    """One history of checkpoints in a run directory (rank 0's record).

    ``parent`` is the checkpoint the lineage started from (None for a fresh
    start): what ``--resume auto`` falls back to before the lineage has a
    checkpoint of its own.
    """

    id: str
    parent: str = None

    @staticmethod
    def new(parent=None):
        return Lineage(uuid.uuid4().hex[:16], os.path.abspath(parent) if parent else None)


def read_lineage(run_dir, warn):
    """The run directory's current :class:`Lineage`, or None (none recorded, or unreadable: said through ``warn``)."""
    path = os.path.join(run_dir, LINEAGE_NAME)
    if not os.path.lexists(path):
        return None
    try:
        record = json.loads(read_regular(path, None, 64 * KiB, "lineage files").decode("utf-8"))
        return Lineage(str(record["lineage"]), record.get("parent"))
    except (UsageError, ValueError, KeyError, TypeError, AttributeError) as exc:
        warn(f"{path}: unreadable ({exc}); taking the newest valid checkpoint of any run")
        return None


def write_lineage(run_dir, lineage):
    """Record ``lineage`` as the run directory's current one (atomically; raises OSError)."""
    write_json_atomic(os.path.join(run_dir, LINEAGE_NAME), {"lineage": lineage.id, "parent": lineage.parent})


def find_checkpoint(resume_from, run_dir, warn):
    """On rank 0: the checkpoint to resume from as ``(path, arrays, metadata)``, or None.

    Args:
        resume_from: ``"auto"`` (the newest valid checkpoint of ``run_dir``'s
            current lineage), ``"none"``, a checkpoint file, or a run or
            checkpoints directory.
        run_dir: this run's directory.
        warn: called with a line for each damaged checkpoint passed over.
    """
    if resume_from == "none":
        return None
    if resume_from == "auto":
        return _find_auto(run_dir, warn)
    if os.path.isdir(resume_from):
        sub = os.path.join(resume_from, "checkpoints")
        found = latest_valid_checkpoint(sub if os.path.isdir(sub) else resume_from, warn=warn)
        if found is None:
            raise UsageError(f"--resume {resume_from}: no valid checkpoint there")
        return found
    arrays, meta = read_checkpoint(resume_from)
    return resume_from, arrays, meta


def _find_auto(run_dir, warn):
    directory = os.path.join(run_dir, "checkpoints")
    current = read_lineage(run_dir, warn)
    if current is None:  # a directory from before lineages, or a new one
        return latest_valid_checkpoint(directory, warn=warn) if os.path.isdir(directory) else None
    found = None
    if os.path.isdir(directory):
        found = latest_valid_checkpoint(directory, warn=warn, accept=lambda meta: meta.get("lineage") == current.id)
    if found is None and current.parent:
        try:
            arrays, meta = read_checkpoint(current.parent)
            found = current.parent, arrays, meta
        except CheckpointError as exc:
            warn(f"this run started from {exc}; no checkpoint of it is left, so it starts afresh")
    return found


def _shown(value):
    return ",".join(map(str, value)) if isinstance(value, list) else str(value)


def _count(value):
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_meta(path, meta):
    config = meta.get("config")
    if not isinstance(config, dict) or not all(_count(meta.get(k)) for k in ("epoch", "step_in_epoch")):
        raise UsageError(f"checkpoint {path} has no training metadata (config, epoch, step_in_epoch): it was not "
                         "written by ringtrain train; give another --resume PATH, or --resume none")
    # Each is used as a number or a name: a crafted file gets one line, never a wrong step or a traceback.
    kinds = {"nonfinite_streak": _count, "world_size": lambda v: _count(v) and v > 0,
             "lineage": lambda v: isinstance(v, str)}
    for key, ok in kinds.items():
        if meta.get(key) is not None and not ok(meta[key]):
            raise UsageError(f"checkpoint {path}: damaged metadata ({key} is {type(meta[key]).__name__} "
                             f"{meta[key]!r:.40}); give another --resume PATH, or --resume none")


def _same_data(path, meta, cfg, fingerprint):
    """The checkpoint's settings with its dataset spelled as this run's, when they name the same data.

    ``./d.npz`` and ``d.npz`` (or a path through a link) are one file:
    compared as resolved paths, not strings. The same name with different
    contents is refused: compared by the content fingerprint both record.
    """
    saved, recorded = dict(meta["config"]), meta.get("dataset")
    if not isinstance(recorded, dict) or fingerprint is None:
        if isinstance(saved.get("dataset"), str) and os.path.realpath(saved["dataset"]) == os.path.realpath(
                cfg.dataset) and os.path.exists(cfg.dataset):
            saved["dataset"] = cfg.dataset
        return saved
    if recorded.get("path") == fingerprint["path"] or saved.get("dataset") == cfg.dataset:
        saved["dataset"] = cfg.dataset
        then, now = recorded.get("sha256"), fingerprint["sha256"]
        if isinstance(then, str) and then != now:
            raise UsageError(f"--resume {cfg.resume}: cannot resume from {path}: --dataset {cfg.dataset} holds other "
                             f"data than it was trained on (content sha256 {then[:12]}... then, {now[:12]}... now); "
                             "give the data it was trained on, or --resume none to start afresh")
    return saved


def _check_settings(found, cfg, size, warn, fingerprint=None):
    """Refuse a checkpoint whose settings do not fit; return the notice line for those that changed, or None."""
    path, _, meta = found
    _check_meta(path, meta)
    auto = cfg.resume == "auto"
    refused, changed = resume_differences(_same_data(path, meta, cfg, fingerprint), cfg)
    if refused is not None:
        name, then, now, why = refused
        flag = flag_name(name)
        ways_out = ("to start a new run give a new --run-dir, or --resume none to start afresh here" if auto
                    else f"give {flag} {_shown(then)}, or --resume none to start afresh")
        raise UsageError(f"--resume {cfg.resume}: cannot resume from {path}: it was trained with {flag} "
                         f"{_shown(then)} and this run has {flag} {_shown(now)}, which changes {why}; {ways_out}")
    try:  # after the settings: a changed --batch-size is said as such, not as a damaged position
        position_from_meta(meta, cfg.batch_size, size)
    except ValueError as exc:
        raise UsageError(f"checkpoint {path}: damaged metadata ({DATA_POSITION}: {exc}); give another --resume "
                         "PATH, or --resume none") from None
    ranks = meta.get("world_size")
    if ranks not in (None, size):
        # The position is kept in samples, so the rest of the epoch is exact at any rank count.
        rest = (f"; the rest of epoch {meta['epoch'] + 1} trains on exactly the samples it had not reached"
                if meta["step_in_epoch"] else "")
        warn(f"resuming a {ranks}-rank run on {size} ranks: the data order differs from here on, so results will "
             f"not match a {ranks}-rank run bitwise{rest}")
    if not changed:
        return None
    return "ringtrain: settings changed since the checkpoint: " + ", ".join(
        f"{flag_name(name)} {_shown(now)} (was {_shown(then)})" for name, then, now in changed)


def _check_fits(found, params):
    path, arrays, _ = found
    for name, p in params.items():
        a = arrays.get(f"params/{name}")
        if a is None or a.shape != tuple(p.shape) or a.dtype != p.dtype:
            raise UsageError(f"checkpoint {path} does not fit this model (parameter {name}); "
                             "use --resume none or a matching --model/--hidden")


def _find_on_root(comm, cfg, run_dir, params, log, fingerprint):
    found, problem, notice = None, None, None
    if comm.Get_rank() == 0:
        try:
            # Whatever --resume says: a run that starts here must not later prune or overwrite a
            # checkpoint a newer ringtrain wrote, so such a directory is refused.
            check_formats(os.path.join(run_dir, "checkpoints"))
            found = find_checkpoint(cfg.resume, run_dir, log.warn)
            if found is not None:
                # The recorded settings name a difference best ("trained with --hidden 8"); without
                # them, a model that does not fit is still the clearer thing to say.
                recorded = isinstance(found[2].get("config"), dict)
                if recorded:
                    notice = _check_settings(found, cfg, comm.Get_size(), log.warn, fingerprint)
                _check_fits(found, params)
                if not recorded:
                    _check_meta(found[0], found[2])
        except UsageError as exc:
            problem = str(exc)
    agree(comm, problem)
    return found, notice


def _lineage_for(cfg, run_dir, found, log):
    """On rank 0: the lineage this run's checkpoints join."""
    if found is None:
        return Lineage.new()
    path, _, meta = found
    if cfg.resume == "auto":
        current = read_lineage(run_dir, log.warn)
        if current is not None and (meta.get("lineage") == current.id or path == current.parent):
            return current
        return Lineage(meta["lineage"]) if meta.get("lineage") else Lineage.new(path)
    return Lineage.new(path)  # --resume PATH: a branch, whatever the directory held before


def resume(comm, cfg, run_dir, params, opt, log, dog=None, fingerprint=None):
    """Rank 0 loads and checks a checkpoint, then every rank receives it (collective).

    Without a checkpoint, rank 0's initial parameters are broadcast so every
    replica starts identical.

    Args:
        dog: a :class:`ringtrain.watchdog.Watchdog` to watch the collectives
            (rank 0 may read a large checkpoint while the others wait).
        fingerprint: rank 0's :func:`ringtrain.data.fingerprint.dataset_fingerprint`
            of this run's data, compared with the checkpoint's.

    Returns:
        ``(position, lineage, path)``: the :class:`Position` to continue from
        (all zeros for a fresh run); on rank 0 the :class:`Lineage` this run
        continues and the checkpoint resumed from (None for a fresh start),
        None on the other ranks.
    """
    def watched(what):
        return dog.watch(f"start-up: resume {what}") if dog is not None else contextlib.nullcontext()

    with watched("agreement"):
        found, notice = _find_on_root(comm, cfg, run_dir, params, log, fingerprint)
    lineage = _lineage_for(cfg, run_dir, found, log) if comm.Get_rank() == 0 else None
    header = None
    if found is not None:
        path, arrays, meta = found
        header = {"path": path, "meta": meta,
                  "optim": {k[len("optim/"):]: v for k, v in arrays.items() if k.startswith("optim/")}}
        for name, p in params.items():
            p[...] = backend.get_array_module(p).asarray(arrays[f"params/{name}"])
    with watched("broadcast"):
        header = comm.bcast(header, root=0)
        for name in params:
            broadcast_(params[name], root=0, comm=comm)
    if header is None:
        return Position(), lineage, None
    try:
        opt.load_state_dict(header["optim"])
    except ValueError as exc:  # every rank holds the same header and optimizer: the same verdict everywhere
        raise UsageError(f"checkpoint {header['path']}: {exc}; give the --optimizer and --momentum it was trained "
                         "with, or --resume none", everywhere=True) from None
    meta = header["meta"]
    # Said as the stop line says it ("in epoch 2 (step 1 of 63)"): epochs counted from 1, not epochs done.
    where = (f"in epoch {meta['epoch'] + 1}, step {meta['step_in_epoch']}" if meta["step_in_epoch"]
             else f"{meta['epoch']} epoch(s) done")
    log.print(f"resumed from {header['path']} at step {meta['step']} ({where})")
    if notice:
        log.print(notice)
    # Checked on rank 0 (_check_settings) when the checkpoint has its settings recorded.
    try:
        position = position_from_meta(meta, cfg.batch_size, comm.Get_size())
    except ValueError as exc:
        raise UsageError(f"checkpoint {header['path']}: damaged metadata ({DATA_POSITION}: {exc})",
                         everywhere=True) from None
    return position, lineage, header["path"]


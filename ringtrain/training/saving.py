"""The trainer's checkpoints: gathered, checked, and written only when the state is worth resuming.

A checkpoint is what ``--resume`` restores, so a state that cannot train on
must never become one: parameters or optimizer state that are not finite,
or a step in a streak of non-finite gradients (the weights that produced
them). Such a checkpoint is not written, so ``--keep`` never prunes the last
good one in its favour, and the run knows which checkpoint is the last good
one when it must say how to go on (:class:`Diverged`).

:meth:`Checkpointer.save` is collective (the optimizer state gather and the
parameter digest); only rank 0 writes.
"""

import math
import os
import shlex

import numpy as np

from .. import backend
from ..data.standardize import scaling_arrays
from ..io.checkpoint import CheckpointError, save_checkpoint
from .config import to_json
from .replicas import check_params_everywhere
from .resume import DATA_POSITION, data_position

__all__ = ["Checkpointer", "Diverged", "all_finite", "lower_lr"]


class Diverged(FloatingPointError):
    """Training diverged: its gradients stayed non-finite (raised on every rank at the same step).

    Attributes:
        step: the step at which the run gave up.
        last_good: the newest finite checkpoint of the run on disk (rank 0), or None.
        advice: one line: what happened, the last good checkpoint, and how to go on from it.
    """

    def __init__(self, message, step, last_good=None, advice=None):
        super().__init__(message)
        self.step, self.last_good, self.advice = step, last_good, advice or message


def all_finite(arrays):
    """True when every floating-point array holds only finite numbers (pure)."""
    return all(np.isfinite(a).all() for a in arrays if np.asarray(a).dtype.kind in "fc")


def lower_lr(lr):
    """A learning rate a tenth of ``lr``, written short (``0.01``, ``100000``) for advice (pure)."""
    return f"{lr / 10:g}"


class Checkpointer:
    """Writes a run's checkpoints and remembers the newest one on disk (rank 0's knowledge).

    Args:
        start: the :class:`~ringtrain.training.startup.Start` the run trains from.
        strategy: the run's strategy (its ``gather_state`` runs before a save).
        phases: the run's :class:`~ringtrain.training.strategy.Phases`.
    """

    def __init__(self, start, strategy, phases):
        self.run, self.strategy, self.phases = start, strategy, phases
        # The newest checkpoint of this run on disk, as far as rank 0 knows:
        # at first the one it resumed from, which is still there.
        self.saved = start.resumed_from
        self._warned = False

    def save(self, step, epoch, index, streak, records, final=False, parts=()):
        """Gather, check and (on rank 0) save; returns the path, or None (collective).

        Args:
            records: ``(last train event, last eval event)`` for the metadata.
            parts: the epoch so far as :class:`~ringtrain.data.sharding.EpochPart`
                records (the position in samples; empty at an epoch's start).
        """
        run = self.run
        with self.phases.watched("optimizer state allgather", step):
            self.strategy.gather_state()
        with self.phases.watched("parameter digest allgather", step):
            digest = check_params_everywhere(run.comm, run.model.params, step)
        if not run.spec.is_master:
            return None
        arrays = {f"params/{k}": backend.to_numpy(v) for k, v in run.model.params.items()}
        arrays.update({f"optim/{k}": v for k, v in run.opt.state_dict().items()})
        problem = self._not_worth_keeping(arrays, streak, final)
        if problem is not None:
            self._refuse(step, epoch, problem)
            return None
        arrays.update(scaling_arrays(run.data))  # --standardize's statistics, for use outside training
        last_train, last_eval = records
        meta = {"step": step, "epoch": epoch, "step_in_epoch": index, "nonfinite_streak": streak,
                "world_size": run.comm.Get_size(), "digest": digest, "final": final,
                "config": to_json(run.cfg), "train": _finite(last_train), "eval": _finite(last_eval),
                "lineage": run.lineage.id if run.lineage is not None else None, "dataset": run.fingerprint,
                "model_name": run.model_name, DATA_POSITION: data_position(epoch, parts)}
        try:
            path = save_checkpoint(run.log.checkpoint_dir, step, arrays, meta, keep=run.cfg.keep)
        except (OSError, CheckpointError) as exc:  # save_checkpoint turns an OSError into CheckpointError
            # The earlier checkpoints are intact; training can go on, and the
            # next checkpoint may well succeed (a full disk gets cleaned up).
            run.log.warn(f"checkpoint at step {step} not written: {exc}")
            run.log.event("checkpoint_failed", step=step, epoch=epoch, error=str(exc))
            return None
        run.log.event("checkpoint", step=step, epoch=epoch, path=path)
        self.saved = path
        return path

    def _not_worth_keeping(self, arrays, streak, final):
        if not all_finite(arrays.values()):
            return "the parameters or optimizer state are not finite"
        if streak and not final:
            return f"it is {streak} non-finite step(s) into a streak"
        return None

    def _refuse(self, step, epoch, problem):
        # Inside a streak of skipped steps this is said once the streak is
        # over (or in the divergence line); a state that is itself not finite
        # is worth a warning of its own, once.
        log = self.run.log
        log.event("checkpoint_skipped", step=step, epoch=epoch, reason=problem)
        if "streak" not in problem and not self._warned:
            self._warned = True
            log.warn(f"checkpoint at step {step} not written: {problem}; {self.last_good_words()}")

    def last_good(self):
        """The newest finite checkpoint of this run still on disk (rank 0), or None."""
        return self.saved if self.saved is not None and os.path.isfile(self.saved) else None

    def last_good_words(self):
        good = self.last_good()
        return f"the last good checkpoint is {good}" if good else "there is no good checkpoint of this run yet"

    def diverged(self, step, why):
        """The :class:`Diverged` to raise on every rank: rank 0's advice names the last good checkpoint."""
        run = self.run
        message = f"training diverged at step {step} ({why})"
        if not run.spec.is_master:
            return Diverged(message, step)
        good, lr = self.last_good(), lower_lr(run.cfg.lr)
        launcher = f"mpirun -np {run.comm.Get_size()} " if run.comm.Get_size() > 1 else ""
        settings = shlex.quote(os.path.join(run.log.run_dir, "config.json"))
        if good:
            advice = (f"{message}; the last good checkpoint is {good}; to go on from it with a lower learning "
                      f"rate: {launcher}ringtrain train --config {settings} --resume {shlex.quote(good)} --lr {lr}")
        else:
            advice = (f"{message}; no checkpoint of this run is good; start again with a lower learning rate: "
                      f"{launcher}ringtrain train --config {settings} --resume none --lr {lr}")
        return Diverged(message, step, good, advice)


def _finite(record):
    """A metrics record with NaN/inf as None: checkpoint metadata is strict JSON."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}

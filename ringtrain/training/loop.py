"""The training loop: every rank the same model, its own shard, one averaging strategy.

Launch it under MPI (``mpirun -np 4 ringtrain train --dataset mnist5k``), or
call :func:`train` from your own script on every rank.

Synchronisation points: :func:`train` is collective. Every rank of ``comm``
must call it with the same configuration. Start-up agrees on the settings,
the model and the starting parameters (:mod:`ringtrain.training.replicas`,
:mod:`ringtrain.training.resume`); each step is the strategy's
(:mod:`ringtrain.training.strategy`: its collectives, then one small sum of
the step's metrics); each evaluation is one sum; each checkpoint gathers the
sharded optimizer state (when sharded) and a digest of the parameters. Rank 0
is the master: it alone prints, writes the run directory and writes
checkpoints; on resume it reads the checkpoint and broadcasts it.
"""

import contextlib
import dataclasses
import importlib.util
import math
import os
import sys
import time

import numpy as np

from .. import backend
from ..io.checkpoint import CheckpointError, list_checkpoints, save_checkpoint
from ..data.load import load_sharded
from ..errors import UsageError
from ..failure import agree
from ..models.base import flat_layout
from ..models.registry import build_model, takes_option
from ..optim import build_optimizer, learning_rate, scaled_lr
from ..io.safeio import os_reason
from ..data.sharding import EpochPlan
from ..cluster.topology import TaskSpec
from ..watchdog import WatchedComm, Watchdog, left_neighbour
from .config import MODEL_OPTIONS, TrainConfig, to_json, validate
from .evaluate import reduce_eval
from .metrics import Meter, epoch_line
from .progress import Progress, choose_mode
from .replicas import check_params_everywhere, check_same_params, check_same_settings
from .resume import resume, write_lineage
from .runlog import RunLog, default_run_dir
from ..data.standardize import scaling_arrays, standardize
from .stopping import StopSignals
from .strategy import VERDICTS, Phases, Slot, choose_strategy, stop_reason
from .timeline import Timeline

__all__ = ["train", "TrainResult"]


@dataclasses.dataclass
class TrainResult:
    """What :func:`train` returns on every rank."""

    params: dict          # name -> NumPy copy of the final parameters
    step: int             # optimizer steps taken in all (resumed runs count earlier steps)
    epoch: int            # epochs completed
    train: dict           # the last train event: loss, accuracy, samples_per_sec
    eval: dict            # the last eval event: loss, accuracy (empty if none ran)
    run_dir: str
    stopped: str          # "done", "max_time", "max_steps", or the signal: "sigint", "sigterm", "sigusr1"
    checkpoint: str = None         # the final checkpoint's path; None when it could not be written
    newest_checkpoint: str = None  # when it could not: this run's newest checkpoint still on disk, or None


def train(cfg, comm=None, *, model=None, stream=None):
    """Train data-parallel on every rank of ``comm``; collective.

    While it runs, BLAS threads are capped at this rank's share of the host's
    cores (unless ``OMP_NUM_THREADS`` or the like is set); the process's own
    limits are restored when it returns.

    While it runs, SIGINT, SIGTERM and SIGUSR1 stop training gracefully
    (:mod:`ringtrain.training.stopping`): every rank finishes its step, all
    stop after the same one, rank 0 writes a checkpoint, and ``train``
    returns with ``stopped`` naming the signal. A second signal aborts. The
    previous handlers are restored when it returns.

    Args:
        cfg: a :class:`ringtrain.training.config.TrainConfig` (validated here).
        comm: the communicator (default ``MPI.COMM_WORLD``).
        model: your own model object (``params``, ``loss_and_grad``,
            ``evaluate``; subclass :class:`ringtrain.models.FlatModel` for the
            fast paths); default builds ``cfg.model``.
        stream: where rank 0 prints (default stdout).

    Returns:
        A :class:`TrainResult`, on every rank. Its ``checkpoint`` is None
        when the final checkpoint could not be written (the command line
        then exits non-zero).
    """
    from mpi4py import MPI

    comm = comm if comm is not None else MPI.COMM_WORLD
    # Every collective from here to the end is watched: a rank that stalls
    # anywhere ends the job within --timeout, naming the operation.
    dog = Watchdog(comm, cfg.timeout if _usable_timeout(cfg.timeout) else TrainConfig.timeout)
    try:
        # The first collective: every rank's verdict on the values, plus
        # rank 0's on the paths that only it touches.
        problem = None
        try:
            validate(cfg, root=comm.Get_rank() == 0)
        except UsageError as exc:
            problem = str(exc)
        with _starting(dog, "settings agreement"):
            agree(comm, problem)
            check_same_settings(comm, cfg)
        with _starting(dog, "topology allgather"):
            # A CPU run never asks CuPy: that would initialise the CUDA driver in every rank.
            spec = TaskSpec.from_mpi(comm, device_count=None if cfg.device == "gpu" else 0)
        with spec.limited_threads() as threads, StopSignals(comm) as signals:
            run = _start(cfg, comm, spec, model, stream, threads, dog)
            return run.loop(signals)
    finally:
        dog.close()


def _usable_timeout(value):
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def _starting(dog, what):
    return dog.watch(f"start-up: {what}")


def _start(cfg, comm, spec, model, stream, threads, dog):
    """Everything before the first step (collective): device, data, model, optimizer, resume, strategy."""
    problem = None
    try:
        xp = backend.xp_for(cfg.device)
    except ValueError as exc:
        problem = str(exc)
    with _starting(dog, "device agreement"):
        agree(comm, problem)
    backend.use_device(spec.device)
    # Only its collectives are watched, not the reading between them.
    data = load_sharded(cfg.dataset, WatchedComm(comm, dog, "start-up: data loading"), seed=cfg.seed,
                        test_fraction=cfg.test_fraction, samples=cfg.samples, features=cfg.features,
                        classes=cfg.classes)
    data = standardize(data, WatchedComm(comm, dog, "start-up: feature statistics"), cfg.standardize)
    plan = EpochPlan.for_shard(data, comm, batch_size=cfg.batch_size, seed=cfg.seed, drop_last=cfg.drop_last)
    model = model if model is not None else _build_model(cfg, data, xp)
    with _starting(dog, "model check"):
        check_same_params(comm, model.params)
    lr = scaled_lr(cfg.lr, comm.Get_size(), cfg.scale_lr)
    try:
        layout = flat_layout(model)
    except ValueError as exc:  # a FlatModel that broke its contract: every rank built the same model
        raise UsageError(f"the model's flat buffers: {exc}", everywhere=True) from None
    # State laid out like the model's flat buffers, so a rank can update just its shard.
    opt = build_optimizer(cfg.optimizer, model.params, lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay,
                          order=layout.order if layout is not None else None)
    with _starting(dog, "run directory broadcast"):
        run_dir = comm.bcast(cfg.run_dir or default_run_dir() if comm.Get_rank() == 0 else None, root=0)
    log = RunLog(run_dir, spec.is_master, stream=stream)
    with _starting(dog, "run directory agreement"):
        agree(comm, log.claim())  # a directory another live job holds: refused before it is read or written
    if xp is not np and backend.kernel_cache_cold():
        log.print("ringtrain: compiling GPU kernels for the first run on this machine (CuPy caches them; later "
                  "runs start in seconds)")
    if threads is not None:
        log.print(f"ringtrain: {threads} BLAS thread(s) per rank ({spec.local_size} rank(s) on this host; "
                  "set OMP_NUM_THREADS to choose)")
    position, lineage, resumed_from = resume(comm, cfg, run_dir, model.params, opt, log, dog)
    problem = None
    try:
        log.open(to_json(dataclasses.replace(cfg, run_dir=run_dir)))
        if spec.is_master:
            _new_lineage_notice(cfg, run_dir, resumed_from, log)
            write_lineage(run_dir, lineage)  # before the first checkpoint of the lineage can exist
    except OSError as exc:  # only rank 0 writes, so the others must hear of it before the first step
        problem = f"--run-dir {run_dir}: cannot write there ({exc.strerror or exc})"
    except UsageError as exc:  # another job took the directory after claim()
        problem = str(exc)
    with _starting(dog, "run directory agreement"):
        agree(comm, problem)
    return _Run(cfg, comm, spec, data, plan, model, opt, lr, log, xp, position, dog, lineage, resumed_from)


def _new_lineage_notice(cfg, run_dir, resumed_from, log):
    """Say so when a run starts afresh in a directory that holds an earlier run's checkpoints."""
    if resumed_from is None and list_checkpoints(log.checkpoint_dir):
        log.print(f"ringtrain: starting a new run in {run_dir}" + (" (--resume none)" if cfg.resume == "none" else "")
                  + "; --resume auto will follow it, not the earlier run's checkpoints, which it replaces "
                    "as it writes its own")


def _build_model(cfg, data, xp):
    # Model-specific settings (the cnn's channels and kernel) go to the builders that take them.
    options = {name: getattr(cfg, name) for name in MODEL_OPTIONS if takes_option(cfg.model, name)}
    try:
        return build_model(cfg.model, data.num_features, data.num_classes, hidden=cfg.hidden, xp=xp, seed=cfg.seed,
                           input_shape=data.image_shape, **options)
    except ValueError as exc:
        raise UsageError(str(exc), everywhere=True) from None


class _Run:
    """One :func:`train` call: its state, the loop, and what the loop calls."""

    def __init__(self, cfg, comm, spec, data, plan, model, opt, lr, log, xp, position, dog, lineage=None,
                 resumed_from=None):
        self.cfg, self.comm, self.spec, self.data, self.plan = cfg, comm, spec, data, plan
        self.model, self.opt, self.base_lr, self.log, self.xp = model, opt, lr, log, xp
        self.position = position
        self.dog = dog
        self.lineage = lineage  # rank 0: the lineage every checkpoint of this run is stamped with
        self.saved = resumed_from  # rank 0: this run's newest checkpoint on disk, as far as it knows
        self.timeline = Timeline(comm.Get_rank(), enabled=cfg.timeline is not None)
        self.phases = Phases(self.timeline, self.dog, left_neighbour(comm.Get_rank(), comm.Get_size()))
        # May move the model's buffers into shared memory: views taken before this go stale.
        with _starting(dog, "strategy set-up"):
            self.strategy, self.why = choose_strategy(cfg, model, opt, comm, self.phases)
        self.metrics = np.zeros(len(Slot), np.float64)
        self.meter = Meter()
        self.last_train, self.last_eval = {}, {}
        self.signals, self.saved = None, None
        self.start = time.perf_counter()

    # -- the loop -------------------------------------------------------------
    def loop(self, signals=None):
        """Train to the end (collective); returns the :class:`TrainResult`.

        Args:
            signals: a :class:`~ringtrain.training.stopping.StopSignals` whose
                caught signal stops every rank after the same step.
        """
        cfg, steps = self.cfg, self.plan.steps_per_epoch
        step, epoch, index, streak = dataclasses.astuple(self.position)
        self.signals = signals
        self._announce()
        self._record_start(step, epoch)
        progress = self._progress(step)
        self.log.pause = progress.paused  # the bar is cleared while rank 0 prints a line
        stopped = None
        while epoch < cfg.epochs and stopped is None:
            while index < steps and stopped is None:
                finite = self.step(step, epoch, index)
                streak = 0 if finite else self._nonfinite(step, streak + 1)
                step, index = step + 1, index + 1
                self.meter.add(self.metrics)
                progress.update(step, epoch, index, self.metrics[Slot.LOSS_SUM], self.metrics[Slot.SAMPLES])
                if step % cfg.log_every == 0:
                    self._train_event(step, epoch)
                if cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and index < steps:
                    self._checkpoint(step, epoch, index, streak)
                stopped = stop_reason(self.metrics)
            if index >= steps:
                epoch, index = epoch + 1, 0
                self._end_epoch(step, epoch, index, streak, stopped)
        progress.close()
        self.log.pause = contextlib.nullcontext
        return self._finish(step, epoch, index, streak, stopped or "done")

    def step(self, step, epoch, index):
        """One training step (collective); leaves the step's summed metrics in ``self.metrics``."""
        rows = self.plan.batch_indices(epoch, index)
        with self.phases.local("data", step):
            xb, yb = self.xp.asarray(self.data.x[rows]), self.xp.asarray(self.data.y[rows])
        lr = learning_rate(step, self.base_lr, warmup_steps=self.cfg.warmup_steps)
        return self.strategy.step(step, xb, yb, lr, lambda: self._verdicts(step + 1), self.metrics)

    # -- what the loop calls --------------------------------------------------
    def _announce(self):
        cfg, size, log = self.cfg, self.comm.Get_size(), self.log
        log.print(f"ringtrain: {size} rank(s), {self.data.num_train} training samples, batch {cfg.batch_size} per "
                  f"rank ({cfg.batch_size * size} global), {self.plan.steps_per_epoch} steps per epoch, "
                  f"run directory {log.run_dir}")
        if size > 1:
            log.print(f"ringtrain: {self.strategy.description}" + (f" ({self.why})" if self.why else ""))

    def _record_start(self, step, epoch):
        # For `ringtrain plot`: the ranks in its title, and where the run resumed.
        self.log.event("resumed" if step else "start", step=step, epoch=epoch, ranks=self.comm.Get_size())

    def _verdicts(self, step):
        # This rank's entries for the stop slots of the metrics sum: rank 0's
        # clock, and a signal caught by this rank (any rank's stops everyone).
        clock = self._stop_verdict(step)
        if self.signals is None:
            verdicts = np.zeros(len(VERDICTS))
            verdicts[0] = clock
            return verdicts
        return self.signals.verdicts(clock)

    def _stop_verdict(self, step):
        # Only rank 0's clock counts: ranks must stop at the same step, and the
        # metrics sum (zero from every other rank) carries its verdict to
        # everyone as an index into STOP_REASONS.
        if self.comm.Get_rank() != 0:
            return 0.0
        if self.cfg.max_steps is not None and step >= self.cfg.max_steps:
            return 1.0
        time_up = self.cfg.max_time is not None and time.perf_counter() - self.start >= self.cfg.max_time
        return 2.0 if time_up else 0.0

    def _nonfinite(self, step, streak):
        """Warn of a skipped step, or abort after too many; returns the streak."""
        cfg = self.cfg
        if cfg.nonfinite == "abort" or streak >= cfg.max_nonfinite:
            raise FloatingPointError(f"non-finite gradients at step {step}"
                                     + (f" ({streak} steps in a row)" if streak > 1 else "")
                                     + "; lower --lr or check the data")
        self.log.warn(f"step {step}: non-finite gradients, step skipped ({streak} in a row)")
        self.log.event("nonfinite", step=step, streak=streak)
        return streak

    def _train_event(self, step, epoch):
        event = self.meter.take_window(step, epoch)
        if event is not None:
            self.last_train = event
            self.log.event("train", **event)

    def _end_epoch(self, step, epoch, index, streak, stopped):
        cfg = self.cfg
        if self.meter.window_steps:
            self._train_event(step, epoch)
        if cfg.eval_every and epoch % cfg.eval_every == 0 and stopped is None and epoch < cfg.epochs:
            self._evaluate(step, epoch)
        sums, seconds = self.meter.take_epoch()
        self.log.print(epoch_line(epoch, cfg.epochs, sums, seconds, time.perf_counter() - self.start,
                                  self.last_eval))
        if epoch < cfg.epochs and stopped is None:
            self._checkpoint(step, epoch, index, streak)
        self.meter.restart()  # evaluation and checkpoints are not training time

    def _evaluate(self, step, epoch):
        with self.phases.watched("evaluation allreduce", step):
            loss_sum, correct, count = reduce_eval(self.model, self.data, self.comm, xp=self.xp)
        self.last_eval = {"step": step, "epoch": epoch, "loss": loss_sum / max(count, 1),
                          "accuracy": correct / max(count, 1), "samples": count}
        self.log.event("eval", **self.last_eval)

    def _checkpoint(self, step, epoch, index, streak, final=False):
        """Gather, check and (on rank 0) save; returns the path, or None (collective)."""
        with self.phases.watched("optimizer state allgather", step):
            self.strategy.gather_state()
        with self.phases.watched("parameter digest allgather", step):
            digest = check_params_everywhere(self.comm, self.model.params, step)
        if not self.spec.is_master:
            return None
        arrays = {f"params/{k}": backend.to_numpy(v) for k, v in self.model.params.items()}
        arrays.update({f"optim/{k}": v for k, v in self.opt.state_dict().items()})
        arrays.update(scaling_arrays(self.data))  # --standardize's statistics, for use outside training
        meta = {"step": step, "epoch": epoch, "step_in_epoch": index, "nonfinite_streak": streak,
                "world_size": self.comm.Get_size(), "digest": digest, "final": final,
                "config": to_json(self.cfg), "train": _finite(self.last_train), "eval": _finite(self.last_eval),
                "lineage": self.lineage.id if self.lineage is not None else None}
        try:
            path = save_checkpoint(self.log.checkpoint_dir, step, arrays, meta, keep=self.cfg.keep)
        except (OSError, CheckpointError) as exc:  # save_checkpoint turns an OSError into CheckpointError
            # The earlier checkpoints are intact; training can go on, and the
            # next checkpoint may well succeed (a full disk gets cleaned up).
            self.log.warn(f"checkpoint at step {step} not written: {exc}")
            self.log.event("checkpoint_failed", step=step, epoch=epoch, error=str(exc))
            return None
        self.log.event("checkpoint", step=step, epoch=epoch, path=path)
        self.saved = path
        return path

    def _finish(self, step, epoch, index, streak, stopped):
        self._evaluate(step, epoch)
        path = self._checkpoint(step, epoch, index, streak, final=True)
        newest = None
        if self.spec.is_master and path is None and self.saved is not None and os.path.isfile(self.saved):
            newest = self.saved
        # Every rank returns the same outcome, so every rank exits with the same status.
        with self.phases.watched("final checkpoint broadcast", step):
            path, newest = self.comm.bcast((path, newest), root=0)
        self.log.event("done", step=step, epoch=epoch, stopped=stopped, checkpoint=path)
        self.log.print(f"done: step {step}, epoch {epoch} ({stopped}); test accuracy "
                       f"{self.last_eval.get('accuracy', float('nan')):.2%}")
        self._write_timeline(step)
        with self.phases.watched("strategy shutdown", step):
            self.strategy.close()
        self.log.close()
        params = {name: backend.to_numpy(p).copy() for name, p in self.model.params.items()}
        return TrainResult(params, step, epoch, self.last_train, self.last_eval, self.log.run_dir, stopped,
                           path, newest)

    def _progress(self, step):
        cfg, total = self.cfg, self.cfg.epochs * self.plan.steps_per_epoch
        if cfg.max_steps is not None:
            total = min(total, cfg.max_steps)
        isatty = sys.stderr.isatty()
        mode = choose_mode(self.spec.is_master, cfg.progress, isatty,
                           isatty and importlib.util.find_spec("tqdm") is not None)
        return Progress(mode, total=total, initial=step, epochs=cfg.epochs, steps_per_epoch=self.plan.steps_per_epoch,
                        every=cfg.progress_every, deadline=None if cfg.max_time is None else self.start + cfg.max_time)

    def _write_timeline(self, step):
        if not self.timeline.enabled:
            return
        with self.phases.watched("timeline gather", step):
            events = self.comm.gather(self.timeline.events, root=0)
        if self.spec.is_master:
            try:
                Timeline.write(self.cfg.timeline, events)
            except OSError as exc:  # checked at the start; the run's checkpoints are safe either way
                self.log.warn(f"--timeline {self.cfg.timeline}: not written ({os_reason(exc)})")


def _finite(record):
    """A metrics record with NaN/inf as None: checkpoint metadata is strict JSON."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}

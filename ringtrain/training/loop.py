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
from ..cluster.slurm import job_end_time, job_id, time_left
from ..cluster.topology import TaskSpec
from ..comm.guard import timeout_from_env
from ..errors import UsageError
from ..failure import agree
from ..io.safeio import os_reason
from ..optim import learning_rate
from ..watchdog import Watchdog, left_neighbour
from .config import TrainConfig, validate
from .evaluate import reduce_eval
from .metrics import Meter, epoch_line, epoch_record, final_line, outcome_warnings
from .progress import Progress, choose_mode
from .replicas import check_same_settings
from .saving import Checkpointer, Diverged
from .startup import start, starting, usable_timeout
from .stopping import EXIT_SLACK, Deadline, StopSignals
from .strategy import STOP_REQUESTS, Metric, Phases, choose_strategy, stop_reason
from .timeline import Timeline

__all__ = ["train", "TrainResult", "Diverged"]


@dataclasses.dataclass
class TrainResult:
    """What :func:`train` returns on every rank."""

    params: dict          # name -> NumPy copy of the final parameters
    step: int             # optimizer steps taken in all (resumed runs count earlier steps)
    epoch: int            # epochs completed
    train: dict           # the last train event: loss, accuracy, samples_per_sec
    eval: dict            # the last eval event: loss, accuracy (empty if none ran)
    run_dir: str
    stopped: str          # "done", "max_time", "max_steps", "time_limit", or the signal: "sigint", "sigterm", "sigusr1"
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

    Raises:
        Diverged: on every rank at the same step, when the gradients stayed
            non-finite (``--max-nonfinite`` steps in a row, or one with
            ``--nonfinite abort``); on rank 0 its ``advice`` names the last
            good checkpoint and how to go on from it. No checkpoint of a
            non-finite state is ever written.
    """
    from mpi4py import MPI

    comm = comm if comm is not None else MPI.COMM_WORLD
    # Every collective from here to the end is watched: a rank that stalls
    # anywhere ends the job within --timeout, naming the operation.
    dog = Watchdog(comm, cfg.timeout if usable_timeout(cfg.timeout) else TrainConfig.timeout)
    try:
        # The first collective: every rank's verdict on the values, plus
        # rank 0's on the paths that only it touches.
        problem = None
        try:
            validate(cfg, root=comm.Get_rank() == 0)
            check_environment(os.environ)
        except UsageError as exc:
            problem = str(exc)
        with starting(dog, "settings agreement"):
            agree(comm, problem)
            check_same_settings(comm, cfg)
        with starting(dog, "topology allgather"):
            # A CPU run never asks CuPy: that would initialise the CUDA driver in every rank.
            spec = TaskSpec.from_mpi(comm, device_count=None if cfg.device == "gpu" else 0)
        with spec.limited_threads() as threads, StopSignals(comm) as signals:
            run = _Run(start(cfg, comm, spec, model, stream, threads, dog))
            # Divergence is found and said by ringtrain itself: NumPy's overflow
            # warnings on every rank would bury the one line that matters.
            with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
                return run.loop(signals)
    finally:
        dog.close()


class _Run:
    """One :func:`train` call: its state, the loop, and what the loop calls."""

    def __init__(self, start):
        self.cfg, self.comm, self.spec, self.data, self.plan = start.cfg, start.comm, start.spec, start.data, start.plan
        self.model, self.opt, self.base_lr, self.log, self.xp = start.model, start.opt, start.lr, start.log, start.xp
        self.position, self.dog, self.schedule = start.position, start.dog, start.schedule
        self.timeline = Timeline(self.comm.Get_rank(), enabled=self.cfg.timeline is not None)
        self.phases = Phases(self.timeline, self.dog, left_neighbour(self.comm.Get_rank(), self.comm.Get_size()))
        # May move the model's buffers into shared memory: views taken before this go stale.
        with starting(self.dog, "strategy set-up"):
            self.strategy, self.why = choose_strategy(self.cfg, self.model, self.opt, self.comm, self.phases)
        self.checkpoints = Checkpointer(start, self.strategy, self.phases)
        self.metrics = np.zeros(len(Metric), np.float64)
        self.meter = Meter()
        self.last_train, self.last_eval, self.best_train = {}, {}, None
        self.signals = None
        self.started = time.perf_counter()
        self.deadline = _deadline(self)

    # -- the loop -------------------------------------------------------------
    def loop(self, signals=None):
        """Train to the end (collective); returns the :class:`TrainResult`.

        Args:
            signals: a :class:`~ringtrain.training.stopping.StopSignals` whose
                caught signal stops every rank after the same step.
        """
        cfg, position = self.cfg, self.position
        step, epoch, index, streak = position.step, position.epoch, position.step_in_epoch, position.nonfinite_streak
        self.signals = signals
        _announce(self)
        # For `ringtrain plot`: the ranks in its title, and where the run resumed.
        self.log.event("resumed" if step else "start", step=step, epoch=epoch, ranks=self.comm.Get_size())
        progress = _progress(self, step)
        self.log.pause = progress.paused  # the bar is cleared while rank 0 prints a line
        stopped = "max_steps" if cfg.max_steps is not None and step >= cfg.max_steps else None
        while epoch < cfg.epochs and stopped is None:
            if self.schedule.epoch != epoch:  # a new epoch: an ordinary one at this rank count
                self.schedule = self.plan.schedule(epoch)
            steps = self.schedule.steps
            while index < steps and stopped is None:
                streak = self._streak(step, self.step(step, epoch, index), streak, progress)
                step, index = step + 1, index + 1
                self.meter.add(self.metrics)
                progress.update(step, epoch, index, self.metrics[Metric.LOSS_SUM], self.metrics[Metric.SAMPLES])
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
        rows = self.schedule.batch_indices(index)
        with self.phases.local("data", step):
            xb, yb = self.xp.asarray(self.data.x[rows]), self.xp.asarray(self.data.y[rows])
        lr = learning_rate(step, self.base_lr, warmup_steps=self.cfg.warmup_steps)
        return self.strategy.step(step, xb, yb, lr, lambda: _stop_requests(self, step + 1), self.metrics)

    # -- what the loop calls --------------------------------------------------
    def _streak(self, step, finite, streak, progress):
        """The non-finite streak after ``step``; said when it ends; too long a one ends the run on every rank."""
        if finite:
            _say_skipped(self.log, step, streak)
            return 0
        streak += 1
        if self.cfg.nonfinite == "abort" or streak >= self.cfg.max_nonfinite:
            why = "non-finite gradients" + (f", {streak} steps in a row" if streak > 1 else "")
            diverged = self.checkpoints.diverged(step, why)
            self.log.event("diverged", step=step, streak=streak, last_good=diverged.last_good)
            progress.close()
            self.log.pause = contextlib.nullcontext
            with self.phases.watched("strategy shutdown", step):
                self.strategy.close()
            self.log.close()
            raise diverged
        self.log.event("nonfinite", step=step, streak=streak)
        return streak

    def _train_event(self, step, epoch):
        event = self.meter.take_window(step, epoch)
        if event is not None:
            event["lr"] = learning_rate(step - 1, self.base_lr, warmup_steps=self.cfg.warmup_steps)  # its last step's
            self.last_train = event
            if _finite_loss(event) and (self.best_train is None or event["loss"] < self.best_train["loss"]):
                self.best_train = event
            self.log.event("train", **event)

    def _end_epoch(self, step, epoch, index, streak, stopped):
        cfg = self.cfg
        if self.meter.window_steps:
            self._train_event(step, epoch)
        if cfg.eval_every and epoch % cfg.eval_every == 0 and stopped is None and epoch < cfg.epochs:
            self._evaluate(step, epoch)
        sums, seconds = self.meter.take_epoch()
        record = epoch_record(step, epoch, sums, seconds)
        if record is not None:  # the console's epoch figures, for TensorBoard's train series and plots
            self.log.event("epoch", **record)
        self.log.print(epoch_line(epoch, cfg.epochs, sums, seconds, time.perf_counter() - self.started,
                                  self.last_eval))
        if epoch < cfg.epochs and stopped is None:
            self._checkpoint(step, epoch, index, streak)
        self.meter.restart()  # evaluation and checkpoints are not training time

    def _evaluate(self, step, epoch):
        with self.phases.watched("evaluation allreduce", step), self.deadline.timed("evaluation"):
            loss_sum, correct, count = reduce_eval(self.model, self.data, self.comm, xp=self.xp)
        # An empty test set has no accuracy: None, never a made-up 0%.
        self.last_eval = {"step": step, "epoch": epoch, "loss": loss_sum / count if count else None,
                          "accuracy": correct / count if count else None, "samples": count}
        self.log.event("eval", **self.last_eval)

    def _checkpoint(self, step, epoch, index, streak, final=False):
        parts = self.schedule.parts_at(index) if self.schedule.epoch == epoch else ()
        with self.deadline.timed("checkpoint"):
            return self.checkpoints.save(step, epoch, index, streak, (self.last_train, self.last_eval), final, parts)

    def _finish(self, step, epoch, index, streak, stopped):
        _say_skipped(self.log, step, streak)
        self._evaluate(step, epoch)
        path = self._checkpoint(step, epoch, index, streak, final=True)
        newest = self.checkpoints.last_good() if self.spec.is_master and path is None else None
        # Every rank returns the same outcome, so every rank exits with the same status.
        with self.phases.watched("final checkpoint broadcast", step):
            path, newest = self.comm.bcast((path, newest), root=0)
        self.log.event("done", step=step, epoch=epoch, stopped=stopped, checkpoint=path)
        self.log.print(final_line(stopped, step, epoch, index, self.plan.steps_per_epoch,
                                  self.last_eval.get("accuracy")))
        for line in outcome_warnings(self.best_train, self.last_train, self.last_eval, self.data.num_classes):
            self.log.warn(line)
        _write_timeline(self, step)
        with self.phases.watched("strategy shutdown", step):
            self.strategy.close()
        self.log.close()
        params = {name: backend.to_numpy(p).copy() for name, p in self.model.params.items()}
        return TrainResult(params, step, epoch, self.last_train, self.last_eval, self.log.run_dir, stopped,
                           path, newest)


def _finite_loss(event):
    return isinstance(event.get("loss"), float) and math.isfinite(event["loss"])


def _stop_requests(run, step):
    """This rank's entries for the stop requests of the metrics sum: rank 0's clock, and a signal it caught.

    Only rank 0's clock counts: ranks must stop at the same step, and the
    metrics sum (zero from every other rank) carries it to everyone as an
    index into STOP_REASONS. A signal caught by any rank stops everyone.
    """
    cfg, clock = run.cfg, 0.0
    if run.comm.Get_rank() == 0:
        time_up = cfg.max_time is not None and time.perf_counter() - run.started >= cfg.max_time
        limit = run.deadline.reached()
        clock = (1.0 if cfg.max_steps is not None and step >= cfg.max_steps else 2.0 if time_up
                 else 3.0 if limit else 0.0)
    if run.signals is None:
        requests = np.zeros(len(STOP_REQUESTS))
        requests[0] = clock
        return requests
    return run.signals.requests(clock)


def check_environment(env):
    """Read the numbers a run takes from the environment, so that a bad one is agreed on by every rank (pure).

    Rank 0 alone reads the Slurm job's end while training, and the library's collectives read their
    bound at their first call: read first on every rank, garbage in any is refused before anything
    is written (:class:`~ringtrain.environment.EnvironmentValueError`).
    """
    timeout_from_env(env)
    job_end_time(env)
    job_id(env)


def _deadline(run):
    """Rank 0's :class:`Deadline` from the Slurm job's time limit (the other ranks' never fires); says when."""
    if run.comm.Get_rank() != 0 or not run.cfg.stop_before_time_limit:
        return Deadline(None)
    seconds, source = time_left(os.environ)
    if seconds is None:
        if source not in ("not in a Slurm job", "no time limit"):
            run.log.warn(f"cannot read the Slurm job's time limit ({source}); training runs until a signal stops it")
        return Deadline(None)
    # The checkpoint holds the parameters and up to two optimizer buffers per parameter (Adam's moments).
    size = 3 * sum(int(p.nbytes) for p in run.model.params.values())
    test_rows = run.data.y_test.shape[0]
    deadline = Deadline(seconds, size, max(1, math.ceil(test_rows / run.cfg.batch_size)))
    end = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() + seconds))
    run.log.print(f"ringtrain: the Slurm job's time limit is at {end} ({source}); training stops with a checkpoint "
                  "before it, leaving twice the slowest step, evaluation and checkpoint plus "
                  f"{EXIT_SLACK:g} s (--no-stop-before-time-limit to run into it)")
    return deadline


def _say_skipped(log, step, streak):
    # One line per streak, once it is over (``step`` is the first finite step
    # after it): a run that diverges says so in its last line alone, not in
    # one line per step on the way there.
    if streak == 1:
        log.warn(f"step {step - 1}: non-finite gradients, step skipped (1 in a row)")
    elif streak:
        log.warn(f"steps {step - streak}-{step - 1}: non-finite gradients, {streak} steps skipped in a row")


def _announce(run):
    cfg, size, log = run.cfg, run.comm.Get_size(), run.log
    log.print(f"ringtrain: {size} rank(s), {run.data.num_train} training samples, batch {cfg.batch_size} per "
              f"rank ({cfg.batch_size * size} global), {run.plan.steps_per_epoch} steps per epoch, "
              f"run directory {log.run_dir}")
    if size > 1:
        log.print(f"ringtrain: {run.strategy.description}" + (f" ({run.why})" if run.why else ""))


def _progress(run, step):
    cfg, total = run.cfg, run.cfg.epochs * run.plan.steps_per_epoch
    if cfg.max_steps is not None:
        total = min(total, cfg.max_steps)
    isatty = sys.stderr.isatty()
    have_tqdm = isatty and importlib.util.find_spec("tqdm") is not None
    mode = choose_mode(run.spec.is_master, cfg.progress, isatty, have_tqdm)
    return Progress(mode, total=total, initial=step, epochs=cfg.epochs, steps_per_epoch=run.plan.steps_per_epoch,
                    every=cfg.progress_every, deadline=None if cfg.max_time is None else run.started + cfg.max_time)


def _write_timeline(run, step):
    if not run.timeline.enabled:
        return
    with run.phases.watched("timeline gather", step):
        events = run.comm.gather(run.timeline.events, root=0)
    if run.spec.is_master:
        try:
            Timeline.write(run.cfg.timeline, events)
        except OSError as exc:  # checked at the start; the run's checkpoints are safe either way
            run.log.warn(f"--timeline {run.cfg.timeline}: not written ({os_reason(exc)})")

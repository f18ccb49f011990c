"""The training loop: every rank the same model, its own shard, one averaging call.

Synchronisation points: :func:`train` is collective. Every rank of ``comm``
must call it with the same configuration. Each step makes, in this order on
every rank, either

* with ``shard_optimizer`` (where :class:`ringtrain.zero.ShardedStep`
  applies): the gradient reduce-scatter, one small sum of the step's metrics
  and non-finite flags, and the parameter allgather after each rank has
  updated its shard; or
* the gradient allreduce (one call per fusion bucket; with ``overlap``,
  started from backward's ``on_grad`` on the Reducer's own duplicate
  communicator and finished before the optimizer step) and one small metrics
  allreduce;

plus, at every checkpoint and at the end, the sharded optimizer state's
allgather (when sharded) and a digest allgather. Rank 0 is the master: it
alone prints, writes the run directory and writes checkpoints; on resume it
reads the checkpoint and broadcasts it.
"""

import dataclasses
import hashlib
import math
import sys
import time

import numpy as np

from . import backend
from .checkpoint import CheckpointError, latest_valid_checkpoint, read_checkpoint, save_checkpoint
from .collectives import allreduce_many_, broadcast_, plan_buckets
from .config import MUST_MATCH, to_json, validate
from .data import EpochPlan
from .datasets import load_sharded, reduce_eval
from .errors import MismatchError, UsageError
from .failure import agree
from .models import build_model
from .optim import build_optimizer, learning_rate, scaled_lr
from .overlap import Reducer
from .runlog import RunLog, default_run_dir
from .timeline import Timeline
from .topology import TaskSpec
from .watchdog import Watchdog, left_neighbour
from .zero import ShardedStep, flat_layout

__all__ = ["train", "TrainResult", "params_digest"]


@dataclasses.dataclass
class TrainResult:
    """What :func:`train` returns on every rank."""

    params: dict          # name -> NumPy copy of the final parameters
    step: int             # optimizer steps taken in all (resumed runs count earlier steps)
    epoch: int            # epochs completed
    train: dict           # the last train event: loss, accuracy, samples_per_sec
    eval: dict            # the last eval event: loss, accuracy (empty if none ran)
    run_dir: str
    stopped: str          # "done", "max_time" or "max_steps"


def params_digest(params):
    """SHA-256 of every parameter's bytes, in name order: equal iff bitwise equal."""
    h = hashlib.sha256()
    for name in sorted(params):
        a = np.ascontiguousarray(backend.to_numpy(params[name]))
        h.update(name.encode())
        h.update(str(a.dtype).encode())
        h.update(repr(a.shape).encode())
        h.update(a.tobytes())
    return h.hexdigest()


def _check_same_settings(comm, cfg):
    """Raise MismatchError on every rank if the ranks were given different settings."""
    mine = {name: getattr(cfg, name) for name in MUST_MATCH}
    everyone = comm.allgather(mine)
    for name in MUST_MATCH:
        values = [e[name] for e in everyone]
        if any(v != values[0] for v in values):
            odd = next(r for r, v in enumerate(values) if v != values[0])
            flag = "--" + name.replace("_", "-")
            raise MismatchError(f"ranks disagree on {flag}: rank 0 has {values[0]!r}, rank {odd} has "
                                f"{values[odd]!r}; give every rank the same settings")


def _check_same_params(comm, params):
    """Raise MismatchError on every rank unless all ranks hold the same parameter list."""
    mine = [(name, tuple(p.shape), str(p.dtype)) for name, p in params.items()]
    everyone = comm.allgather(mine)
    for rank, theirs in enumerate(everyone):
        if theirs != everyone[0]:
            diff = next((a, b) for a, b in zip(everyone[0] + [None] * len(theirs), theirs + [None] * len(everyone[0]))
                        if a != b)
            raise MismatchError(f"ranks disagree on the model's parameters: rank 0 has {diff[0]}, rank {rank} has "
                                f"{diff[1]}; every rank must build the same model")


def _check_same_params_everywhere(comm, params, step):
    """Allgather a digest of the parameters; a difference means the ranks diverged: abort."""
    mine = params_digest(params)
    everyone = comm.allgather(mine)
    for rank, digest in enumerate(everyone):
        if digest != everyone[0]:
            raise RuntimeError(f"parameters differ across ranks at step {step}: rank 0 {everyone[0][:12]}, "
                               f"rank {rank} {digest[:12]}; the replicas have diverged")
    return mine


def _find_checkpoint(cfg, run_dir, warn):
    """On rank 0: the checkpoint to resume from as (path, arrays, metadata), or None."""
    import os

    if cfg.resume == "none":
        return None
    if cfg.resume == "auto":
        directory = os.path.join(run_dir, "checkpoints")
        return latest_valid_checkpoint(directory, warn=warn) if os.path.isdir(directory) else None
    if os.path.isdir(cfg.resume):
        sub = os.path.join(cfg.resume, "checkpoints")
        found = latest_valid_checkpoint(sub if os.path.isdir(sub) else cfg.resume, warn=warn)
        if found is None:
            raise UsageError(f"--resume {cfg.resume}: no valid checkpoint there")
        return found
    arrays, meta = read_checkpoint(cfg.resume)
    return cfg.resume, arrays, meta


def _resume(comm, cfg, run_dir, params, opt, log):
    """Rank 0 loads and verifies a checkpoint, then every rank receives it.

    Collective. Returns the data position ``(global_step, epoch, step_in_epoch,
    nonfinite_streak)``; without a checkpoint, rank 0's initial parameters are
    broadcast so every replica starts identical.
    """
    found, problem = None, None
    if comm.Get_rank() == 0:
        try:
            found = _find_checkpoint(cfg, run_dir, log.warn)
            if found is not None:
                _, arrays, meta = found
                for name, p in params.items():
                    a = arrays.get(f"params/{name}")
                    if a is None or a.shape != tuple(p.shape) or a.dtype != p.dtype:
                        raise UsageError(f"checkpoint {found[0]} does not fit this model (parameter {name}); "
                                         "use --resume none or a matching --model/--hidden")
        except UsageError as exc:
            problem = str(exc)
    agree(comm, problem)
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
        return 0, 0, 0, 0
    opt.load_state_dict(header["optim"])
    meta = header["meta"]
    if meta.get("world_size") not in (None, comm.Get_size()):
        log.warn(f"resuming a {meta['world_size']}-rank run on {comm.Get_size()} ranks: "
                 "the data order differs, so results will not match the original run exactly")
    log.print(f"resumed from {header['path']} at step {meta['step']} (epoch {meta['epoch']})")
    return meta["step"], meta["epoch"], meta["step_in_epoch"], meta.get("nonfinite_streak", 0)


def train(cfg, comm=None, *, model=None, stream=None):
    """Train data-parallel on every rank of ``comm``; collective.

    Args:
        cfg: a :class:`ringtrain.config.TrainConfig` (validated here).
        comm: the communicator (default ``MPI.COMM_WORLD``).
        model: your own model object (``params``, ``loss_and_grad``,
            ``evaluate``); default builds ``cfg.model``.
        stream: where rank 0 prints (default stdout).

    Returns:
        A :class:`TrainResult`, on every rank.
    """
    from mpi4py import MPI

    comm = comm if comm is not None else MPI.COMM_WORLD
    validate(cfg)
    _check_same_settings(comm, cfg)
    spec = TaskSpec.from_mpi(comm)
    threads = spec.limit_threads()
    problem = None
    try:
        xp = backend.xp_for(cfg.device)
    except ValueError as exc:
        problem = str(exc)
    agree(comm, problem)
    backend.use_device(spec.device)

    data = load_sharded(cfg.dataset, comm, seed=cfg.seed, test_fraction=cfg.test_fraction,
                        samples=cfg.samples, features=cfg.features, classes=cfg.classes)
    plan = EpochPlan.for_shard(data, comm, batch_size=cfg.batch_size, seed=cfg.seed, drop_last=cfg.drop_last)
    if model is None:
        try:
            hidden = cfg.hidden if cfg.model in ("mlp", "cnn") else ()
            conv = dict(channels=cfg.channels, kernel=cfg.kernel) if cfg.model == "cnn" else {}
            model = build_model(cfg.model, data.num_features, data.num_classes, hidden=hidden,
                                xp=xp, seed=cfg.seed, input_shape=data.image_shape, **conv)
        except ValueError as exc:
            raise UsageError(str(exc), everywhere=True) from None
    params = model.params
    _check_same_params(comm, params)
    lr = scaled_lr(cfg.lr, comm.Get_size(), cfg.scale_lr)
    # State laid out like the model's flat buffers, so a rank can update just its shard.
    opt = build_optimizer(cfg.optimizer, params, lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay,
                          order=flat_layout(model))

    run_dir = comm.bcast(cfg.run_dir or default_run_dir() if comm.Get_rank() == 0 else None, root=0)
    log = RunLog(run_dir, spec.is_master, stream=stream)
    if threads is not None:
        log.print(f"ringtrain: {threads} BLAS thread(s) per rank ({spec.local_size} rank(s) on this host; "
                  "set OMP_NUM_THREADS to choose)")
    step, epoch, step_in_epoch, streak = _resume(comm, cfg, run_dir, params, opt, log)
    problem = None
    try:
        log.open(to_json(dataclasses.replace(cfg, run_dir=run_dir)))
    except OSError as exc:  # only rank 0 writes, so the others must hear of it before the first step
        problem = f"--run-dir {run_dir}: cannot write there ({exc.strerror or exc})"
    agree(comm, problem)
    return _Loop(cfg, comm, spec, data, plan, model, opt, lr, log, xp).run(step, epoch, step_in_epoch, streak)


class _Loop:
    """The epoch/step loop with its bookkeeping; one instance per :func:`train` call."""

    def __init__(self, cfg, comm, spec, data, plan, model, opt, lr, log, xp):
        self.cfg, self.comm, self.spec, self.data, self.plan = cfg, comm, spec, data, plan
        self.model, self.opt, self.base_lr, self.log, self.xp = model, opt, lr, log, xp
        self.params = model.params
        self.bucket_bytes = int(cfg.bucket_mb * 2**20)
        self.compression = "fp16" if cfg.fp16_allreduce else None
        self.grad_slices = _grad_slices(model, self.bucket_bytes)
        self.dog = Watchdog(comm, cfg.timeout)
        self.left = left_neighbour(comm.Get_rank(), comm.Get_size())
        self.timeline = Timeline(comm.Get_rank(), enabled=cfg.timeline is not None)
        self.reducer, self.current_step = None, None
        # One bucket (the default 4 MiB holds a whole small MLP) or one rank:
        # nothing could overlap, and the thread hand-off would only cost time.
        buckets = plan_buckets(list(reversed(self.params.values())), self.bucket_bytes)
        if cfg.overlap and len(buckets) > 1 and comm.Get_size() > 1:
            # Registered in the order backward delivers them, so buckets fill early;
            # the MLP's own gradient buffers are reduced in place.
            grads = getattr(model, "grads", None) or {n: xp.zeros_like(p) for n, p in self.params.items()}
            self.reducer = Reducer(comm, {n: grads[n] for n in reversed(self.params)}, self.bucket_bytes,
                                   op="mean", compression=self.compression, algorithm=cfg.allreduce,
                                   trace=self._bucket_span if self.timeline.enabled else None)
        self.sharded = None
        # One rank has nothing to shard: it keeps the plain step (the baseline scaling is measured against).
        if (cfg.shard_optimizer and comm.Get_size() > 1 and self.reducer is None and self.compression is None
                and xp is np):
            # May move the model's buffers into shared memory: the old views go stale.
            self.sharded = ShardedStep.create(model, opt, comm, cfg.allreduce)
            if self.sharded is not None:
                self.grad_slices = None
        self.total_steps = cfg.epochs * plan.steps_per_epoch
        if cfg.max_steps is not None:
            self.total_steps = min(self.total_steps, cfg.max_steps)
        # Summed across ranks every step: loss sum, correct, samples, stop reason
        # (rank 0's alone), ranks whose reduced gradient is not finite.
        self.metrics = np.zeros(5, np.float64)
        self.last_train, self.last_eval = {}, {}
        self.start = time.perf_counter()

    def _bucket_span(self, k):
        # Runs on the Reducer's communication thread: its own row in the timeline.
        return self.timeline.span(f"allreduce bucket {k}", self.current_step, tid=1)

    # -- one step -------------------------------------------------------------
    def step(self, step, epoch, index):
        """One training step (collective); leaves the step's summed metrics in ``self.metrics``.

        Returns whether the gradients were finite (if not, no rank updated).
        """
        xp, tl = self.xp, self.timeline
        self.current_step = step
        rows = self.plan.batch_indices(epoch, index)
        with tl.span("data", step):
            xb = xp.asarray(self.data.x[rows])
            yb = xp.asarray(self.data.y[rows])
        if self.sharded is not None:
            return self._sharded_step(step, xb, yb)
        if self.reducer is not None:
            loss, grads, correct = self._overlapped_backward(step, xb, yb)
        else:
            with tl.span("forward+backward", step):
                loss, grads, correct = self.model.loss_and_grad(xb, yb)
            with tl.span("allreduce", step), self.dog.watch("gradient allreduce", step, self.left):
                allreduce_many_(self.grad_slices or [grads[n] for n in reversed(grads)], op="mean",
                                comm=self.comm, bucket_bytes=self.bucket_bytes, algorithm=self.cfg.allreduce,
                                compression=self.compression)
        arrays = self.grad_slices or list(grads.values())
        # The reduced gradients are bitwise equal on every rank, so this
        # decision is the same everywhere without another collective.
        finite = all(bool(xp.isfinite(g).all()) for g in arrays)
        if finite:
            with tl.span("optimizer", step):
                self.opt.step(self.params, grads, self._lr(step))
        self.metrics[:] = (loss * len(rows), correct, len(rows), self._should_stop(step + 1), 0.0)
        with self.dog.watch("metrics allreduce", step, self.left):
            self.comm.Allreduce(_in_place(), self.metrics)
        return finite

    def _sharded_step(self, step, xb, yb):
        # Each rank holds only its chunk of the reduced gradient, so finiteness
        # is agreed in the metrics sum, before anyone updates.
        tl, dog, sharded = self.timeline, self.dog, self.sharded
        with tl.span("forward+backward", step):
            loss, _, correct = self.model.loss_and_grad(xb, yb)
        with tl.span("reduce-scatter", step), dog.watch("gradient reduce-scatter", step, self.left):
            chunk = sharded.reduce_gradients()
        bad = 0.0 if np.isfinite(chunk).all() else 1.0
        self.metrics[:] = (loss * len(xb), correct, len(xb), self._should_stop(step + 1), bad)
        with dog.watch("metrics allreduce", step, self.left):
            sharded.sum_small(self.metrics)
        if self.metrics[4] > 0:
            return False
        with tl.span("optimizer", step):
            sharded.update(self._lr(step))
        with tl.span("allgather", step), dog.watch("parameter allgather", step, self.left):
            sharded.allgather()
        return True

    def _overlapped_backward(self, step, xb, yb):
        tl = self.timeline
        # Each gradient goes to the reducer as backward finishes it; its
        # bucket is reduced on the communication thread meanwhile.
        pushed = set()

        def on_grad(name, grad):
            pushed.add(name)
            self.reducer.push(name, grad)

        # Not watched: the model's own time is not a collective's (a slow
        # rank is named by the others, waiting below).
        with tl.span("forward+backward", step):
            loss, grads, correct = self.model.loss_and_grad(xb, yb, on_grad=on_grad)
        with tl.span("allreduce wait", step), self.dog.watch("gradient allreduce", step, self.left):
            for name in reversed(grads):  # a model that skipped on_grad for some
                if name not in pushed:
                    self.reducer.push(name, grads[name])
            self.reducer.wait()
        return loss, grads, correct

    def _lr(self, step):
        return learning_rate(step, self.base_lr, warmup_steps=self.cfg.warmup_steps)

    # -- the loop -------------------------------------------------------------
    def run(self, step, epoch, index, streak):
        cfg, log = self.cfg, self.log
        steps = self.plan.steps_per_epoch
        gbatch = cfg.batch_size * self.comm.Get_size()
        log.print(f"ringtrain: {self.comm.Get_size()} rank(s), {self.data.num_train} training samples, "
                  f"batch {cfg.batch_size} per rank ({gbatch} global), {steps} steps per epoch, "
                  f"run directory {log.run_dir}")
        if self.comm.Get_size() > 1:
            log.print(f"ringtrain: {self._averaging()}")
        bar = self._progress(step)
        stopped = "done"
        window = np.zeros(3, np.float64)
        window_start, window_steps = time.perf_counter(), 0
        while epoch < cfg.epochs and stopped == "done":
            epoch_sums = np.zeros(3, np.float64)
            epoch_start = time.perf_counter()
            while index < steps:
                finite = self.step(step, epoch, index)
                streak = 0 if finite else streak + 1
                if not finite:
                    self._nonfinite(step, streak)
                step, index = step + 1, index + 1
                window += self.metrics[:3]
                epoch_sums += self.metrics[:3]
                window_steps += 1
                if bar is not None:
                    bar.update(1)
                if step % cfg.log_every == 0:
                    self._train_event(step, epoch, window, time.perf_counter() - window_start)
                    window[:] = 0
                    window_start, window_steps = time.perf_counter(), 0
                if cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and index < steps:
                    self._checkpoint(step, epoch, index, streak)
                if self.metrics[3] > 0:
                    stopped = _STOP_REASONS[int(self.metrics[3])]
                    break
            if index >= steps:
                epoch, index = epoch + 1, 0
                if window_steps:
                    self._train_event(step, epoch, window, time.perf_counter() - window_start)
                    window[:] = 0
                if cfg.eval_every and epoch % cfg.eval_every == 0 and stopped == "done" and epoch < cfg.epochs:
                    self._evaluate(step, epoch)
                self._epoch_line(epoch, epoch_sums, time.perf_counter() - epoch_start)
                if epoch < cfg.epochs and stopped == "done":
                    self._checkpoint(step, epoch, index, streak)
                # Evaluation and checkpoints are not training: the next window starts here.
                window_start, window_steps = time.perf_counter(), 0
        if bar is not None:
            bar.close()
        self._evaluate(step, epoch)
        path = self._checkpoint(step, epoch, index, streak, final=True)
        log.event("done", step=step, epoch=epoch, stopped=stopped, checkpoint=path)
        log.print(f"done: step {step}, epoch {epoch} ({stopped}); test accuracy "
                  f"{self.last_eval.get('accuracy', float('nan')):.2%}")
        self._write_timeline()
        if self.reducer is not None:
            self.reducer.close()
        if self.sharded is not None:
            self.sharded.close()
        self.dog.close()
        log.close()
        params = {name: backend.to_numpy(p).copy() for name, p in self.params.items()}
        return TrainResult(params, step, epoch, self.last_train, self.last_eval, log.run_dir, stopped)

    def _averaging(self):
        """How this run averages gradients, in words (for the start of the log)."""
        if self.sharded is not None:
            return f"sharded optimizer step (reduce-scatter, update, allgather) over {self.sharded.kind}"
        how = f"allreduce ({self.cfg.allreduce}"
        how += ", float16 on the wire" if self.compression else ""
        how += f", overlapped in {len(self.reducer.buckets)} buckets)" if self.reducer is not None else ")"
        return how + ", then the whole update on every rank"

    # -- hooks ----------------------------------------------------------------
    def _time_up(self):
        return self.cfg.max_time is not None and time.perf_counter() - self.start >= self.cfg.max_time

    def _should_stop(self, step):
        # Only rank 0's clock counts: ranks must stop at the same step, and the
        # metrics allreduce (a sum, zero from every other rank) carries its
        # verdict to everyone as an index into _STOP_REASONS.
        if self.comm.Get_rank() != 0:
            return 0.0
        if self.cfg.max_steps is not None and step >= self.cfg.max_steps:
            return 1.0
        return 2.0 if self._time_up() else 0.0

    def _nonfinite(self, step, streak):
        cfg = self.cfg
        if cfg.nonfinite == "abort" or streak >= cfg.max_nonfinite:
            raise FloatingPointError(f"non-finite gradients at step {step}"
                                     + (f" ({streak} steps in a row)" if streak > 1 else "")
                                     + "; lower --lr or check the data")
        self.log.warn(f"step {step}: non-finite gradients, step skipped ({streak} in a row)")
        self.log.event("nonfinite", step=step, streak=streak)

    def _train_event(self, step, epoch, sums, seconds):
        loss_sum, correct, n = sums
        if n == 0:
            return
        self.last_train = {"step": step, "epoch": epoch, "loss": loss_sum / n, "accuracy": correct / n,
                           "samples_per_sec": n / seconds if seconds > 0 else float("nan")}
        self.log.event("train", **self.last_train)

    def _evaluate(self, step, epoch):
        with self.dog.watch("evaluation allreduce", step, self.left):
            loss_sum, correct, count = reduce_eval(self.model, self.data, self.comm, xp=self.xp)
        self.last_eval = {"step": step, "epoch": epoch, "loss": loss_sum / max(count, 1),
                          "accuracy": correct / max(count, 1), "samples": count}
        self.log.event("eval", **self.last_eval)

    def _epoch_line(self, epoch, sums, seconds):
        loss_sum, correct, n = sums
        elapsed = time.perf_counter() - self.start
        line = f"epoch {epoch}/{self.cfg.epochs}"
        if n:
            line += f"  loss {loss_sum / n:.4f}  accuracy {correct / n:.2%}"
        if self.last_eval.get("epoch") == epoch:
            line += f"  test accuracy {self.last_eval['accuracy']:.2%}"
        if n and seconds > 0:
            line += f"  {n / seconds:,.0f} samples/s"
        self.log.print(line + f"  ({elapsed:.1f}s)")

    def _checkpoint(self, step, epoch, index, streak, final=False):
        if self.sharded is not None:
            # Each rank advanced only its shard of the optimizer state.
            with self.dog.watch("optimizer state allgather", step, self.left):
                self.sharded.gather_state()
        with self.dog.watch("parameter digest allgather", step, self.left):
            digest = _check_same_params_everywhere(self.comm, self.params, step)
        if not self.spec.is_master:
            return None
        arrays = {f"params/{k}": backend.to_numpy(v) for k, v in self.params.items()}
        arrays.update({f"optim/{k}": v for k, v in self.opt.state_dict().items()})
        meta = {"step": step, "epoch": epoch, "step_in_epoch": index, "nonfinite_streak": streak,
                "world_size": self.comm.Get_size(), "digest": digest, "final": final,
                "config": to_json(self.cfg), "train": _finite(self.last_train), "eval": _finite(self.last_eval)}
        try:
            path = save_checkpoint(self.log.checkpoint_dir, step, arrays, meta, keep=self.cfg.keep)
        except (OSError, CheckpointError) as exc:  # save_checkpoint turns an OSError into CheckpointError
            # The earlier checkpoints are intact; training can go on, and the
            # next checkpoint may well succeed (a full disk gets cleaned up).
            self.log.warn(f"checkpoint at step {step} not written: {exc}")
            self.log.event("checkpoint_failed", step=step, epoch=epoch, error=str(exc))
            return None
        self.log.event("checkpoint", step=step, epoch=epoch, path=path)
        return path

    def _progress(self, step):
        if not (self.spec.is_master and self.cfg.progress and sys.stderr.isatty()):
            return None
        try:
            from tqdm import tqdm
        except ImportError:
            return None
        return tqdm(total=self.total_steps, initial=min(step, self.total_steps), unit="step", leave=False)

    def _write_timeline(self):
        events = self.comm.gather(self.timeline.events, root=0) if self.timeline.enabled else None
        if self.spec.is_master and self.cfg.timeline is not None:
            Timeline.write(self.cfg.timeline, events)


_STOP_REASONS = {1: "max_steps", 2: "max_time"}


def _grad_slices(model, bucket_bytes):
    """One slice of the model's flat ``grad_buffer`` per fusion bucket, or None.

    A model whose gradients lie back to back in one flat buffer, in the order
    backward delivers them (like :class:`ringtrain.models.MLP`), is reduced a
    bucket at a time in place: ``allreduce_many_`` on the separate gradients
    would copy them into a fusion buffer and back, which costs about as much
    as the ring itself. The buckets are those the overlapping
    :class:`~ringtrain.overlap.Reducer` plans, so --no-overlap reduces the
    same elements in the same calls and gives bitwise the same result.
    """
    buffer, grads = getattr(model, "grad_buffer", None), getattr(model, "grads", None)
    if buffer is None or not isinstance(grads, dict) or buffer.ndim != 1 or list(grads) != list(model.params):
        return None
    ordered = [grads[n] for n in reversed(model.params)]
    address = _address(buffer)
    for g in ordered:
        if g.dtype != buffer.dtype or not g.flags.c_contiguous or _address(g) != address:
            return None
        address += g.nbytes
    if address != _address(buffer) + buffer.nbytes:
        return None
    slices, start = [], 0
    for bucket in plan_buckets(ordered, bucket_bytes):
        size = sum(ordered[i].size for i in bucket)
        slices.append(buffer[start:start + size])
        start += size
    return slices


def _address(a):
    interface = getattr(a, "__cuda_array_interface__", None) or a.__array_interface__
    return interface["data"][0]


def _finite(record):
    """A metrics record with NaN/inf as None: checkpoint metadata is strict JSON."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}


def _in_place():
    from mpi4py import MPI

    return MPI.IN_PLACE

"""How a training step averages: chosen once at start, then the same small ``step()`` every time.

Three strategies, each one object with the same :meth:`Strategy.step`
(Horovod's distributed optimizer hides every collective behind ``step()``;
so do these):

* :class:`AllreduceThenUpdate`: backward, the gradient allreduce (one call
  per fusion bucket), then the whole optimizer update on every rank;
* :class:`OverlappedAllreduce`: the same, but each bucket is reduced on a
  communication thread while backward goes on (:class:`~ringtrain.comm.reducer.Reducer`);
* :class:`ShardedUpdate`: reduce-scatter, update this rank's shard, allgather
  the parameters (:class:`~ringtrain.training.sharded.ShardedStep`).

:func:`choose_strategy` picks one from the configuration and the model, and
says why in the line the trainer prints at start.

Every step ends with one small sum of the step's metrics over the ranks
(:class:`Metric` names its entries), which also carries what every rank
must know alike: the requests to stop (rank 0's clock, or a stop signal
caught by any rank), and whether any rank's gradient was not finite.
:func:`stop_reason` reads the decision from the sums, so every rank reads
the same one.

Contract: :func:`choose_strategy`, :meth:`Strategy.step`,
:meth:`Strategy.gather_state` and :meth:`Strategy.close` are collective;
every rank calls them in the same order.
"""

import contextlib
import enum

import numpy as np

from ..comm.buckets import allreduce_many_, plan_buckets
from ..comm.hooks import allreduce_hook
from ..comm.reducer import Reducer
from ..models.base import flat_layout
from .sharded import ShardedStep, shardable

__all__ = ["Metric", "STOP_REASONS", "STOP_REQUESTS", "stop_reason", "fill_metrics", "Phases", "Strategy",
           "AllreduceThenUpdate", "OverlappedAllreduce", "ShardedUpdate", "choose_strategy"]


class Metric(enum.IntEnum):
    """The entries of the per-step metrics vector, summed over the ranks every step."""

    LOSS_SUM = 0   # loss x rows
    CORRECT = 1    # rows predicted right
    SAMPLES = 2    # rows
    STOP = 3       # why to stop after this step (rank 0's alone: an index into STOP_REASONS)
    NONFINITE = 4  # ranks whose (share of the) reduced gradient is not finite
    # Ranks that caught each stop signal: counted, not flagged, because a
    # signal may reach one rank (a user's kill of one PID) or all of them
    # (mpiexec forwards it), and the sum must say "someone did" either way.
    SIGINT = 5
    SIGTERM = 6
    SIGUSR1 = 7


STOP_REASONS = {1: "max_steps", 2: "max_time", 3: "time_limit"}

# The entries a rank's stop requests go in, in the order Strategy.step takes them.
STOP_REQUESTS = (Metric.STOP, Metric.SIGINT, Metric.SIGTERM, Metric.SIGUSR1)
_STOP_REQUEST_INDEX = np.array(STOP_REQUESTS)

# Checked in this order: a Ctrl-C outranks the scheduler's warning.
_SIGNAL_REASONS = ((Metric.SIGINT, "sigint"), (Metric.SIGTERM, "sigterm"), (Metric.SIGUSR1, "sigusr1"))


def stop_reason(metrics):
    """Why every rank stops after this step, or None to go on (pure).

    Every rank holds the same sums, so every rank reads the same decision and
    stops at the same step.
    """
    for slot, reason in _SIGNAL_REASONS:
        if metrics[slot] > 0:
            return reason
    return STOP_REASONS.get(int(metrics[Metric.STOP]))


def fill_metrics(metrics, loss_sum, correct, rows, stop_requests, nonfinite):
    """Write this rank's share of a step's metrics, ready to be summed over the ranks."""
    metrics[Metric.LOSS_SUM], metrics[Metric.CORRECT], metrics[Metric.SAMPLES] = loss_sum, correct, rows
    metrics[Metric.NONFINITE] = nonfinite
    metrics[_STOP_REQUEST_INDEX] = stop_requests


class Phases:
    """Names a step's phases for the timeline, and puts collectives under the watchdog.

    Args:
        timeline: a :class:`~ringtrain.training.timeline.Timeline`.
        dog: a :class:`~ringtrain.watchdog.Watchdog`.
        waiting_on: the rank a stalled collective most likely waits for (the ring's left neighbour).
    """

    def __init__(self, timeline, dog, waiting_on):
        self.timeline, self.dog, self.waiting_on = timeline, dog, waiting_on

    def local(self, name, step):
        """A phase that talks to no other rank: only timed."""
        return self.timeline.span(name, step)

    @contextlib.contextmanager
    def collective(self, name, what, step):
        """A phase every rank takes part in: timed, and aborted by the watchdog if it stalls."""
        with self.timeline.span(name, step), self.dog.watch(what, step, self.waiting_on):
            yield

    def watched(self, what, step):
        """A collective too short to draw: only watched."""
        return self.dog.watch(what, step, self.waiting_on)


class Strategy:
    """One data-parallel step. Subclasses set :attr:`description` and implement :meth:`step`."""

    description = ""

    def step(self, step, xb, yb, lr, stop_requests, metrics):
        """Train on one batch (collective); fill ``metrics`` (a float64 vector indexed by :class:`Metric`).

        Args:
            step: the global step number (for the timeline and the watchdog).
            xb, yb: this rank's batch.
            lr: the learning rate of this step.
            stop_requests: returns this rank's stop requests, one per entry of
                :data:`STOP_REQUESTS` (zeros to go on); called once the step's work
                is done, just before the metrics sum, so a time limit counts
                the step's own time and a signal that came meanwhile counts now.
            metrics: written with the step's sums over every rank.

        Returns:
            Whether the gradients were finite (if not, no rank updated).
        """
        raise NotImplementedError

    def gather_state(self):
        """Make every rank's copy of the optimizer state whole before a checkpoint (collective)."""

    def close(self):
        """Release threads, communicators and windows (collective)."""


class AllreduceThenUpdate(Strategy):
    """Backward; average the gradients (one allreduce per bucket); the whole update on every rank."""

    def __init__(self, model, opt, comm, phases, *, bucket_bytes, algorithm, compression):
        self.model, self.opt, self.comm, self.phases = model, opt, comm, phases
        self.bucket_bytes, self.algorithm, self.compression = bucket_bytes, algorithm, compression
        self.description = (f"allreduce ({algorithm}{', float16 on the wire' if compression else ''}), "
                            "then the whole update on every rank")
        self._slices = _bucket_slices(model, bucket_bytes)

    def step(self, step, xb, yb, lr, stop_requests, metrics):
        with self.phases.local("forward+backward", step):
            loss, grads, correct = self.model.loss_and_grad(xb, yb)
        with self.phases.collective("allreduce", "gradient allreduce", step):
            allreduce_many_(self._slices or [grads[n] for n in reversed(grads)], op="mean", comm=self.comm,
                            bucket_bytes=self.bucket_bytes, transport=self.algorithm, compression=self.compression)
        return self._update_and_sum(step, grads, loss, correct, len(xb), lr, stop_requests, metrics)

    def _update_and_sum(self, step, grads, loss, correct, rows, lr, stop_requests, metrics):
        xp = self.opt.xp
        # The reduced gradients are bitwise equal on every rank, so this
        # decision is the same everywhere without another collective.
        finite = all(bool(xp.isfinite(g).all()) for g in (self._slices or grads.values()))
        if finite:
            with self.phases.local("optimizer", step):
                self.opt.step(self.model.params, grads, lr)
        fill_metrics(metrics, loss * rows, correct, rows, stop_requests(), 0.0)
        with self.phases.watched("metrics allreduce", step):
            self.comm.Allreduce(_in_place(), metrics)
        return finite


class OverlappedAllreduce(AllreduceThenUpdate):
    """Each gradient bucket is reduced on a communication thread as soon as backward has filled it."""

    def __init__(self, model, opt, comm, phases, *, bucket_bytes, algorithm, compression):
        super().__init__(model, opt, comm, phases, bucket_bytes=bucket_bytes, algorithm=algorithm,
                         compression=compression)
        params = model.params
        # Registered in the order backward delivers them, so buckets fill early;
        # a FlatModel's gradient buffer is reduced in place.
        grads = getattr(model, "grads", None) or {n: opt.xp.zeros_like(p) for n, p in params.items()}
        trace = self._bucket_span if phases.timeline.enabled else None
        hook = allreduce_hook("mean", algorithm, compression)
        self.reducer = Reducer(comm, {n: grads[n] for n in reversed(params)}, hook, bucket_bytes, trace=trace)
        self.description = self.description.replace(")", f", overlapped in {len(self.reducer.buckets)} buckets)", 1)
        self._step = None

    def _bucket_span(self, k):
        # Runs on the Reducer's communication thread: its own row in the timeline.
        return self.phases.timeline.span(f"allreduce bucket {k}", self._step, tid=1)

    def step(self, step, xb, yb, lr, stop_requests, metrics):
        self._step = step
        pushed = set()

        def on_grad(name, grad):
            pushed.add(name)
            self.reducer.push(name, grad)

        # Not watched: the model's own time is not a collective's (a slow
        # rank is named by the others, waiting below).
        with self.phases.local("forward+backward", step):
            loss, grads, correct = self.model.loss_and_grad(xb, yb, on_grad=on_grad)
        with self.phases.collective("allreduce wait", "gradient allreduce", step):
            for name in reversed(grads):  # a model that skipped on_grad for some
                if name not in pushed:
                    self.reducer.push(name, grads[name])
            self.reducer.wait()
        return self._update_and_sum(step, grads, loss, correct, len(xb), lr, stop_requests, metrics)

    def close(self):
        self.reducer.close()


class ShardedUpdate(Strategy):
    """Reduce-scatter the gradients, update this rank's shard, allgather the parameters (ZeRO stage 1)."""

    def __init__(self, sharded, phases):
        self.sharded, self.phases = sharded, phases
        self.xp = sharded.opt.xp
        self.description = f"sharded optimizer step (reduce-scatter, update, allgather) over {sharded.kind}"

    def step(self, step, xb, yb, lr, stop_requests, metrics):
        sharded, phases = self.sharded, self.phases
        with phases.local("forward+backward", step):
            loss, _, correct = sharded.model.loss_and_grad(xb, yb)
        with phases.collective("reduce-scatter", "gradient reduce-scatter", step):
            chunk = sharded.reduce_gradients()
        # Each rank holds only its chunk of the reduced gradient, so finiteness
        # is agreed in the metrics sum, before anyone updates.
        nonfinite = 0.0 if bool(self.xp.isfinite(chunk).all()) else 1.0
        fill_metrics(metrics, loss * len(xb), correct, len(xb), stop_requests(), nonfinite)
        with phases.watched("metrics allreduce", step):
            sharded.sum_small(metrics)
        if metrics[Metric.NONFINITE] > 0:
            return False
        with phases.local("optimizer", step):
            sharded.update(lr)
        with phases.collective("allgather", "parameter allgather", step):
            sharded.allgather()
        return True

    def gather_state(self):
        # Each rank advanced only its shard of the optimizer state.
        self.sharded.gather_state()

    def close(self):
        self.sharded.close()


def choose_strategy(cfg, model, opt, comm, phases):
    """The strategy for this run, and why the preferred one was not taken (collective).

    In order: overlap wins where the gradients fill more than one bucket
    (there is something to overlap); else the sharded step where the
    settings, the model, the optimizer and the transport allow it; else the
    allreduce.

    Returns:
        ``(strategy, why)``: ``why`` is None when the strategy is the one the
        settings ask for, else a short reason the sharded step was not taken.
    """
    options = {"bucket_bytes": int(cfg.bucket_mb * 2**20), "algorithm": cfg.allreduce,
               "compression": "fp16" if cfg.fp16_allreduce else None}
    buckets = plan_buckets(list(reversed(model.params.values())), options["bucket_bytes"])
    size = comm.Get_size()
    if size > 1 and cfg.overlap and len(buckets) > 1:
        return OverlappedAllreduce(model, opt, comm, phases, **options), None
    why = _ruled_out_by_settings(cfg, size)
    if why is None:
        sharded = ShardedStep.create(model, opt, comm, cfg.allreduce)
        if sharded is not None:
            return ShardedUpdate(sharded, phases), None
        why = comm.bcast(shardable(model, opt) or f"--allreduce {cfg.allreduce} offers no reduce-scatter here "
                         "(hierarchical across hosts of different sizes, or a GPU without CUDA IPC or a "
                         "CUDA-aware MPI)", root=0)
    return AllreduceThenUpdate(model, opt, comm, phases, **options), why or None


def _ruled_out_by_settings(cfg, size):
    # Settings every rank shares, so every rank reaches the same choice without
    # talking. "" where the user chose the allreduce: nothing to explain.
    if size == 1:
        return "one rank has nothing to shard"
    if not cfg.shard_optimizer:
        return ""
    if cfg.fp16_allreduce:
        return "--fp16-allreduce keeps the allreduce"
    return None


def _bucket_slices(model, bucket_bytes):
    """One slice of a FlatModel's ``grad_buffer`` per fusion bucket, or None for any other model.

    Reducing the slices in place spares ``allreduce_many_`` its fusion copy in
    and out, which costs about as much as the ring itself. The buckets are
    those the overlapping Reducer plans, so ``--no-overlap`` reduces the same
    elements in the same calls and gives bitwise the same result.
    """
    layout = flat_layout(model)
    if layout is None:
        return None
    ordered = [model.grads[n] for n in layout.order]
    groups = [[layout.order[i] for i in bucket] for bucket in plan_buckets(ordered, bucket_bytes)]
    return [model.grad_buffer[a:b] for a, b in layout.cut(groups)]


def _in_place():
    from mpi4py import MPI

    return MPI.IN_PLACE

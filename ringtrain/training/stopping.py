"""Stopping early with a checkpoint: on a signal, or before the scheduler's time limit.

Every rank finishes its step, all stop at the same one, rank 0 checkpoints.

Ctrl-C (SIGINT), a scheduler's SIGTERM at the time limit, or the SIGUSR1
that Slurm's ``--signal`` sends shortly before it, would otherwise kill
each rank wherever it is: the work since the last checkpoint lost, MPI's
shared memory left behind. While :func:`ringtrain.train` runs,
:class:`StopSignals` only notes the signal; the rank's stop request rides in the
next step's metrics sum (:data:`ringtrain.training.strategy.STOP_REQUESTS`), so a
signal that reached one rank alone (a ``kill`` of one PID) stops every rank
after the same step. The trainer then writes its final checkpoint and
returns, and ``ringtrain train`` exits with :data:`EXIT_STATUS`.

A second stop signal aborts at once, without a checkpoint. (Under MPICH's
``mpiexec`` a second Ctrl-C is mpiexec's own "force abort".)

The handlers are installed for the duration of :func:`ringtrain.train` only
and the previous ones restored, so a program that calls it keeps its own.

A Slurm job's time limit is known in advance (:func:`ringtrain.cluster.slurm.time_left`),
so the trainer need not wait for the signal: :class:`Deadline` stops it
while there is still time for what a stop costs, measured as the run goes
(:func:`stop_margin`), and ``ringtrain train`` exits with
``EXIT_STATUS["time_limit"]`` (75, sysexits' "temporary failure; try
again"), which a job script requeues on like a signal's.
"""

import contextlib
import time

import os
import signal
import sys

import numpy as np

from ..cluster.signals import swapped_handlers
from .strategy import STOP_REQUESTS, Metric

__all__ = ["StopSignals", "EXIT_STATUS", "SIGNAL_NAMES", "STOP_SIGNALS", "stopped_line", "Deadline", "stop_margin",
           "EXIT_SLACK", "ASSUMED_WRITE_RATE"]

# The shell's convention, 128 + the signal's number: 130 for SIGINT, 143 for
# SIGTERM, and 138 for SIGUSR1 (on Linux), which a job script can tell apart
# from a time-limit SIGTERM, e.g. to requeue itself.
# A stop before the time limit is no signal: 75 is sysexits' EX_TEMPFAIL.
EXIT_STATUS = {"sigint": 128 + signal.SIGINT, "sigterm": 128 + signal.SIGTERM, "sigusr1": 128 + signal.SIGUSR1,
               "time_limit": 75}
SIGNAL_NAMES = {"sigint": "SIGINT", "sigterm": "SIGTERM", "sigusr1": "SIGUSR1",
                "time_limit": "before the job's time limit"}

_SLOTS = {signal.SIGINT: Metric.SIGINT, signal.SIGTERM: Metric.SIGTERM, signal.SIGUSR1: Metric.SIGUSR1}
# The signals the trainer turns into a graceful stop.
STOP_SIGNALS = tuple(_SLOTS)


class StopSignals:
    """Note SIGINT, SIGTERM and SIGUSR1 while the trainer runs, instead of dying of them.

    A context manager: entering installs the handlers (in the main thread
    only, the one place Python can), leaving restores the previous ones.

    Args:
        comm: aborted on a second signal.
        stream: where the second signal's line goes (default stderr).
    """

    def __init__(self, comm, stream=None):
        self.comm, self.stream = comm, stream
        self.caught = None  # the first stop signal's number
        self._handlers = None

    def __enter__(self):
        self._handlers = swapped_handlers(STOP_SIGNALS, self._handle)
        self._handlers.__enter__()
        return self

    def __exit__(self, *exc):
        self._handlers.__exit__(None, None, None)
        return False

    def _handle(self, signum, frame):
        if self.caught is None:
            self.caught = signum
            return
        # The user means it: no step to finish, no checkpoint.
        stream = self.stream or sys.stderr
        stream.write(f"ringtrain: {signal.Signals(signum).name} again; aborting without a checkpoint\n")
        stream.flush()
        code = 128 + signum
        if self.comm.Get_size() > 1:
            self.comm.Abort(code)  # peers may be waiting in a collective: MPI must end them
        os._exit(code)

    def requests(self, clock=0.0):
        """This rank's entries for the stop requests: rank 0's clock, then the signal caught."""
        out = np.zeros(len(STOP_REQUESTS))
        out[0] = clock
        if self.caught is not None:
            out[STOP_REQUESTS.index(_SLOTS[self.caught])] = 1.0
        return out


def stopped_line(reason, step, checkpoint, resume_command=None):
    """The line ``ringtrain train`` prints when a signal stopped it (pure).

    ``resume_command``: the exact command that resumes, where running the
    same command again would not (a run without ``--run-dir`` gets a new one).
    """
    name = SIGNAL_NAMES[reason]
    how = f"to resume: {resume_command}" if resume_command else "run the same command to resume"
    if checkpoint is None:
        return (f"ringtrain: stopped at step {step} ({name}); its checkpoint could not be written (see the warning "
                f"above); {how} from the last one written")
    return f"ringtrain: stopped at step {step} ({name}); checkpoint {checkpoint}; {how}"


# What a stop costs besides the work the trainer measures: the ranks' exit
# (MPI's finalize) and the job script's requeue, a few seconds each.
EXIT_SLACK = 15.0
# A checkpoint's write rate assumed until one has been timed: a slow shared file system's.
ASSUMED_WRITE_RATE = 50e6


def stop_margin(step, evaluation, checkpoint, slack=EXIT_SLACK):
    """Seconds before the limit at which to stop: what a stop costs, twice over, plus ``slack`` (pure).

    Once the stop is decided (at the end of a step), the run still makes
    that step's reduction and update, the final evaluation and the final
    checkpoint: each is bounded by the slowest one seen so far, and doubled
    because a loaded machine or a busy file system can be slower next
    time. ``slack`` covers the ranks' exit and the job script's requeue.
    """
    return slack + 2.0 * (step + evaluation + checkpoint)


class Deadline:
    """Rank 0's clock against the job's end: when to stop with a checkpoint.

    Args:
        seconds_left: time until the limit when the run started, or None (no limit).
        checkpoint_bytes: the checkpoint's size, for its write time until one is timed.
        eval_steps: evaluation batches per rank, each taken to cost one
            training step until an evaluation is timed.
        clock: a monotonic clock (tests pass their own).
    """

    def __init__(self, seconds_left, checkpoint_bytes=0, eval_steps=1, clock=time.monotonic):
        self.clock = clock
        self.end = None if seconds_left is None else clock() + seconds_left
        self.slowest = {"step": 0.0, "evaluation": None, "checkpoint": None}
        self.assumed_checkpoint = checkpoint_bytes / ASSUMED_WRITE_RATE
        self.eval_steps = eval_steps
        self._last = None  # the first step is not timed: it carries the start-up's one-off costs

    def margin(self):
        """The current :func:`stop_margin`, from the slowest times measured (or assumed) so far."""
        step = self.slowest["step"]
        evaluation = self.slowest["evaluation"]
        checkpoint = self.slowest["checkpoint"]
        return stop_margin(step, step * self.eval_steps if evaluation is None else evaluation,
                           self.assumed_checkpoint if checkpoint is None else checkpoint)

    def reached(self):
        """Called once per step: whether to stop after this one. Times the step since the last call."""
        now = self.clock()
        if self._last is not None:
            self.slowest["step"] = max(self.slowest["step"], now - self._last)
        self._last = now
        return self.end is not None and self.end - now <= self.margin()

    @contextlib.contextmanager
    def timed(self, what):
        """Time an evaluation or a checkpoint (``what``); the step clock restarts after it."""
        began = self.clock()
        try:
            yield
        finally:
            self._last = self.clock()
            seen = self.slowest[what]
            self.slowest[what] = max(seen or 0.0, self._last - began)

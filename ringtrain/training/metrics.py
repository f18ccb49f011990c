"""Adding up the step metrics for the log: a window between train events, and the epoch.

Pure: the sums arrive already reduced over every rank (the strategy's
metrics sum), so every rank holds the same figures and only rank 0 prints them.
"""

import time

import numpy as np

from .strategy import Metric

__all__ = ["Meter", "epoch_record", "epoch_line", "final_line", "outcome_warnings", "EXPLODED", "CHANCE_MARGIN"]

# A train loss this many times its first value has blown up, finite or not.
EXPLODED = 10.0
# Accuracy within this of 1/classes (in absolute terms) is guessing.
CHANCE_MARGIN = 0.02

_SUMMED = [Metric.LOSS_SUM, Metric.CORRECT, Metric.SAMPLES]


class Meter:
    """Loss, correct and samples summed since the last train event, and since the epoch began."""

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self.window, self.epoch = np.zeros(3), np.zeros(3)
        self.window_start = self.epoch_start = clock()
        self.window_steps = 0

    def add(self, metrics):
        """Count one step's metrics (a vector indexed by :class:`~ringtrain.training.strategy.Metric`)."""
        self.window += metrics[_SUMMED]
        self.epoch += metrics[_SUMMED]
        self.window_steps += 1

    def take_window(self, step, epoch):
        """The train event since the last one (None if it saw no samples); starts a new window."""
        (loss_sum, correct, n), seconds = self.window, self.clock() - self.window_start
        steps = self.window_steps
        self.restart_window()
        if n == 0:
            return None
        return {"step": step, "epoch": epoch, "loss": loss_sum / n, "accuracy": correct / n,
                "samples_per_sec": n / seconds if seconds > 0 else float("nan"), "steps": steps,
                "samples": int(n)}

    def restart_window(self):
        """Start the next window now (evaluation and checkpoints are not training time)."""
        self.window[:] = 0
        self.window_start, self.window_steps = self.clock(), 0

    def take_epoch(self):
        """``(sums, seconds)`` of the epoch just ended; the next one's sums start from zero."""
        sums, seconds = self.epoch.copy(), self.clock() - self.epoch_start
        self.epoch[:] = 0
        return sums, seconds

    def restart(self):
        """Start the next window's and the next epoch's clocks now (after evaluation and checkpoints)."""
        self.restart_window()
        self.epoch_start = self.clock()


def epoch_record(step, epoch, sums, seconds):
    """The ``epoch`` event of an epoch's end: the same figures as ``epoch_line`` (pure; None with no samples)."""
    loss_sum, correct, n = sums
    if not n:
        return None
    return {"step": step, "epoch": epoch, "loss": loss_sum / n, "accuracy": correct / n,
            "samples_per_sec": n / seconds if seconds > 0 else float("nan"), "samples": int(n)}


def epoch_line(epoch, epochs, sums, seconds, elapsed, last_eval):
    """The line rank 0 prints at the end of an epoch (pure)."""
    loss_sum, correct, n = sums
    line = f"epoch {epoch}/{epochs}"
    if n:
        line += f"  loss {loss_sum / n:.4f}  accuracy {correct / n:.2%}"
    if last_eval.get("epoch") == epoch and last_eval.get("accuracy") is not None:
        line += f"  test accuracy {last_eval['accuracy']:.2%}"
    if n and seconds > 0:
        line += f"  {n / seconds:,.0f} samples/s"
    return line + f"  ({elapsed:.1f}s)"


# Why a run ended (TrainResult.stopped), as the final line says it.
_ENDINGS = {"done": "finished", "max_steps": "stopped at --max-steps", "max_time": "stopped at --max-time",
            "time_limit": "stopped before the job's time limit", "sigint": "stopped by SIGINT",
            "sigterm": "stopped by SIGTERM", "sigusr1": "stopped by SIGUSR1"}


def final_line(stopped, step, epoch, index, steps_per_epoch, accuracy):
    """The line rank 0 prints when the run ends (pure).

    ``epoch`` counts the epochs completed and ``index`` the steps into the
    next one, so a run stopped mid-epoch says which epoch it was in:
    ``stopped by SIGINT: step 321, in epoch 11 (step 1 of 32); test accuracy 93.87%``.
    """
    if index:
        where = f"in epoch {epoch + 1} (step {index} of {steps_per_epoch})"
    else:
        where = f"{epoch} epoch{'' if epoch == 1 else 's'} done"
    score = f"{accuracy:.2%}" if accuracy is not None else "n/a (the test set is empty)"
    return f"{_ENDINGS.get(stopped, stopped)}: step {step}, {where}; test accuracy {score}"


def outcome_warnings(best_train, last_train, last_eval, classes):
    """Lines that warn of a run that ended without learning, though nothing failed (pure).

    A training loss that ended at :data:`EXPLODED` times its best (lowest)
    has diverged even while it stays finite; an accuracy at chance (``1 /
    classes``) means the model learned nothing. Either way the run's exit
    status is still 0: the warning is what tells the user.
    """
    lines = []
    best, last = (best_train or {}).get("loss"), (last_train or {}).get("loss")
    if best is not None and last is not None and best > 0 and last >= EXPLODED * best:
        lines.append(f"the training loss rose from {best:.4g} (step {best_train['step']}) to {last:.4g} (step "
                     f"{last_train['step']}): training diverged; lower --lr and resume from an earlier checkpoint")
    accuracy, source = (last_eval or {}).get("accuracy"), "test"
    if accuracy is None:
        accuracy, source = (last_train or {}).get("accuracy"), "training"
    chance = 1.0 / classes if classes and classes > 1 else None
    if chance is not None and accuracy is not None and (last_train or {}).get("step") and \
            abs(accuracy - chance) <= CHANCE_MARGIN:
        lines.append(f"{source} accuracy {accuracy:.2%} is chance for {classes} classes (1/{classes} = "
                     f"{chance:.2%}): the model learned nothing; check the labels, --lr and the data")
    return lines

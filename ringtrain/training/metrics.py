"""Adding up the step metrics for the log: a window between train events, and the epoch.

Pure: the sums arrive already reduced over every rank (the strategy's
metrics sum), so every rank holds the same figures and only rank 0 prints them.
"""

import time

import numpy as np

from .strategy import Slot

__all__ = ["Meter", "epoch_line"]

_SUMMED = [Slot.LOSS_SUM, Slot.CORRECT, Slot.SAMPLES]


class Meter:
    """Loss, correct and samples summed since the last train event, and since the epoch began."""

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self.window, self.epoch = np.zeros(3), np.zeros(3)
        self.window_start = self.epoch_start = clock()
        self.window_steps = 0

    def add(self, metrics):
        """Count one step's metrics (a vector indexed by :class:`~ringtrain.training.strategy.Slot`)."""
        self.window += metrics[_SUMMED]
        self.epoch += metrics[_SUMMED]
        self.window_steps += 1

    def take_window(self, step, epoch):
        """The train event since the last one (None if it saw no samples); starts a new window."""
        (loss_sum, correct, n), seconds = self.window, self.clock() - self.window_start
        self.restart_window()
        if n == 0:
            return None
        return {"step": step, "epoch": epoch, "loss": loss_sum / n, "accuracy": correct / n,
                "samples_per_sec": n / seconds if seconds > 0 else float("nan")}

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


def epoch_line(epoch, epochs, sums, seconds, elapsed, last_eval):
    """The line rank 0 prints at the end of an epoch (pure)."""
    loss_sum, correct, n = sums
    line = f"epoch {epoch}/{epochs}"
    if n:
        line += f"  loss {loss_sum / n:.4f}  accuracy {correct / n:.2%}"
    if last_eval.get("epoch") == epoch:
        line += f"  test accuracy {last_eval['accuracy']:.2%}"
    if n and seconds > 0:
        line += f"  {n / seconds:,.0f} samples/s"
    return line + f"  ({elapsed:.1f}s)"

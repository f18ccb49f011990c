"""Progress while an epoch runs: a bar on a terminal, a plain line every so often anywhere else.

Under ``mpirun``, in a Slurm log or in CI, stderr is a pipe or a file and a
progress bar is noise, so rank 0 prints one line every ``--progress-every``
seconds instead (the first sooner, after :data:`FIRST_AFTER` seconds)::

    epoch 3/30  step 120/500  loss 0.4321  12,345 samples/s  eta 1m12s

On a terminal it draws a tqdm bar, cleared while any other line is printed,
so epoch lines stay whole. The formatting and timing decisions are plain
functions (:func:`choose_mode`, :func:`progress_line`, :func:`eta_seconds`,
:func:`format_duration`, :class:`LineSchedule`), tested without MPI.
"""

import contextlib
import math
import sys
import time

__all__ = ["FIRST_AFTER", "Progress", "LineSchedule", "choose_mode", "eta_seconds", "format_duration",
           "progress_line"]

FIRST_AFTER = 10.0
"""Seconds before the first progress line: soon enough to show the run is alive."""


def choose_mode(is_master, enabled, isatty, have_tqdm):
    """``"bar"``, ``"lines"`` or None (no progress): only rank 0 shows it, a bar only on a terminal."""
    if not (is_master and enabled):
        return None
    return "bar" if isatty and have_tqdm else "lines"


def format_duration(seconds):
    """``45s``, ``1m12s``, ``2h05m``, ``3d04h``: two units at most, rounded down."""
    seconds = max(0, int(seconds))
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d{hours:02d}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"


def eta_seconds(steps_done, seconds, steps_left, time_left=None):
    """Seconds to the end at the rate so far, or None before any step; capped by ``time_left`` (--max-time)."""
    if steps_done <= 0 or seconds <= 0:
        return time_left
    eta = steps_left * seconds / steps_done
    return eta if time_left is None else min(eta, max(0.0, time_left))


def progress_line(epoch, epochs, step, steps, loss, samples_per_sec, eta):
    """One progress line (pure). ``epoch`` is the one under way (1-based), ``step`` the steps taken in it."""
    line = f"epoch {epoch}/{epochs}  step {step}/{steps}"
    if loss is not None and math.isfinite(loss):
        line += f"  loss {loss:.4f}"
    if samples_per_sec is not None and math.isfinite(samples_per_sec):
        line += f"  {samples_per_sec:,.0f} samples/s"
    return line + (f"  eta {format_duration(eta)}" if eta is not None else "")


class LineSchedule:
    """When the next line is due: ``first`` seconds after ``start``, then every ``every`` seconds."""

    def __init__(self, every, start, first=FIRST_AFTER):
        self.every = every
        self.next = start + min(first, every)

    def due(self, now):
        """Whether a line is due at ``now``; if so, the following one is scheduled."""
        if now < self.next:
            return False
        # After a long pause (evaluation, a checkpoint) one line, not a burst.
        self.next = max(self.next + self.every, now + self.every / 2)
        return True


class Progress:
    """Rank 0's progress display for one :func:`ringtrain.train` call.

    Args:
        mode: from :func:`choose_mode`.
        total: steps the run takes in all; ``initial``: steps already taken (a resumed run).
        epochs, steps_per_epoch: for the line.
        every: seconds between lines.
        deadline: the clock time ``--max-time`` ends the run at, or None.
        stream: where the bar or the lines go (default stderr).
        clock: a monotonic clock (seconds).
    """

    def __init__(self, mode, *, total, initial, epochs, steps_per_epoch, every, deadline=None, stream=None,
                 clock=time.perf_counter):
        self.mode, self.total, self.epochs, self.steps = mode, total, epochs, steps_per_epoch
        self.stream, self.clock, self.deadline = stream or sys.stderr, clock, deadline
        self.start, self.start_step = clock(), initial
        self.schedule = LineSchedule(every, self.start)
        self._window = [0.0, 0.0, self.start]  # loss sum, samples, since
        self._bar = None
        if mode == "bar":
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=min(initial, total), unit="step", leave=False, file=self.stream,
                             dynamic_ncols=True)

    def update(self, step, epoch, index, loss_sum, samples):
        """Count a finished step (``step`` taken in all, ``index`` in epoch ``epoch``, 0-based)."""
        if self.mode is None:
            return
        self._window[0] += loss_sum
        self._window[1] += samples
        if self._bar is not None:
            self._bar.update(1)
            return
        now = self.clock()
        if not self.schedule.due(now):
            return
        loss_sum, samples, since = self._window
        self._window = [0.0, 0.0, now]
        time_left = None if self.deadline is None else self.deadline - now
        eta = eta_seconds(step - self.start_step, now - self.start, self.total - step, time_left)
        line = progress_line(epoch + 1, self.epochs, index, self.steps, loss_sum / samples if samples else None,
                             samples / (now - since) if now > since else None, eta)
        try:
            self.stream.write(line + "\n")
            self.stream.flush()
        except (OSError, ValueError):  # a closed or full stderr: progress is a nicety, training goes on
            self.mode = None

    @contextlib.contextmanager
    def paused(self):
        """Print other lines inside this: the bar is cleared first and redrawn after, so no line is torn."""
        if self._bar is None:
            yield
            return
        self._bar.clear()
        try:
            yield
        finally:
            self._bar.refresh()

    def close(self):
        if self._bar is not None:
            self._bar.close()
            self._bar = None

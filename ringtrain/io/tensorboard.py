"""TensorBoard scalars from rank 0's train and eval events (``ringtrain train --tensorboard DIR``).

Curves a reader can trust: ``train/*`` holds one point per epoch, the
epoch's mean (the figure the console's epoch line prints), and
``train_window/*`` one point every ``--log-every`` steps, each the mean of
exactly that many steps. metrics.jsonl's train events are cut at each
epoch's end as well, so drawn as they are their windows differ in length
and the curve zigzags; here the pieces are joined back into whole windows
(``Windows``).

The writer is tensorboardX's (``pip install tensorboardX``, or the
``ringtrain[tensorboard]`` extra), the only import of it in ringtrain: pure
Python on top of protobuf, so the trainer, which never needs torch, does not
pull torch or TensorBoard's server in to write a log. TensorBoard itself (or
anything that reads event files) reads the folder.

Events go through tensorboardX's synchronous :class:`EventsWriter`, in the
training thread, not its ``SummaryWriter``, whose background thread would
leave the training loop blocked on a full queue once a write failed. Like the
rest of the run log, writing must never stop training: the first failure
(a full disk, a folder removed) is one warning and the scalars stop there.
"""

import importlib.util
import os
import time

__all__ = ["INSTALL", "TAGS", "available", "missing_problem", "folder_problem", "scalars_of", "Windows",
           "TensorBoard"]

INSTALL = "pip install tensorboardX"
# metrics.jsonl's event (and "window", train events joined by Windows) -> {its field: the TensorBoard tag}.
TAGS = {
    "epoch": {"loss": "train/loss", "accuracy": "train/accuracy", "samples_per_sec": "train/samples_per_sec"},
    "train": {"lr": "train/learning_rate"},
    "window": {"loss": "train_window/loss", "accuracy": "train_window/accuracy",
               "samples_per_sec": "train_window/samples_per_sec"},
    "eval": {"loss": "eval/loss", "accuracy": "eval/accuracy"},
}


def available():
    """True when tensorboardX can be imported (looked up, not imported: protobuf is slow to load)."""
    return importlib.util.find_spec("tensorboardX") is not None


def missing_problem():
    """The one-line refusal when tensorboardX is missing, or None."""
    if available():
        return None
    return f"writing TensorBoard scalars needs tensorboardX, which is not installed: {INSTALL}"


def folder_problem(path):
    """Why the folder ``path`` could not hold event files, or None (checked before training)."""
    if os.path.exists(path) and not os.path.isdir(path):
        return f"{path!r} exists and is not a directory; give a directory for the event files"
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return f"{path!r} cannot be made: {existing} is not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{path!r}: cannot write in {existing} (permission denied)"
    return None


def scalars_of(event, fields):
    """``[(tag, value, step)]`` for one metrics event; fields without a number (None) are left out (pure)."""
    step = fields.get("step")
    if event not in TAGS or not isinstance(step, int):
        return []
    out = []
    for name, tag in TAGS[event].items():
        value = fields.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):  # NaN too: a diverged loss shows
            out.append((tag, float(value), step))
    return out


class Windows:
    """Joins train events into windows of exactly ``log_every`` steps (pure).

    The trainer writes a train event every ``log_every`` steps and at each
    epoch's end, each the mean since the one before. Joined again, weighted by
    their samples, the pieces between two multiples of ``log_every`` make one
    window of that many steps: the mean a window of that length would have
    had. A window that is not whole (the first after a resume mid-window, the
    last of a run) gives no point.
    """

    def __init__(self, log_every):
        self.log_every = log_every
        self._sums = None  # steps, loss sum, correct, samples, seconds since the last multiple of log_every

    def add(self, fields):
        """Count one train event; return the joined window's fields at a multiple of ``log_every``, else None."""
        step, steps, n = fields.get("step"), fields.get("steps"), fields.get("samples")
        if not all(isinstance(v, int) for v in (step, steps, n)) or n <= 0:
            return None
        rate = fields.get("samples_per_sec")
        seconds = n / rate if isinstance(rate, float) and rate > 0 else 0.0  # NaN (no time measured): none
        part = (steps, fields["loss"] * n, fields["accuracy"] * n, n, seconds)
        self._sums = part if self._sums is None else tuple(a + b for a, b in zip(self._sums, part))
        if step % self.log_every:
            return None
        (steps, loss_sum, correct, n, seconds), self._sums = self._sums, None
        if steps != self.log_every:
            return None
        return {"step": step, "loss": loss_sum / n, "accuracy": correct / n,
                "samples_per_sec": n / seconds if seconds > 0 else float("nan")}


class TensorBoard:
    """Rank 0's event file in ``folder``: made at the first scalar, flushed after each evaluation.

    Args:
        folder: the directory for the event file (made if missing).
        warn: called once with a line when writing fails; nothing is written after.
        log_every: the run's ``--log-every``: the length of the ``train_window/*`` windows.
    """

    def __init__(self, folder, warn, log_every=50):
        self.folder = folder
        self.warn = warn
        self._writer = None
        self._failed = False
        self._windows = Windows(log_every)

    def write(self, event, fields):
        """Add the scalars of one metrics event (see :data:`TAGS`); evaluations are flushed to disk."""
        scalars = scalars_of(event, fields)
        if event == "train":
            window = self._windows.add(fields)
            scalars += scalars_of("window", window) if window is not None else []
        if not scalars or self._failed:
            return
        try:
            from tensorboardX.proto.event_pb2 import Event
            from tensorboardX.summary import scalar

            writer = self._open()
            for tag, value, step in scalars:
                writer.write_event(Event(wall_time=time.time(), step=step,
                                         summary=scalar(tag, value)))
            if event == "eval":
                writer.flush()
        except OSError as exc:
            self._fail(exc)

    def _open(self):
        if self._writer is None:
            from tensorboardX.event_file_writer import EventsWriter

            os.makedirs(self.folder, exist_ok=True)
            self._writer = EventsWriter(os.path.join(self.folder, "events"), filename_suffix=".ringtrain")
        return self._writer

    def _fail(self, exc):
        self._failed = True
        self.warn(f"--tensorboard {self.folder}: not written ({exc.strerror or exc}); training goes on without it")
        self.close()

    def close(self):
        """Flush and close the event file (a failure here is the same one warning)."""
        writer, self._writer = self._writer, None
        if writer is None:
            return
        try:
            writer.close()
        except OSError as exc:
            if not self._failed:
                self._fail(exc)

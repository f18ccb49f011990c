"""What rank 0 writes and prints: the run directory, metrics.jsonl, epoch lines.

Only the master writes or prints; on every other rank a RunLog is silent, so
the trainer calls it unconditionally and stays free of ``if rank == 0``.
"""

import json
import os
import sys
import time

__all__ = ["RunLog", "default_run_dir", "write_json_atomic"]


def default_run_dir(now=None):
    """``runs/<timestamp>``, e.g. ``runs/20261121-153012``."""
    return os.path.join("runs", time.strftime("%Y%m%d-%H%M%S", time.localtime(now)))


def write_json_atomic(path, obj):
    """Write JSON through a temporary file and rename, so a reader never sees half of it."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump(obj, fh, indent=2, sort_keys=True)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


class RunLog:
    """The master's log: ``config.json``, ``metrics.jsonl`` and one printed line per epoch.

    Args:
        run_dir: the run directory (created by :meth:`open`).
        is_master: False makes every method a no-op.
        stream: where lines are printed (default stdout).
    """

    def __init__(self, run_dir, is_master, stream=None):
        self.run_dir = run_dir
        self.is_master = is_master
        self.stream = stream or sys.stdout
        self._metrics = None
        self._start = time.time()

    @property
    def checkpoint_dir(self):
        return os.path.join(self.run_dir, "checkpoints")

    def open(self, config):
        """Create the run directory and write the resolved configuration."""
        if not self.is_master:
            return
        os.makedirs(self.checkpoint_dir, exist_ok=True)
        write_json_atomic(os.path.join(self.run_dir, "config.json"), config)
        # Appending keeps the history of a resumed run in one file.
        self._metrics = open(os.path.join(self.run_dir, "metrics.jsonl"), "a", buffering=1)

    def event(self, event, **fields):
        """Append one JSON object (``event``, the fields, and ``time`` since start) to metrics.jsonl."""
        if not self.is_master or self._metrics is None:
            return
        record = {"event": event, **fields, "time": round(time.time() - self._start, 4)}
        self._metrics.write(json.dumps(record, default=float) + "\n")

    def print(self, line):
        if self.is_master:
            print(line, file=self.stream, flush=True)

    def warn(self, line):
        if self.is_master:
            print(f"ringtrain: warning: {line}", file=sys.stderr, flush=True)

    def close(self):
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None

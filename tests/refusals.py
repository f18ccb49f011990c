"""What every refused input must look like: one line, exit status 2, no traceback, nothing written, quickly."""

import os
import time

from mpirun import ringtrain, show


def snapshot(root):
    """Every path under ``root``, relative and sorted: equal before and after means nothing was written."""
    return sorted(os.path.relpath(os.path.join(d, n), root) for d, dirs, files in os.walk(root)
                  for n in dirs + files)


def assert_refused(tmp_path, args, needle, start, make_inputs):
    """Run ``ringtrain *args`` through ``start`` and check it was refused as a usage error should be.

    ``args`` and ``needle`` may hold ``{tmp}``; ``make_inputs(tmp_path)`` writes
    the files the case needs before the snapshot is taken.
    """
    args = [a.format(tmp=tmp_path) for a in args]
    make_inputs(tmp_path)
    before = snapshot(tmp_path)
    began = time.monotonic()
    result = start(ringtrain(*args))
    elapsed = time.monotonic() - began
    assert result.returncode == 2, show(result)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, show(result)
    assert lines[0].startswith("ringtrain: error: ") and needle.format(tmp=tmp_path) in lines[0], show(result)
    assert "Traceback" not in result.stderr + result.stdout
    assert snapshot(tmp_path) == before, "something was written"
    assert elapsed < 10, f"took {elapsed:.1f}s"

"""Horovod's variables under real mpirun: ``HOROVOD_TIMELINE`` writes the engine's timeline, others are named.

As in Horovod, rank 0's ``HOROVOD_TIMELINE`` decides (an MPMD job where rank 1
lacks it still writes every rank's ops), rank 0 alone writes the one file,
and it is whole Chrome-trace JSON once the job has ended, with no
``stop_timeline`` call in the script. Skipped without torch.
"""

import json
import os
import re
import sys

import pytest

import mpirun
from mpirun import find_mpirun, run, show

pytest.importorskip("torch", reason="torch is not installed (pip install torch==2.13.0)")

SCRIPT = """\
import torch
import ringtrain.torch as hvd

hvd.init()
rank = hvd.rank()
total = hvd.allreduce(torch.ones(3) * (rank + 1), name="grad.w", op=hvd.Sum)
hvd.broadcast(torch.zeros(2), root_rank=0, name="init.b")
print(f"rank {rank}: sum {total.tolist()[0]:g}")
"""


def _trace(path, np):
    """The trace's op spans per rank, after checking it is whole JSON in Chrome's format."""
    with open(path, encoding="utf-8") as fh:
        trace = json.load(fh)
    spans = {rank: [e["name"] for e in trace["traceEvents"] if e.get("ph") == "X" and e["pid"] == rank]
             for rank in range(np)}
    names = [e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"]
    assert names == [f"rank {r}" for r in range(np)], names
    return spans


@pytest.mark.parametrize("np", [2, 3])
def test_horovod_timeline_writes_every_ranks_ops_to_one_file_from_rank_0(tmp_path, np):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    env = mpirun.test_env(HOROVOD_TIMELINE="timeline.json", HOROVOD_AUTOTUNE="1")
    result = mpirun.mpirun(np, [sys.executable, str(script)], timeout=120, env=env, cwd=str(tmp_path))
    assert result.returncode == 0, show(result)
    want = str(sum(range(1, np + 1)))
    assert sorted(re.findall(r"rank (\d+): sum (\d+)", result.stdout)) == [(str(r), want) for r in range(np)], \
        show(result)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["script.py", "timeline.json"]  # relative to the job
    spans = _trace(tmp_path / "timeline.json", np)
    for rank in range(np):
        assert any("grad.w" in name for name in spans[rank]), spans
        assert any("init.b" in name for name in spans[rank]), spans
    # The variable ringtrain.torch does not act on: one line, from rank 0 alone.
    warned = [line for line in result.stderr.splitlines() if "HOROVOD_AUTOTUNE" in line]
    assert warned == ["[ringtrain] WARNING HOROVOD_AUTOTUNE is set, but ringtrain does not act on "
                      "it: ignored"], show(result)


def test_rank_0s_horovod_timeline_decides_for_every_rank(tmp_path):
    # MPMD: rank 0 has the variable, rank 1 does not; the file still holds both ranks' ops.
    script, path = tmp_path / "script.py", tmp_path / "out" / "trace.json"
    script.write_text(SCRIPT)
    command = [find_mpirun(), "-np", "1", "env", f"HOROVOD_TIMELINE={path}", sys.executable, str(script), ":",
               "-np", "1", sys.executable, str(script)]
    result = run(command, timeout=120, env=mpirun.test_env())
    assert result.returncode == 0, show(result)
    spans = _trace(path, 2)
    assert all(any("grad.w" in name for name in spans[rank]) for rank in (0, 1)), spans
    assert "WARNING" not in result.stderr, show(result)


def test_without_horovod_timeline_nothing_is_written_and_nothing_said(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    result = mpirun.mpirun(2, [sys.executable, str(script)], timeout=120, env=mpirun.test_env(), cwd=str(tmp_path))
    assert result.returncode == 0, show(result)
    assert [p.name for p in tmp_path.iterdir()] == ["script.py"] and "WARNING" not in result.stderr, show(result)


def test_the_settings_read_from_the_environment():
    from ringtrain.errors import UsageError
    from ringtrain.engine.runtime import timeline_setting, unserved_lines

    assert timeline_setting({}) == (None, False)
    assert timeline_setting({"HOROVOD_TIMELINE": "DYNAMIC"}) == (None, False)  # Horovod's: start_timeline later
    assert timeline_setting({"HOROVOD_TIMELINE": "t.json", "HOROVOD_TIMELINE_MARK_CYCLES": "1"}) == \
        (os.path.abspath("t.json"), True)
    with pytest.raises(UsageError, match="HOROVOD_TIMELINE_MARK_CYCLES='maybe': must be 0 or 1"):
        timeline_setting({"HOROVOD_TIMELINE_MARK_CYCLES": "maybe"})
    # Served variables and build-time ones are not named; each ignored one is, once; a blank one is unset.
    env = {"HOROVOD_FUSION_THRESHOLD": "0", "HOROVOD_WITH_PYTORCH": "1", "HOROVOD_HIERARCHICAL_ALLREDUCE": "1",
           "HOROVOD_LOG_LEVEL": " ", "HOROVOD_TIMELINE_MARK_CYCLES": "1"}
    lines = unserved_lines(env)
    assert len(lines) == 2 and "HOROVOD_HIERARCHICAL_ALLREDUCE is set" in lines[0], lines
    assert "HOROVOD_TIMELINE_MARK_CYCLES is set" in lines[1] and "no cycle markers" in lines[1], lines

"""The PyTorch patterns page runs: each program under real mpirun at 2 ranks, and each prints what the page shows.

docs/pytorch-patterns.md shows a scheduler built after wrapping, autocast with a GradScaler,
torch.compile, DataLoader workers, and a rank-0 checkpoint with its resume, each followed by a
``text`` block of what rank 0 prints. Each program runs as pasted from an empty directory, within a
time bound, and its output must be the page's; the checkpoint's runs twice in the same directory,
and the second run must resume after the first one's last epoch. (tests/cli/test_readme.py leaves
this page's blocks to this file, so each runs once per suite.)
"""

import importlib.util
import os
import sys

import pytest

from markdown_pages import fences, read
from mpirun import mpirun, show

PAGE = os.path.join("docs", "pytorch-patterns.md")
# What each program is about, by a call only it makes, so that a pattern dropped from the page fails here.
PATTERNS = {"lr_scheduler": "scheduler", "GradScaler": "amp", "torch.compile": "compile",
            "num_workers": "dataloader", "torch.save": "checkpoint"}


def _programs():
    """[(name, code, expected output)]: each Python block of the page and the text block after it."""
    blocks, found = fences(read(PAGE)), []
    for i, fence in enumerate(blocks):
        if fence.lang != "python":
            continue
        names = [name for call, name in PATTERNS.items() if call in fence.code]
        assert len(names) == 1, f"{PAGE} line {fence.line}: expected one pattern's program, found {names}"
        after = blocks[i + 1] if i + 1 < len(blocks) else None
        assert after is not None and after.lang == "text", f"{PAGE} line {fence.line}: show its output"
        found.append((names[0], fence.code, after.code))
    return found


PROGRAMS = _programs()


def test_the_page_shows_every_pattern_once():
    assert sorted(name for name, _, _ in PROGRAMS) == sorted(PATTERNS.values())


@pytest.mark.parametrize("name, code, expected", PROGRAMS, ids=[name for name, _, _ in PROGRAMS])
def test_pattern_runs_at_two_ranks_and_prints_what_the_page_shows(name, code, expected, tmp_path):
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed (pip install torch==2.13.0, or the [torch] extra)")
    (tmp_path / "pattern.py").write_text(code)
    outputs = []
    for _ in range(2 if name == "checkpoint" else 1):
        result = mpirun(2, [sys.executable, "pattern.py"], timeout=300, cwd=str(tmp_path))
        assert result.returncode == 0, f"{PAGE}, {name}: {show(result)}"
        outputs.append(result.stdout)
    printed = [line for out in outputs for line in out.splitlines() if line.strip()]
    assert printed == expected.strip().splitlines(), f"{PAGE}, {name}: {show(result)}"

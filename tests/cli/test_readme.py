"""The README's code runs: every Python block as a 2-rank job, every ringtrain command line through the parser.

A Python block runs as pasted, from an empty directory, under real mpirun
with a time bound. An HTML comment right before a block may name a command
to run first (``<!-- readme-test: after `ringtrain train ...` -->``), for a
block that reads what that command writes. Shell blocks hold installs,
cluster and Slurm lines that cannot run here, so their ``ringtrain``
command lines are checked against the real parser instead: a flag the
README shows must be a flag ringtrain takes.
"""

import importlib.util
import os
import re
import shlex
import sys

import pytest

from mpirun import ROOT, mpirun, ringtrain, show

README = os.path.join(ROOT, "README.md")
BLOCK = re.compile(r"(?:<!-- readme-test: after `(?P<after>[^`]+)` -->\n)?```(?P<lang>\w*)\n(?P<code>.*?)```",
                   re.S)


def _blocks(lang):
    with open(README, encoding="utf-8") as f:
        text = f.read()
    return [(m["code"], m["after"], text.count("\n", 0, m.start()) + 1) for m in BLOCK.finditer(text)
            if m["lang"] == lang]


PYTHON = _blocks("python")


def _command_lines():
    """``ringtrain ...`` argument lists from the shell blocks, synopses (``[--flag]``, ``...``) left out."""
    found = []
    for code, _, line in _blocks("bash"):
        for offset, raw in enumerate(code.replace("\\\n", " ").splitlines()):
            words = shlex.split(raw, comments=True)
            for i, word in enumerate(words):
                if os.path.basename(word) == "ringtrain" and not (i and words[i - 1] == "--"):
                    args = words[i + 1:words.index("&&", i) if "&&" in words[i:] else len(words)]
                    if not any(a.startswith("[") or a == "..." or "$" in a for a in args):
                        found.append((line + 1 + offset, args))
                    break
    return found


def test_the_readme_has_blocks_to_check():
    assert len(PYTHON) >= 5 and len(_command_lines()) >= 10


@pytest.mark.parametrize("code, after, line", PYTHON, ids=[f"line-{line}" for _, _, line in PYTHON])
def test_python_block_runs_as_pasted(code, after, line, tmp_path):
    if "import torch" in code and importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed (pip install torch==2.13.0)")
    if after:
        words = shlex.split(after)
        assert words[0] == "ringtrain", f"README line {line}: the setup must be a ringtrain command"
        result = mpirun(2, ringtrain(*words[1:]), timeout=180, cwd=str(tmp_path))
        assert result.returncode == 0, f"README line {line}, setup: {show(result)}"
    (tmp_path / "block.py").write_text(code)
    result = mpirun(2, [sys.executable, "block.py"], timeout=300, cwd=str(tmp_path))
    assert result.returncode == 0, f"README line {line}: {show(result)}"


@pytest.mark.parametrize("line, args", _command_lines(), ids=[f"line-{line}" for line, _ in _command_lines()])
def test_command_line_parses(line, args):
    from ringtrain.cli import build_parser

    build_parser().parse_args(args)

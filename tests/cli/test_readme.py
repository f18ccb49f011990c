"""The code in the README and in every docs page works: Python runs, shell lines parse, config files load.

Each Python block runs as pasted, from an empty directory, under real mpirun at 2 ranks with a
time bound (a block that appears on two pages runs once; docs/pytorch-patterns.md's run in
tests/cli/test_pytorch_patterns.py, which also checks their output). An HTML comment right before a block
may name a command to run first (``<!-- docs-test: after `ringtrain train ...` -->``), for a block
that reads what that command writes, or ask only that it compile (``<!-- docs-test: parse -->``).
Shell blocks hold installs, cluster and Slurm lines that cannot run here, so each must pass
``bash -n``, its ``ringtrain`` command lines are checked against the real parser (a flag the docs
show must be a flag ringtrain takes), and every ``scripts/`` file it names must exist. TOML and
YAML blocks are config files: ``ringtrain train --config`` must accept them. And the other way
round: every flag of every command is on the train page, and CI runs the README's command.
"""

import argparse
import importlib.util
import os
import re
import shlex
import subprocess
import sys

import pytest

from markdown_pages import SOURCES, fences, read
from mpirun import ROOT, mpirun, ringtrain, show


def _blocks(*langs):
    """[(page, line, fence)] of the given languages over every page."""
    return [(page, fence.line, fence) for page in SOURCES for fence in fences(read(page)) if fence.lang in langs]


# Pages whose programs another test runs, with checks of its own (their output, a second run).
RUN_ELSEWHERE = {os.path.join("docs", "pytorch-patterns.md"): "tests/cli/test_pytorch_patterns.py"}


def _unique_python():
    seen, found = set(), []
    for page, line, fence in _blocks("python"):
        if fence.code not in seen and page not in RUN_ELSEWHERE:
            seen.add(fence.code)
            found.append((page, line, fence))
    return found


PYTHON = _unique_python()
SHELL = _blocks("bash", "console")
CONFIGS = _blocks("toml", "yaml")


def _shell_lines(fence):
    """The block's command lines, continuations joined; for console blocks only the ``$ `` lines."""
    lines = fence.code.replace("\\\n", " ").splitlines()
    if fence.lang == "console":
        return [(i, line[2:]) for i, line in enumerate(lines) if line.startswith("$ ")]
    return list(enumerate(lines))


def _command_lines():
    """``ringtrain ...`` argument lists from the shell blocks, synopses (``[--flag]``, ``...``, ``$VAR``) left out."""
    found = []
    for page, line, fence in SHELL:
        for offset, raw in _shell_lines(fence):
            words = shlex.split(raw, comments=True)
            for i, word in enumerate(words):
                if os.path.basename(word) == "ringtrain" and not (i and words[i - 1] == "--"):
                    args = words[i + 1:words.index("&&", i) if "&&" in words[i:] else len(words)]
                    if not any(a.startswith("[") or a == "..." or "$" in a for a in args):
                        found.append((f"{page}:{line + 1 + offset}", args))
                    break
    return found


COMMANDS = _command_lines()


def test_the_docs_have_blocks_to_check():
    assert len(PYTHON) >= 8 and len(COMMANDS) >= 30 and len(CONFIGS) >= 2
    assert any(page == "README.md" for page, _, _ in PYTHON)


@pytest.mark.parametrize("page, line, fence", PYTHON, ids=[f"{page}:{line}" for page, line, _ in PYTHON])
def test_python_block_runs_as_pasted(page, line, fence, tmp_path):
    where = f"{page} line {line}"
    if fence.marker == "parse":
        compile(fence.code, where, "exec")
        return
    if "import torch" in fence.code and importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed (pip install torch==2.13.0, or the [torch] extra)")
    if re.search(r"^\s*(import|from) (tensorflow|keras|ringtrain\.(tensorflow|keras))\b", fence.code, re.M) \
            and importlib.util.find_spec("tensorflow") is None:
        pytest.skip("tensorflow is not installed (pip install tensorflow-cpu==2.21.0, or the [tensorflow] extra)")
    # A block for Keras 3 on another backend names it in KERAS_BACKEND; it needs that backend's package and Keras.
    backend = re.search(r'^os\.environ\["KERAS_BACKEND"\] = "(\w+)"', fence.code, re.M)
    missing = [name for name in (backend[1], "keras") if importlib.util.find_spec(name) is None] if backend else []
    if missing:
        pytest.skip(f"{' and '.join(missing)} not installed (pip install {' '.join(missing)}): docs/keras-backends.md")
    if fence.marker:
        words = shlex.split(fence.marker)
        assert words[0] == "ringtrain", f"{where}: the setup must be a ringtrain command"
        result = mpirun(2, ringtrain(*words[1:]), timeout=180, cwd=str(tmp_path))
        assert result.returncode == 0, f"{where}, setup: {show(result)}"
    (tmp_path / "block.py").write_text(fence.code)
    result = mpirun(2, [sys.executable, "block.py"], timeout=300, cwd=str(tmp_path))
    assert result.returncode == 0, f"{where}: {show(result)}"


@pytest.mark.parametrize("where, args", COMMANDS, ids=[where for where, _ in COMMANDS])
def test_command_line_parses(where, args):
    from ringtrain.cli import build_parser

    try:
        build_parser().parse_args(args)
    except SystemExit as exc:             # --help and --version exit 0; a flag ringtrain lacks exits 2
        assert exc.code == 0, f"{where}: ringtrain {shlex.join(args)}"


@pytest.mark.parametrize("page, line, fence", SHELL, ids=[f"{page}:{line}" for page, line, _ in SHELL])
def test_shell_block_is_valid_and_names_real_files(page, line, fence):
    script = "\n".join(raw for _, raw in _shell_lines(fence)) + "\n"
    result = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, f"{page} line {line}: bash -n: {result.stderr}"
    missing = [p for p in re.findall(r"(?<![\w/])scripts/[\w./-]+\.(?:py|sh)", script)
               if not os.path.isfile(os.path.join(ROOT, p))]
    assert missing == [], f"{page} line {line}: no such file {missing}"


@pytest.mark.parametrize("page, line, fence", CONFIGS, ids=[f"{page}:{line}" for page, line, _ in CONFIGS])
def test_config_block_is_a_config_file_ringtrain_accepts(page, line, fence, tmp_path):
    from ringtrain.training.config import load_config_file, resolve

    path = tmp_path / f"run.{fence.lang}"
    path.write_text(fence.code)
    resolve({}, load_config_file(str(path)))     # raises UsageError on an unknown setting or a bad value


def _subcommands():
    from ringtrain.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices


@pytest.mark.parametrize("command", ["info", "train", "bench", "launch", "plot"])
def test_every_flag_is_on_the_train_page(command):
    text = read(os.path.join("docs", "train.md"))
    assert f"## `ringtrain {command}" in text
    flags = [flag for action in _subcommands()[command]._actions for flag in action.option_strings
             if flag not in ("-h", "--help")]
    missing = [flag for flag in flags if not re.search(r"(?<![\w-])" + re.escape(flag) + r"(?![\w-])", text)]
    assert missing == [], f"docs/train.md does not mention {command}'s {missing}"


def test_ci_runs_the_readmes_test_commands_verbatim():
    with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as f:
        ci = f.read()
    commands = [raw for _, _, fence in _blocks("bash") for _, raw in _shell_lines(fence) if "pytest" in raw]
    full = [c for c in commands if ".[test,torch,tensorflow,docs]" in c]
    assert full and all(c in ci for c in full), f"CI must run the docs' full test command: {full}"
    quick = [c for c in commands if ".[test]'" in c]
    assert quick and all(c in ci for c in quick), f"CI must run the quick start's torch-free test command: {quick}"

"""An empty path or command is refused in one line, exit 2, nothing written, never taken as "not given".

``--run-dir "$RUN_DIR"`` in a job script whose ``RUN_DIR`` is unset used to train into a new
timestamped directory, so a requeued job never resumed; ``--config ''`` ran with the defaults,
``-o ''`` wrote the ranks' logs where the launcher stood, and ``--host-discovery-script ''`` waited.
Every flag that takes text is found from the parser itself, so a new one cannot be missed; each is
given ``''`` through ``ringtrain.cli.main`` (the launcher and plot are one process; train's refusal
is agreed before any collective), and train's four from the issue run under ``mpirun -np 2``.
"""

import argparse

import pytest

import mpirun
from mpirun import show
from refusals import snapshot
from ringtrain import cli
from ringtrain import commands as commands_package

SMALL = ["--dataset", "synthetic", "--samples", "100", "--features", "4", "--classes", "3", "--hidden", "4",
         "--epochs", "1", "--no-progress"]
# What each command needs besides the flag under test to get as far as reading it.
REST = {"train": SMALL, "launch": ["--dry-run", "-np", "1", "--", "true"], "plot": ["run"], "info": [],
        "bench": []}


def text_flags():
    """``[(command, flag or positional, action)]``: every argument of every command that takes free text."""
    given = getattr(commands_package, "given", None)
    found = []
    parser = cli.build_parser()
    subcommands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for command, sub in subcommands.choices.items():
        for action in sub._actions:
            takes_text = action.nargs in (None, "?") and not action.choices and action.type in (None, str, given)
            if isinstance(action, (argparse._StoreAction,)) and takes_text and action.dest != "help":
                found.append((command, (action.option_strings or [action.metavar])[0], action))
    return found


def test_every_flag_that_takes_text_refuses_an_empty_one():
    from ringtrain.commands import given

    unchecked = [f"{command} {flag}" for command, flag, action in text_flags() if action.type is not given]
    assert not unchecked, f"take text but accept '' as if not given (add type=given): {unchecked}"
    names = {f"{command} {flag}" for command, flag, _ in text_flags()}
    assert {"train --run-dir", "train --config", "train --tensorboard", "train --timeline", "launch --hostfile",
            "launch -o", "launch -H", "launch --mpirun", "launch --host-discovery-script", "plot RUN_DIR",
            "plot -o", "plot --timeline"} <= names


def _argv(command, flag, action):
    if not action.option_strings:  # plot's RUN_DIR
        return [command, ""]
    return [command, flag, "", *REST[command]]


@pytest.mark.parametrize("command, flag, action", text_flags(), ids=[f"{c} {f}" for c, f, _ in text_flags()])
def test_an_empty_value_is_one_line_and_exit_2(monkeypatch, capsys, tmp_path, command, flag, action):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run").mkdir()
    before = snapshot(tmp_path)
    status = cli.main(_argv(command, flag, action))
    out, err = capsys.readouterr()
    assert status == 2 and len(err.splitlines()) == 1, (status, out, err)
    assert err.startswith("ringtrain: error: argument ") and "an empty value" in err and "Traceback" not in err
    assert err.split(": ")[1].startswith("error") and (flag in err.split(": ")[2] or action.metavar in err), err
    assert snapshot(tmp_path) == before


def test_an_empty_path_in_a_config_file_is_refused_too(monkeypatch, capsys, tmp_path):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty.toml").write_text('run_dir = ""\n')
    before = snapshot(tmp_path)
    assert cli.main(["train", *SMALL, "--config", "empty.toml"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "ringtrain: error: --run-dir: an empty value; give one, or leave it out for the default"]
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("flag", ["--run-dir", "--config", "--tensorboard", "--timeline"])
def test_under_mpirun_an_empty_path_is_one_line_from_the_job_and_nothing_is_written(tmp_path, flag):
    before = snapshot(tmp_path)
    result = mpirun.mpirun(2, mpirun.ringtrain("train", *SMALL, flag, ""), timeout=120, cwd=str(tmp_path))
    assert result.returncode == 2, show(result)
    assert result.stderr.strip().splitlines() == [
        f"ringtrain: error: argument {flag}: an empty value; give one, or leave the flag out for the default "
        "(see 'ringtrain train --help')"], show(result)
    assert "Traceback" not in result.stdout + result.stderr and snapshot(tmp_path) == before


@pytest.mark.parametrize("script", [" ", "\t \t"])
def test_a_discovery_command_of_blanks_is_refused_as_empty(monkeypatch, capsys, tmp_path, script):
    # The shell runs blanks as an empty command: no host, ever, and --dry-run printed 'mpirun -np 0'.
    monkeypatch.chdir(tmp_path)
    status = cli.main(["launch", "-np", "1", "--min-np", "1", "--host-discovery-script", script, "--dry-run", "--",
                       "true"])
    out, err = capsys.readouterr()
    assert status == 2 and not out and err.splitlines() == [
        f"ringtrain: error: --host-discovery-script {script!r}: an empty command; give the script that prints the "
        "hosts"], (status, out, err)
    assert snapshot(tmp_path) == []

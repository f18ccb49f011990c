"""Nobody gets in: links planted in a run directory are never written through; no file's text drives the terminal.

Real jobs under real ``mpirun`` at 2 and 3 ranks, each under a time bound.
"""

import json
import os

import pytest

from mpirun import mpirun, ringtrain as rt, run, show
from ringtrain.io.checkpoint import list_checkpoints

SMALL = ["--dataset", "synthetic", "--samples", "400", "--features", "8", "--classes", "3", "--hidden", "8",
         "--batch-size", "8", "--epochs", "2", "--no-progress"]
ESC = "\x1b"


# --- symbolic links in the run directory --------------------------------------------------

def plant(run_dir, target_dir, first_checkpoint):
    """A link in the run directory for each file ringtrain writes there, each to a victim file outside it.

    (A link at a save's temporary name is covered in tests/unit/test_rundir.py: its name holds rank 0's pid.)
    """
    (run_dir / "checkpoints").mkdir(parents=True)
    victims = {}
    for name in ("metrics.jsonl", "config.json", "lineage.json", f"checkpoints/ckpt-{first_checkpoint:08d}.npz",
                 "timeline.json"):
        victim = target_dir / name.replace("/", "_")
        victim.write_text("precious\n")
        os.symlink(victim, run_dir / name)
        victims[name] = victim
    return victims


@pytest.mark.parametrize("ranks", [2, 3])
def test_links_in_the_run_directory_are_never_written_through(tmp_path, ranks):
    run_dir, outside = tmp_path / "run", tmp_path / "outside"
    outside.mkdir()
    victims = plant(run_dir, outside, {2: 20, 3: 14}[ranks])  # the first epoch's end
    result = mpirun(ranks, rt("train", *SMALL, "--run-dir", str(run_dir), "--resume", "none",
                              "--timeline", str(run_dir / "timeline.json")), timeout=90)
    assert result.returncode == 0, show(result)
    for name, victim in victims.items():
        assert victim.read_text() == "precious\n", name
    # What could be replaced atomically was: the config, the lineage, the checkpoints and the timeline are files now.
    for name in ("config.json", "lineage.json", "timeline.json"):
        assert not os.path.islink(run_dir / name), name
    json.loads((run_dir / "config.json").read_text())
    assert len(list_checkpoints(run_dir / "checkpoints")) == 2
    # metrics.jsonl cannot be replaced without losing a resumed run's history: it is refused, once, and said.
    assert os.path.islink(run_dir / "metrics.jsonl")
    warned = [line for line in result.stderr.splitlines() if "metrics.jsonl: is a symbolic link" in line]
    assert len(warned) == 1, show(result)


def test_a_lock_file_that_is_a_link_is_refused_and_nothing_written(tmp_path):
    run_dir, victim = tmp_path / "run", tmp_path / "victim"
    run_dir.mkdir()
    victim.write_text("precious\n")
    os.symlink(victim, run_dir / ".ringtrain.lock")
    result = mpirun(2, rt("train", *SMALL, "--run-dir", str(run_dir)), timeout=60)
    assert result.returncode == 2, show(result)
    assert ".ringtrain.lock is a symbolic link; remove it" in result.stderr, show(result)
    assert victim.read_text() == "precious\n" and sorted(os.listdir(run_dir)) == [".ringtrain.lock"]


# --- terminal escape sequences ------------------------------------------------------------------

def test_escape_sequences_from_a_config_file_never_reach_the_terminal(tmp_path):
    # A run directory named by a config file: clear the screen, retitle the window, ring the bell.
    config = tmp_path / "evil.toml"
    config.write_text('run_dir = "run-\\u001b[2J\\u001b]0;owned\\u0007-x"\n')
    result = mpirun(2, rt("train", *SMALL, "--config", str(config), "--max-steps", "3"), cwd=str(tmp_path),
                    timeout=60)
    assert result.returncode == 0, show(result)
    assert ESC not in result.stdout + result.stderr and "\x07" not in result.stdout + result.stderr
    assert "run directory run-\\x1b[2J\\x1b]0;owned\\x07-x" in result.stdout, show(result)


def test_escape_sequences_in_a_refused_input_are_printed_escaped(tmp_path):
    result = run(rt("train", *SMALL, "--config", str(tmp_path / "x\x1b[2J.toml")), cwd=str(tmp_path), timeout=30)
    assert result.returncode == 2 and ESC not in result.stderr, show(result)
    assert result.stderr.strip().splitlines() == [
        f"ringtrain: error: --config {tmp_path}/x\\x1b[2J.toml: no such file"], show(result)


def test_a_checkpoints_directory_that_is_a_link_is_refused_and_nothing_written(tmp_path):
    run_dir, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    run_dir.mkdir()
    elsewhere.mkdir()
    (elsewhere / "ckpt-00000001.npz").write_text("someone else's\n")
    os.symlink(elsewhere, run_dir / "checkpoints")
    result = mpirun(3, rt("train", *SMALL, "--run-dir", str(run_dir)), timeout=60)
    assert result.returncode == 2, show(result)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "its checkpoints directory is a symbolic link" in lines[0], show(result)
    assert sorted(os.listdir(run_dir)) == ["checkpoints"] and os.listdir(elsewhere) == ["ckpt-00000001.npz"]

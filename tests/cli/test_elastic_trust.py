"""Commits and logs only the job wrote: the real launcher, with real mpirun, against planted directories and commits.

A ``-o`` directory or ``RINGTRAIN_ELASTIC_DIR`` another user owns, or that
others may write, is refused in one line (exit 2, nothing written); a commit
not signed with the directory's key is never unpickled (its pickle would
make a marker file) and the job starts afresh; a ``commits`` entry that is
a symbolic link is refused. Each under a time bound.
"""

import hashlib
import importlib.util
import os
import pickle
import secrets
import sys

import numpy as np
import pytest

from mpirun import mpirun, ringtrain, run, show
from mpirun import test_env as job_env
from ringtrain.cluster.commits import is_owners_own_group
from ringtrain.io.checkpoint import save_checkpoint

needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="the program uses hvd.elastic")
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="making a directory another user owns needs root")
NOBODY = 65534
own_group_alone = pytest.mark.skipif(not is_owners_own_group(os.geteuid(), os.getegid()),
                                     reason="your primary group has other members, so its write bit is theirs too")

# Commits three steps through hvd.elastic.run, and says where it started.
PROGRAM = """
import ringtrain.torch as hvd
hvd.init()
state = hvd.elastic.ObjectState(step=0)
first = []
@hvd.elastic.run
def train(state):
    first.append(state.step)
    while state.step < 3:
        state.step += 1
        state.commit()
    return state.step
result = train(state)
if hvd.rank() == 0:
    print(f"started at {first[0] if first else 'the end'}, ended at {result}", flush=True)
"""


def elastic(*flags, program=("true",)):
    return ringtrain("launch", "-np", "2", "--min-np", "1", "--max-np", "2", "--restart-delay", "0", *flags, "--",
                     *program)


def python_program():
    return (sys.executable, "-c", PROGRAM)


def contents(directory):
    return sorted(os.listdir(directory))


class Planted:
    """Unpickling this runs ``touch MARKER``: what an attacker's commit would do."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def plant_commit(commits, marker, step=5, forged_mac=False):
    """A whole commit (its SHA-256 right) whose pickle makes ``marker``; with an HMAC under another key if asked."""
    arrays = {"state": np.frombuffer(pickle.dumps({"state": Planted(marker), "finished": True, "result": 99}),
                                     np.uint8)}
    meta = {"tensors": 0, "elastic_format": 1, "size": 1, "finished": True, "sequence": step}
    if forged_mac:
        meta["hmac"] = secrets.token_hex(32)
    return save_checkpoint(str(commits), step, arrays, meta)


# --- directories that are not the user's own -----------------------------------------------

@needs_root
@pytest.mark.parametrize("elastic_flags", [[], ["--min-np", "1"]])
@pytest.mark.parametrize("dry_run", [[], ["--dry-run"]])
def test_a_log_directory_another_user_owns_is_refused_and_nothing_written(tmp_path, elastic_flags, dry_run):
    logs = tmp_path / "logs"
    logs.mkdir(mode=0o755)
    os.chown(logs, NOBODY, NOBODY)
    result = run(ringtrain("launch", "-np", "1", *elastic_flags, *dry_run, "-o", str(logs), "--", "true"),
                 timeout=60)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, show(result)
    assert f"-o {logs}: is owned by nobody (uid {NOBODY}), not by you" in result.stderr, show(result)
    assert "Traceback" not in result.stderr and contents(logs) == []


@pytest.mark.parametrize("elastic_flags", [[], ["--min-np", "1"]])
def test_a_log_directory_others_may_write_is_refused_and_nothing_written(tmp_path, elastic_flags):
    logs = tmp_path / "logs"
    logs.mkdir()
    os.chmod(logs, 0o777)
    result = run(ringtrain("launch", "-np", "1", *elastic_flags, "-o", str(logs), "--", "true"), timeout=60)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, show(result)
    assert f"-o {logs}: is writable by its group and others (mode 0777)" in result.stderr, show(result)
    assert contents(logs) == []


# --- directories another user could swap: under one they own, or may write ------------------------

def shared_parent(tmp_path, mode=0o777, owner=None):
    """A directory as another user could leave it: ``mode`` (chmod, so the umask does not trim it), ``owner``'s."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, mode)
    if owner is not None:
        os.chown(shared, owner, owner)
    return shared


def shared_group():
    """A group this user may give a directory and that others share: its write bit lets them in."""
    if os.geteuid() == 0:
        return NOBODY  # nogroup: not root's own
    theirs = [gid for gid in os.getgroups() if not is_owners_own_group(os.geteuid(), gid)]
    if not theirs:
        pytest.skip("giving a directory a group others share needs root or a second group of yours")
    return theirs[0]


@pytest.mark.parametrize("elastic_flags", [[], ["--min-np", "1"]])
@pytest.mark.parametrize("dry_run", [[], ["--dry-run"]])
@pytest.mark.parametrize("made", [False, True])
def test_a_log_directory_under_one_others_may_write_is_refused_and_nothing_written(tmp_path, elastic_flags,
                                                                                   dry_run, made):
    # The launcher's own 0700 directory is no help there: another user renames it away and puts theirs in its place.
    shared = shared_parent(tmp_path)
    logs = shared / "sub"
    if made:
        logs.mkdir(mode=0o700)
    result = run(ringtrain("launch", "-np", "1", *elastic_flags, *dry_run, "-o", str(logs), "--", "true"),
                 timeout=60)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, show(result)
    assert f"-o {logs}: is under {shared}, which its group and others may write and which is not sticky " \
           "(mode 0777)" in result.stderr, show(result)
    assert "Traceback" not in result.stderr and contents(shared) == (["sub"] if made else []), show(result)
    assert not made or contents(logs) == []


@needs_root
def test_a_log_directory_under_one_another_user_owns_is_refused(tmp_path):
    shared = shared_parent(tmp_path, mode=0o755, owner=NOBODY)
    result = run(ringtrain("launch", "-np", "1", "-o", str(shared / "sub"), "--", "true"), timeout=60)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, show(result)
    assert f"is under {shared}, which nobody (uid {NOBODY}) owns, not you or root" in result.stderr, show(result)
    assert contents(shared) == []


def test_a_log_directory_under_a_sticky_one_is_taken(tmp_path):
    # As /tmp: others may make entries there, but only an entry's owner may rename it.
    shared = shared_parent(tmp_path, mode=0o1777)
    result = run(ringtrain("launch", "-np", "1", "-o", str(shared / "sub"), "--", "true"), timeout=60)
    assert result.returncode == 0, show(result)
    assert oct(os.stat(shared / "sub").st_mode & 0o777) == "0o700"


@pytest.mark.parametrize("made", [False, True])
def test_an_elastic_directory_under_one_others_may_write_is_refused_and_nothing_written(tmp_path, made):
    shared = shared_parent(tmp_path, mode=0o775)
    os.chown(shared, -1, shared_group())
    directory = shared / "elastic"
    if made:
        directory.mkdir(mode=0o700)
    result = run(elastic(), timeout=60, env=job_env(RINGTRAIN_ELASTIC_DIR=str(directory)))
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, show(result)
    assert f"RINGTRAIN_ELASTIC_DIR {directory}: is under {shared}, which its group may write and which is not " \
           "sticky (mode 0775)" in result.stderr, show(result)
    assert contents(shared) == (["elastic"] if made else []) and (not made or contents(directory) == [])


def test_an_elastic_directory_reached_through_a_link_in_a_shared_directory_is_refused(tmp_path):
    # The link is the user's, but whoever may write where it lies may point it elsewhere.
    shared, mine = shared_parent(tmp_path), tmp_path / "mine"
    mine.mkdir(mode=0o700)
    os.symlink(mine, shared / "elastic")
    result = run(elastic(), timeout=60, env=job_env(RINGTRAIN_ELASTIC_DIR=str(shared / "elastic")))
    assert result.returncode == 2 and f"is under {shared}, which" in result.stderr, show(result)
    assert contents(mine) == []


def test_a_log_directory_the_launch_makes_is_private(tmp_path):
    logs = tmp_path / "logs"
    result = run(ringtrain("launch", "-np", "1", "-o", str(logs), "--", "true"), timeout=60)
    assert result.returncode == 0, show(result)
    assert oct(os.stat(logs).st_mode & 0o777) == "0o700"


@pytest.mark.parametrize("mode", [0o777, 0o770])
def test_an_elastic_directory_others_may_write_is_refused_and_nothing_written(tmp_path, mode):
    directory = tmp_path / "elastic"
    directory.mkdir()
    os.chmod(directory, mode)
    if mode == 0o770:
        os.chown(directory, -1, shared_group())
    result = run(elastic(), timeout=60, env=job_env(RINGTRAIN_ELASTIC_DIR=str(directory)))
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, show(result)
    assert f"RINGTRAIN_ELASTIC_DIR {directory}: is writable by its group" in result.stderr, show(result)
    assert contents(directory) == []


@own_group_alone
@pytest.mark.parametrize("elastic_flags", [[], ["--min-np", "1"]])
def test_directories_only_your_own_group_may_write_are_yours(tmp_path, elastic_flags):
    # umask 002 with a group per user (Debian, Ubuntu, Fedora): a clone, and what you mkdir in it, are 0775.
    clone = tmp_path / "clone"
    (clone / "logs").mkdir(parents=True)
    (clone / "elastic").mkdir()
    for place in (clone, clone / "logs", clone / "elastic"):
        os.chmod(place, 0o775)
    result = run(ringtrain("launch", "-np", "2", *elastic_flags, "-o", str(clone / "logs"), "--", "true"),
                 timeout=60)
    assert result.returncode == 0, show(result)
    assert contents(clone / "logs") == ["rank-0.log", "rank-1.log"], show(result)
    result = run(elastic(), timeout=60, env=job_env(RINGTRAIN_ELASTIC_DIR=str(clone / "elastic")))
    assert result.returncode == 0, show(result)
    assert "commit.key" in contents(clone / "elastic"), show(result)


def test_a_commits_entry_that_is_a_link_is_refused_and_nothing_written_through_it(tmp_path):
    directory, elsewhere = tmp_path / "elastic", tmp_path / "elsewhere"
    directory.mkdir(mode=0o700)
    elsewhere.mkdir()
    os.symlink(elsewhere, directory / "commits")
    result = run(elastic(), timeout=60, env=job_env(RINGTRAIN_ELASTIC_DIR=str(directory)))
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, show(result)
    assert f"RINGTRAIN_ELASTIC_DIR {directory}/commits: is a symbolic link, which is never followed" \
        in result.stderr, show(result)
    assert contents(elsewhere) == []


# --- commits the job did not write ------------------------------------------------------------

@needs_torch
@pytest.mark.parametrize("key", ["none", "another"])
def test_a_planted_commit_is_never_unpickled_and_the_job_starts_afresh(tmp_path, key):
    directory, marker = tmp_path / "elastic", tmp_path / "planted-code-ran"
    (directory / "commits").mkdir(parents=True, mode=0o700)
    os.chmod(directory, 0o700)
    if key == "another":  # the directory has its key; the attacker signs with one of their own
        (directory / "commit.key").write_bytes(secrets.token_bytes(32))
        os.chmod(directory / "commit.key", 0o600)
    planted = plant_commit(directory / "commits", marker, forged_mac=key == "another")
    result = run(elastic(program=python_program()), timeout=120,
                 env=job_env(RINGTRAIN_ELASTIC_DIR=str(directory)))
    assert not marker.exists(), "the planted commit was unpickled: its code ran\n" + show(result)
    assert result.returncode == 0, show(result)
    assert "started at 0, ended at 3" in result.stdout, show(result)
    warned = [line for line in result.stderr.splitlines() if planted in line]
    assert len(warned) == 1 and "was not written by this directory's launches" in warned[0], show(result)
    assert "not restored, never unpickled" in warned[0], show(result)
    # The launcher checks as rank 0 does: a file named like a commit is no promise of a resume.
    assert "earlier launch" not in result.stderr and "resumes from it" not in result.stderr, show(result)


@needs_torch
@pytest.mark.parametrize("ranks", [1, 3])
def test_a_refused_elastic_directory_under_plain_mpirun_is_named_not_a_resume(tmp_path, ranks):
    # No launcher checked it first, and there is no commit: the job says what is wrong with the directory.
    directory = tmp_path / "elastic"
    directory.mkdir()
    os.chmod(directory, 0o777)
    result = mpirun(ranks, python_program(), timeout=120, env=job_env(RINGTRAIN_ELASTIC_DIR=str(directory)))
    assert result.returncode == 2, show(result)
    errors = [line for line in result.stderr.splitlines() if "error" in line]
    assert len(errors) == 1, show(result)
    assert f"error: RINGTRAIN_ELASTIC_DIR {directory}: is writable by its group and others (mode 0777)" \
        in errors[0], show(result)
    assert "cannot resume" not in result.stderr and contents(directory) == [], show(result)


@needs_torch
def test_a_commit_signed_with_the_directory_key_is_restored(tmp_path):
    # The other side of the coin: the launch's own commits resume (a first launch stopped after its commits).
    directory = tmp_path / "elastic"
    first = run(elastic(program=python_program()), timeout=120, env=job_env(RINGTRAIN_ELASTIC_DIR=str(directory)))
    assert first.returncode == 0 and "started at 0, ended at 3" in first.stdout, show(first)
    key = (directory / "commit.key").read_bytes()
    assert len(key) == 32 and oct(os.stat(directory / "commit.key").st_mode & 0o777) == "0o600"
    again = run(elastic(program=python_program()), timeout=120, env=job_env(RINGTRAIN_ELASTIC_DIR=str(directory)))
    assert again.returncode == 0 and "started at the end, ended at 3" in again.stdout, show(again)
    assert "resuming from the end of the run" in again.stderr and "not restored" not in again.stderr, show(again)
    said = [line for line in again.stderr.splitlines() if "of an earlier launch" in line]
    assert len(said) == 1 and f"{directory} holds commit " in said[0], show(again)
    assert said[0].endswith("signed with its key: the job resumes from it"), show(again)
    assert hashlib.sha256(key).digest() == hashlib.sha256((directory / "commit.key").read_bytes()).digest()

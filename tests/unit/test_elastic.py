"""Elastic training's pure parts: discovery output, the host book, placement, the sampler's index maths, commits.

The launcher's parts need no torch; the sampler's and the commits' skip, saying why, where torch is not installed.
"""

import os
import pickle
import random
import subprocess
import sys
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ringtrain.cluster import elastic as E
from ringtrain.cluster.launch import launch
from ringtrain.commands.launch import add_arguments, elastic_settings
from ringtrain.cluster import commits as C
from ringtrain.cluster.discovery import (DiscoveryError, DiscoveryPoller, HostBook, assign, check_elastic_numbers,
                                         cooldown_seconds, discovery_command, host_of_rank, parse_discovery,
                                         run_discovery)
from ringtrain.cluster.jobs import last_error_line
from ringtrain.cluster.hostfiles import Host
from ringtrain.errors import UsageError
from ringtrain.io.checkpoint import save_checkpoint

try:
    import torch

    from ringtrain.torch.elastic.commits import CommitStore, decode, encode
    from ringtrain.torch.elastic.sampler import ElasticSampler, epoch_order, partition
except ModuleNotFoundError as missing:
    if missing.name != "torch":
        raise
    torch = None
needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed (pip install torch==2.13.0)")


# --- what a discovery script prints -----------------------------------------------

def test_discovery_lines_give_hosts_in_order_with_default_slots():
    assert parse_discovery("h2:4\n\nh1\n 10.0.0.3:1 \n", default_slots=2) == {"h2": 4, "h1": 2, "10.0.0.3": 1}
    assert list(parse_discovery("b:1\na:1\n")) == ["b", "a"]
    assert parse_discovery("") == {}  # no host available yet is an answer, not an error


@pytest.mark.parametrize("text, message", [
    ("h1:2\nh1 slots=2\n", "line 2: expected 'host:slots' or 'host', got 'h1 slots=2'"),
    ("h1:x\n", "line 1: expected 'host:slots' or 'host', got 'h1:x'"),
    ("h1:0\n", "line 1: slots must be between 1 and 65536, got 'h1:0'"),
    ("h1:1\nh1:2\n", "line 2: host h1 is listed twice"),
    ("-np:2\n", "line 1: expected 'host:slots' or 'host', got '-np:2'"),
    ("fe80::1:2\n", "line 1: 'fe80::1:2' is an IPv6 address, which MPI's host lists cannot carry"),
    ("a" * 254 + ":1\n", f"line 1: a host name of 254 characters (at most 253), got {'a' * 77!r}..."),
    ("a" * 9000 + ":x\n", f"line 1: a host name of 9,000 characters (at most 253), got {'a' * 77!r}..."),
    ("h1:" + "x" * 9000 + "\n", f"line 1: expected 'host:slots' or 'host', got {'h1:' + 'x' * 74!r}..."),
])
def test_a_bad_discovery_line_names_its_number(text, message):
    with pytest.raises(DiscoveryError) as err:
        parse_discovery(text, source="script")
    assert str(err.value).startswith(f"script {message}")


def test_a_failing_or_silent_script_says_why(tmp_path):
    assert run_discovery("printf 'a:2\\nb\\n'", 3) == {"a": 2, "b": 3}
    with pytest.raises(DiscoveryError, match="exited with status 3: no cloud"):
        run_discovery("echo 'no cloud' >&2; exit 3")
    with pytest.raises(DiscoveryError, match="did not finish within 0.5s"):
        run_discovery("sleep 5", timeout=0.5)


def test_a_bare_script_name_here_runs_as_horovods_documentation_gives_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "discover_hosts.sh").write_text("#!/bin/sh\necho h1:2\n")
    with pytest.raises(UsageError, match="discover_hosts.sh: not executable; chmod \\+x discover_hosts.sh"):
        discovery_command("discover_hosts.sh")
    (tmp_path / "discover_hosts.sh").chmod(0o755)
    assert discovery_command("discover_hosts.sh") == "./discover_hosts.sh"
    assert run_discovery(discovery_command("discover_hosts.sh")) == {"h1": 2}
    for command in ("echo h1:2", "/bin/true", "true", "missing.sh"):  # commands, paths and names left alone
        assert discovery_command(command) == command


# --- the host book: failures, exclusion, cool-down ----------------------------------

class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_hosts_keep_the_order_they_first_appeared_in_and_changes_are_named():
    book = HostBook()
    assert book.update({"a": 2, "b": 2}) == {"added"}
    assert book.update({"b": 2, "c": 1}) == {"added", "removed"}
    assert book.update({"b": 1, "c": 1}) == {"removed"}
    assert book.update({"c": 1, "b": 1, "a": 2}) == {"added"}
    # a was first seen before b and c: it stays first, so rank 0 stays on the oldest host.
    assert book.available() == [Host("a", 2), Host("b", 1), Host("c", 1)]
    assert book.update({"c": 1, "b": 1, "a": 2}) == set()


def test_a_host_is_left_out_after_repeated_failures_and_for_good_without_a_cooldown():
    book = HostBook(exclude_after=3)
    book.update({"a": 2, "b": 2})
    assert [book.record_failure("b") for _ in range(3)] == [False, False, True]
    assert book.available() == [Host("a", 2)] and book.left_out() == ["b"]
    book.update({"a": 2, "b": 4})  # discovery listing it again does not bring it back
    assert book.available() == [Host("a", 2)]


def test_a_cooldown_brings_a_failing_host_back_later_and_longer_each_time():
    clock = Clock()
    book = HostBook(exclude_after=1, cooldown=(10, 100), clock=clock, draw=lambda: 0.5)
    book.update({"a": 1})
    assert book.record_failure("a") and book.available() == []
    first = cooldown_seconds(1, (10, 100), 0.5)
    assert first == 25.0  # Horovod's lower * 2**n + draw * lower
    clock.now = first - 0.1
    assert book.available() == []
    clock.now = first
    assert book.available() == [Host("a", 1)]
    assert book.record_failure("a")
    clock.now += cooldown_seconds(2, (10, 100), 0.5) - 0.1
    assert book.available() == []
    assert cooldown_seconds(10, (10, 100), 0.9) == 100  # never past the upper bound


def test_ranks_fill_hosts_in_order_up_to_max_np_and_each_rank_knows_its_host():
    hosts = [Host("a", 2), Host("b", 3), Host("c", 1)]
    assert assign(hosts) == hosts
    assert assign(hosts, 4) == [Host("a", 2), Host("b", 2)]
    assert [host_of_rank(assign(hosts, 4), r) for r in range(5)] == ["a", "a", "b", "b", None]


@pytest.mark.parametrize("args, message", [
    ((2, 3, None), "-np 2 is below --min-np 3"),
    ((4, 1, 3), "-np 4 is above --max-np 3"),
    ((3, 2, 1), "-np 3 is above --max-np 1"),
    ((1, 1, 0), "-np 1 is above --max-np 0"),
    ((2, 0, None), "--min-np must be at least 1, got 0"),
])
def test_elastic_numbers_that_cannot_work_are_refused(args, message):
    with pytest.raises(UsageError, match=message):
        check_elastic_numbers(*args, None, 30.0, None, None)


def test_elastic_defaults_are_horovods():
    assert check_elastic_numbers(3, None, None, None, 30.0, None, None) == (3, None)
    with pytest.raises(UsageError, match="--blacklist-cooldown-range 0 5"):
        check_elastic_numbers(3, None, None, None, 30.0, None, (0, 5))


def parsed(*argv):
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args([*argv, "--", "true"])


@pytest.mark.parametrize("flags, message", [
    (["-np", "2", "--min-np", "1", "--slots-per-host", "2"], "--slots-per-host is for the lines of"),
    (["-np", "2", "--min-np", "1", "-H", "a:2", "--host-discovery-script", "true"],
     "give --host-discovery-script or --hostfile/-H, not both"),
    (["-np", "2", "--host-discovery-script", "exit 4"], "host discovery script 'exit 4' exited with status 4"),
    (["-np", "3", "--min-np", "1", "-H", "a:2"], "-np 3 needs 3 slots but the hosts give 2"),
    (["-np", "2", "--min-np", "1", "-H", "fe80::1:2"], "-H entry 1: 'fe80::1:2' is an IPv6 address"),
    (["-np", "2", "--min-np", "1", "--elastic-timeout", "-1"], "--elastic-timeout must be a number of seconds"),
    (["-np", "2", "--min-np", "1", "--blacklist-cooldown-range", "5", "2"], "--blacklist-cooldown-range 5 2"),
    (["--min-np", "1"], "the elastic flags need -np N"),
])
def test_elastic_launches_that_cannot_work_are_refused_before_anything_is_written(tmp_path, flags, message):
    args = parsed(*flags, "-o", str(tmp_path / "logs"))
    with pytest.raises(UsageError, match=message):
        launch(args.np, ["true"], hostfile=args.hostfile, host_list=args.host_list, logdir=args.logdir,
               elastic=elastic_settings(args))
    assert not (tmp_path / "logs").exists()


@pytest.mark.parametrize("flag", [["--slots-per-host", "2"], ["--reset-limit", "1"],
                                  ["--blacklist-cooldown-range", "1", "2"]])
def test_an_elastic_detail_without_an_elastic_flag_is_refused(flag):
    with pytest.raises(UsageError, match=f"{flag[0]} is an elastic flag"):
        elastic_settings(parsed("-np", "2", *flag))
    assert elastic_settings(parsed("-np", "2")) is None


def test_the_dry_run_shows_the_first_starts_command_from_the_discovered_hosts(capsys):
    args = parsed("-np", "2", "--max-np", "3", "--host-discovery-script", "printf 'h1:2\\nh2:2\\n'")
    assert launch(args.np, ["true"], dry_run=True, elastic=elastic_settings(args)) == 0
    out = capsys.readouterr().out
    assert "h1:2,h2:1" in out and "-np 3" in out and "--records-only" in out, out


@pytest.mark.parametrize("script", ["true", "echo h1:1"])
def test_a_dry_run_with_too_few_hosts_now_says_it_would_wait_not_mpirun_np_0(capsys, script):
    args = parsed("-np", "2", "--min-np", "1", "--host-discovery-script", script)
    assert launch(args.np, ["true"], dry_run=True, elastic=elastic_settings(args)) == 0
    out, err = capsys.readouterr()
    assert not out and "fewer than -np 2: the launch would wait up to" in err and "-np 0" not in err, (out, err)


# --- the launcher's notices ----------------------------------------------------------

@needs_torch
def test_notices_and_the_listening_mark_round_trip(tmp_path):
    assert E.read_notice(str(tmp_path)) is None
    E.write_notice(str(tmp_path), 3, {"removed"})
    assert E.read_notice(str(tmp_path)) == (3, ["removed"])
    assert not E.is_listening(str(tmp_path), 2)
    E.write_listening(str(tmp_path), 2)
    assert E.is_listening(str(tmp_path), 2) and not E.is_listening(str(tmp_path), 3)
    env = E.elastic_env("/d", 2, 5)
    assert E.under_elastic_launch(env) and not E.under_elastic_launch({})
    store = CommitStore.from_env(env)
    assert (store.directory, store.job, store.generation) == ("/d", 2, 5)
    assert CommitStore.from_env({}) is None


# --- the sampler's index maths ----------------------------------------------------------

@needs_torch
def test_the_epoch_order_is_horovods():
    order = list(range(10))
    random.Random(3 + 2).shuffle(order)
    assert epoch_order(10, 3, 2, True) == order and epoch_order(10, 3, 2, False) == list(range(10))


def take_epoch(order, resets, batch):
    """Train one epoch in lockstep through ``resets``: ``[(size, steps), ...]``, then the rest at the last size.

    Returns every index taken, in the order the ranks took them, and the
    size of the partition that reached the epoch's end (its padding is the
    only repeat allowed).
    """
    taken, done, ended_at = [], 0, None
    plan = list(resets)
    while True:
        size, steps = plan.pop(0) if plan else (resets[-1][0], None)
        shares = [partition(order, done, size, r)[0] for r in range(size)]
        count = len(shares[0]) if steps is None else min(len(shares[0]), steps * batch)
        for first in range(0, count, batch):
            for share in shares:
                taken += share[first:min(first + batch, count)]
        done += count * size
        if ended_at is None and done >= len(order):
            ended_at = size
        if steps is None or count < steps * batch:
            return taken, ended_at


@needs_torch
@settings(max_examples=150, deadline=None)
@given(length=st.integers(1, 80), batch=st.integers(1, 5), seed=st.integers(0, 5),
       resets=st.lists(st.tuples(st.integers(1, 5), st.integers(0, 6)), min_size=1, max_size=4))
def test_no_sample_is_skipped_or_taken_twice_across_resets_at_any_sizes(length, batch, seed, resets):
    order = epoch_order(length, seed, 0, True)
    taken, last = take_epoch(order, resets, batch)
    # Every index, and beyond that only the final partition's padding (fewer than its size).
    assert set(taken) == set(order)
    assert len(taken) - length < last


@needs_torch
def test_the_taken_prefix_is_the_epoch_order_itself():
    order = epoch_order(24, 1, 0, True)
    taken, _ = take_epoch(order, [(2, 3), (3, 1), (1, 2)], batch=2)
    blocks = []  # each lockstep step takes the next size*batch indices of the order, as a block
    assert sorted(taken) == sorted(order)
    position = 0
    for size, steps in [(2, 3), (3, 1), (1, 2)]:
        for _ in range(steps):
            blocks.append((taken[position:position + size * 2], order[position:position + size * 2]))
            position += size * 2
    assert all(sorted(a) == sorted(b) for a, b in blocks)


@needs_torch
def test_padding_repeats_the_start_of_what_is_left():
    assert partition([5, 6, 7], 0, 2, 0) == ([5, 7], 2) and partition([5, 6, 7], 0, 2, 1) == ([6, 5], 2)
    assert partition([5], 0, 3, 2) == ([5], 1)  # one index left for three ranks: each gets it
    assert partition([5, 6], 2, 3, 0) == ([], 0)


@needs_torch
def test_merging_adds_every_ranks_count_into_the_position():
    state = {"epoch": 4, "processed_num": 10, "global_done": 6, "local_done": 4}
    assert ElasticSampler.merged(state, [4, 4, 3]) == {"epoch": 4, "processed_num": 17, "global_done": 17,
                                                       "local_done": 0}
    assert ElasticSampler.merged({"epoch": 1, "processed_num": 8}, [0])["global_done"] == 8  # Horovod's form


# --- commits ---------------------------------------------------------------------------

class Box:
    """A user's object holding tensors, as an ObjectState value may."""

    def __init__(self, tensor, note):
        self.tensor, self.note = tensor, note


@needs_torch
def test_a_snapshot_round_trips_every_dtype_and_tensors_inside_objects():
    snapshot = {
        "float": torch.randn(3, 2), "half": torch.randn(4).half(), "bf16": torch.randn(5).bfloat16(),
        "bool": torch.tensor([True, False]), "long": torch.arange(6).reshape(2, 3), "scalar": torch.tensor(2.5),
        "strided": torch.arange(12.0).reshape(3, 4).t(), "empty": torch.zeros(0, 3),
        "param": torch.nn.Parameter(torch.ones(2)), "box": Box(torch.full((2,), 7.0), "kept"),
        "plain": [1, "two", {"three": 3.0}],
    }
    arrays, meta = encode(snapshot)
    assert meta["tensors"] == 10 and all(isinstance(a, np.ndarray) for a in arrays.values())
    back = decode(arrays)
    for name in ("float", "half", "bf16", "bool", "long", "scalar", "strided", "empty"):
        assert back[name].dtype == snapshot[name].dtype and torch.equal(back[name], snapshot[name]), name
    assert isinstance(back["param"], torch.nn.Parameter) and back["param"].requires_grad
    assert torch.equal(back["box"].tensor, snapshot["box"].tensor) and back["box"].note == "kept"
    assert back["plain"] == snapshot["plain"]


@needs_torch
def test_the_newest_whole_commit_is_found_and_a_damaged_one_falls_back(tmp_path):
    store = CommitStore(str(tmp_path))
    assert store.latest() is None
    store.write(1, {"w": torch.ones(3), "step": 1}, size=2)
    store.write(2, {"w": torch.full((3,), 2.0), "step": 2}, size=2)
    store.write(3, {"w": torch.full((3,), 3.0), "step": 3}, size=1, finished=True)
    assert sorted(p.name for p in (tmp_path / "commits").iterdir()) == ["ckpt-00000002.npz", "ckpt-00000003.npz"]
    sequence, snapshot, meta = store.latest()
    assert (sequence, snapshot["step"], meta["size"], meta["finished"]) == (3, 3, 1, True)
    newest = tmp_path / "commits" / "ckpt-00000003.npz"
    newest.write_bytes(newest.read_bytes()[:-100])  # cut short, as by a crash of the file system
    with pytest.warns(UserWarning, match="skipping damaged"):
        sequence, snapshot, _ = store.latest()
    assert sequence == 2 and torch.equal(snapshot["w"], torch.full((3,), 2.0))


@needs_torch
def test_a_commit_that_cannot_be_written_says_where_in_one_line(tmp_path):
    (tmp_path / "commits").write_text("a file where the commits directory should be")
    with pytest.raises(UsageError) as err:
        CommitStore(str(tmp_path)).write(1, {"step": 1}, size=1)
    assert str(err.value).startswith(f"could not write checkpoint {tmp_path}/commits/ckpt-00000001.npz")
    assert "\n" not in str(err.value)


# --- discovery bounded in time and in what it reads, off the launcher's loop ------------------------

def test_a_discovery_script_that_hangs_is_killed_with_its_children_and_counts_as_failed(tmp_path):
    pid_file = tmp_path / "pid"
    with pytest.raises(DiscoveryError, match=r"did not finish within 0.5s; it was killed"):
        run_discovery(f"sleep 600 & echo $! > {pid_file}; wait", timeout=0.5)
    child = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):
        for _ in range(100):
            os.kill(child, 0)
            time.sleep(0.05)


def test_a_discovery_script_that_prints_too_much_is_refused_not_read_whole():
    with pytest.raises(DiscoveryError, match="printed more than 1,024 bytes"):
        run_discovery("yes localhost:1", limit=1024)
    assert run_discovery("echo a:2; echo b:1 >&2; yes x | head -c 5000000 >&2") == {"a": 2}


def test_the_poller_answers_without_waiting_for_a_script_that_hangs(tmp_path):
    flag = tmp_path / "hang"
    poller = DiscoveryPoller(f"test -e {flag} && exec sleep 600; echo h:1", period=0.05, timeout=600)
    with poller:
        deadline = time.monotonic() + 30
        answer = None
        while answer is None and time.monotonic() < deadline:
            answer = poller.take()
            time.sleep(0.01)
        assert answer == {"h": 1}
        flag.touch()
        time.sleep(0.5)  # a run is hanging now
        began = time.monotonic()
        for _ in range(10):
            poller.take()  # never waits for it
        assert time.monotonic() - began < 5
    assert not poller._thread.is_alive(), "closing the poller left its thread (and the script) running"


def test_the_last_error_line_tells_failures_apart():
    log = "step 1\nTraceback (most recent call last):\n  File \"x.py\", line 1\n    raise ValueError('a')\n" \
          "ValueError: a\nrank 0: ValueError: a\n"
    assert last_error_line(log) == "rank 0: ValueError: a"
    assert last_error_line("Traceback (most recent call last):\n  File 'y'\nKeyError: 'k'\n") == "KeyError: 'k'"
    assert last_error_line("all went well\n") is None
    assert last_error_line("rank 1: allreduce 'g' did not finish within 5s; waiting on rank 0\n") is None


# --- the commit directory: the user's own, commits signed with its key -----------------------------

class _Marker:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def _forged(directory, marker, step=3):
    arrays = {"state": np.frombuffer(pickle.dumps({"x": _Marker(marker)}), np.uint8)}
    meta = {"elastic_format": 1, "size": 1, "finished": False, "sequence": step, "hmac": "0" * 64}
    return save_checkpoint(str(directory / "commits"), step, arrays, meta)


def test_a_commit_not_signed_with_the_key_is_never_unpickled_and_the_signed_one_before_it_is_restored(tmp_path):
    store = C.CommitStore(str(tmp_path))
    store.write(1, {"step": 1}, size=2)
    assert oct(os.stat(tmp_path / "commit.key").st_mode & 0o777) == "0o600"
    assert oct(os.stat(tmp_path / "commits").st_mode & 0o777) == "0o700"
    marker = tmp_path / "ran"
    forged = _forged(tmp_path, marker)
    warned = []
    sequence, snapshot, _ = store.latest(warn=warned.append)
    assert not marker.exists() and (sequence, snapshot) == (1, {"step": 1})
    assert len(warned) == 1 and forged in warned[0] and "its HMAC does not match" in warned[0]
    os.unlink(tmp_path / "commit.key")  # no key: nothing can be checked, nothing is restored
    warned.clear()
    assert store.latest(warn=warned.append) is None and not marker.exists() and len(warned) == 2


def test_links_under_the_commit_directory_are_never_followed(tmp_path):
    store = C.CommitStore(str(tmp_path / "d"))
    store.write(1, {"step": 1}, size=1)
    elsewhere = tmp_path / "elsewhere.npz"
    os.rename(tmp_path / "d" / "commits" / "ckpt-00000001.npz", elsewhere)
    os.symlink(elsewhere, tmp_path / "d" / "commits" / "ckpt-00000001.npz")
    warned = []
    assert store.latest(warn=warned.append) is None and "symbolic link" in warned[0]
    store.write(2, {"step": 2}, size=1)
    store.write(3, {"step": 3}, size=1)  # prunes: only regular files, never the link's target
    assert elsewhere.exists()
    other = C.CommitStore(str(tmp_path / "e"))
    os.makedirs(tmp_path / "e", mode=0o700)
    os.symlink(tmp_path / "elsewhere-dir", tmp_path / "e" / "commits")
    with pytest.raises(UsageError, match="commits: is a symbolic link, which is never followed"):
        other.write(1, {"step": 1}, size=1)
    assert not (tmp_path / "elsewhere-dir").exists()


@pytest.mark.parametrize("mode, message", [(0o644, "may be read or written by others"), (0o600, None)])
def test_a_key_others_can_read_is_refused(tmp_path, mode, message):
    key = C.make_key(str(tmp_path))
    os.chmod(tmp_path / "commit.key", mode)
    if message is None:
        assert C.read_key(str(tmp_path)) == key
    else:
        with pytest.raises(UsageError, match=message):
            C.read_key(str(tmp_path))


def test_a_directory_others_can_write_is_refused(tmp_path):
    os.chmod(tmp_path, 0o777)
    assert C.directory_problem(str(tmp_path)) == "is writable by its group and others (mode 0777)"
    with pytest.raises(UsageError, match="another user could plant files there"):
        C.CommitStore(str(tmp_path)).write(1, {}, size=1)
    os.chmod(tmp_path, 0o700)
    assert C.directory_problem(str(tmp_path)) is None


def describe_group(monkeypatch, shared):
    """The user and group databases as they would read: the user's group theirs alone, or shared with another."""
    primary = [("me", os.geteuid())] + ([("colleague", os.geteuid() + 4242)] if shared else [])
    monkeypatch.setattr(C, "_group_users", lambda uid, gid: (primary, [], ("me", gid)))


@pytest.mark.parametrize("primary, members, owner, alone", [
    ([("ann", 1000)], [], ("ann", 1000), True),                    # Debian's user private group
    ([], ["ann"], ("ann", 1000), True),                            # listed as a member, not as a primary group
    ([("ann", 1000), ("bob", 1001)], [], ("ann", 1000), False),    # another user's primary group too
    ([("ann", 1000)], ["bob"], ("ann", 1000), False),              # another member
    ([("ann", 1000)], [], ("ann", 100), False),                    # not the owner's primary group
    ([], [], None, False),                                         # an owner the system does not know
])
def test_a_group_is_the_owners_own_when_it_is_their_primary_and_holds_nobody_else(primary, members, owner, alone):
    assert C.owners_own_group(1000, 1000, primary, members, owner) is alone


@pytest.mark.parametrize("mode", [0o775, 0o770])
def test_a_directory_only_its_owners_own_group_may_write_is_the_owners(tmp_path, monkeypatch, mode):
    # umask 002 with a group per user (Debian, Ubuntu, Fedora): a clone or mkdir there is 0775, and yours alone.
    (tmp_path / "mine" / "logs").mkdir(parents=True)
    for place in (tmp_path / "mine", tmp_path / "mine" / "logs"):
        os.chmod(place, mode)
    describe_group(monkeypatch, shared=False)
    assert C.directory_problem(str(tmp_path / "mine" / "logs")) is None
    assert C.make_private_directory(str(tmp_path / "mine" / "new"), "-o") is None
    describe_group(monkeypatch, shared=True)
    assert C.directory_problem(str(tmp_path / "mine" / "logs")) == f"is writable by its group (mode {mode:04o})"
    with pytest.raises(UsageError, match=f"is under {tmp_path / 'mine'}, which its group may write"):
        C.make_private_directory(str(tmp_path / "mine" / "other"), "-o")
    assert not (tmp_path / "mine" / "other").exists()


@pytest.mark.parametrize("mode, refused", [(0o777, True), (0o775, True), (0o1777, False), (0o755, False)])
def test_a_directory_under_one_others_may_write_is_refused_unless_sticky(tmp_path, monkeypatch, mode, refused):
    describe_group(monkeypatch, shared=True)  # so that 0775 lets someone else write
    shared = tmp_path / "shared"
    (shared / "a" / "b").mkdir(parents=True, mode=0o700)
    os.chmod(shared, mode)
    problem = C.directory_problem(str(shared / "a" / "b"))
    assert (problem is not None) == refused, problem
    if refused:
        assert problem.startswith(f"is under {shared}, which its group") and "not sticky" in problem
        with pytest.raises(UsageError, match="could put a directory of theirs in its place"):
            C.CommitStore(str(shared / "a" / "b")).write(1, {}, size=1)
        with pytest.raises(UsageError, match=f"is under {shared}"):
            C.make_private_directory(str(shared / "new"), "-o")
        assert not (shared / "new").exists()


def test_the_commit_store_works_without_torch(tmp_path):
    # Every framework's hvd.elastic uses it: torch blocked, a commit still round-trips (signed and verified).
    code = ("import sys; sys.modules['torch'] = None\n"
            "from ringtrain.cluster.commits import CommitStore\n"
            f"store = CommitStore({str(tmp_path)!r}); store.write(1, {{'a': [1, 2]}}, size=1)\n"
            "print(store.latest()[:2])\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "(1, {'a': [1, 2]})", done.stderr


@pytest.mark.parametrize("line", ["node1:²", "node1:" + "9" * 30])
def test_discovery_slots_must_be_a_plain_bounded_count(line):
    from ringtrain.cluster.discovery import DiscoveryError, parse_discovery
    with pytest.raises(DiscoveryError, match="expected 'host:slots'"):
        parse_discovery(line)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_notices_and_listening_marks_another_user_owns_are_not_believed(tmp_path):
    # Left from when the directory was shared (refused, then chmod go-w as told), they are still theirs to
    # rewrite: a notice of theirs would stop the job at every commit, a mark keep the launcher from signalling.
    E.write_notice(str(tmp_path), 3, {"removed"})
    E.write_listening(str(tmp_path), 2)
    for name in ("hosts.json", "listening.json"):
        os.chown(tmp_path / name, 65534, 65534)
    assert E.read_notice(str(tmp_path)) is None and not E.is_listening(str(tmp_path), 2)


def test_a_stop_the_launcher_asked_for_is_told_from_a_failure_by_the_ranks_exit_records():
    import signal

    usr1, kill = signal.SIGUSR1, signal.SIGKILL
    assert E.stopped_as_asked(E.RESTART_STATUS, {})  # a commit's 75
    assert E.stopped_as_asked(usr1, {0: (1.0, -usr1), 1: (1.0, -usr1)})  # every rank died of the signal
    assert E.stopped_as_asked(128 + usr1, {0: (1.0, 128 + usr1)})  # a program that exits as SIGUSR1 ends
    # mpiexec ORs the ranks' statuses, and kills a rank still running once one died of a signal.
    assert E.stopped_as_asked(usr1 | kill, {0: (1.0, -usr1)})
    assert E.stopped_as_asked(usr1 | kill, {0: (1.0, -usr1), 1: (1.1, -kill)})
    # The same number from a rank that crashed is a failure: its record says so.
    assert not E.stopped_as_asked(usr1 | kill, {0: (1.0, -usr1), 1: (1.1, -signal.SIGSEGV)})
    assert not E.stopped_as_asked(signal.SIGSEGV | kill, {0: (1.0, -signal.SIGSEGV)})
    assert not E.stopped_as_asked(1, {0: (1.0, 1)})
    # 11 with no records, or with SIGKILL's alone, proves no stop: a crash whose ranks left no word is blamed.
    assert not E.stopped_as_asked(usr1 | kill, {})
    assert not E.stopped_as_asked(usr1 | kill, {0: (1.0, -kill), 1: (1.1, -kill)})


def test_a_rank_that_crashes_during_an_asked_stop_is_blamed_not_the_first_that_stopped():
    import signal

    usr1, kill, segv = signal.SIGUSR1, signal.SIGKILL, signal.SIGSEGV
    crashed = {0: (1.0, -usr1), 1: (1.001, -segv), 2: (1.002, -kill)}
    assert E.blamed_rank(crashed, asked=True) == 1
    assert E.blamed_rank(crashed, asked=False) == 0  # unasked, a SIGUSR1 end is a failure like any
    assert E.blamed_rank({0: (1.0, -usr1), 1: (1.1, -kill)}, asked=True) is None
    assert E.blamed_rank({}, asked=True) is None

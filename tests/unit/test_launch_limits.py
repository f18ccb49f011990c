"""The launcher's fault handling, without MPI: caps, blame, log tails, leftovers, escalation, links."""

import os

import pytest

from ringtrain.cluster import jobs as J
from ringtrain.cluster import leftovers, reaper
from ringtrain.cluster.hostfiles import MAX_NP, parse_host_list, parse_hostfile
from ringtrain.cluster.launch import check_runnable, write_replacing
from ringtrain.cluster.rank_log import open_log
from ringtrain.errors import UsageError


# --- what the launcher accepts ------------------------------------------------------

@pytest.mark.parametrize("text", ["localhost slots=2147483647", "localhost:2147483647",
                                  f"node1 slots=2 max_slots={MAX_NP + 1}"])
def test_a_slot_count_past_the_limit_is_refused_by_line(text):
    with pytest.raises(UsageError, match="^hostfile line 1: .* is above ringtrain launch's limit of 65,536 "
                                         "per host"):
        parse_hostfile(text)


def test_slots_that_add_up_past_the_limit_are_refused():
    # Each line alone is fine; Hydra's int total is not (2**30 + 2**30 overflows it).
    with pytest.raises(UsageError, match="^hostfile gives 131,072 slots in all, above"):
        parse_hostfile(f"a:{MAX_NP}\nb:{MAX_NP}\n")
    with pytest.raises(UsageError, match="^-H entry 1: slots 70,000 is above"):
        parse_host_list("a:70000")
    assert parse_hostfile(f"a:{MAX_NP}")[0].slots == MAX_NP


def test_a_command_that_cannot_run_is_refused_before_anything_starts(tmp_path):
    (tmp_path / "data").write_text("x")
    with pytest.raises(UsageError, match="^cannot run 'no-such-program-xyz': not found on PATH; check"):
        check_runnable(["no-such-program-xyz"])
    with pytest.raises(UsageError, match="not an executable file"):
        check_runnable([str(tmp_path / "data")])
    with pytest.raises(UsageError, match="no such file"):
        check_runnable([str(tmp_path / "missing")])
    check_runnable(["true"])


# --- who is blamed -------------------------------------------------------------------

def test_output_that_merely_says_error_blames_nobody():
    logs = {0: "epoch 1 validation error: 0.31\n", 1: "see abort.py; Killed 3 stale jobs\n"}
    assert J.failed_rank(logs) is None
    assert J.failure_report(logs)[0] is None


def test_the_rank_with_the_failure_record_is_blamed_not_the_one_that_printed_error():
    logs = {0: "error: this is just a log line\n", 1: "step 3\nrank 1: RuntimeError: boom\n"}
    assert J.failed_rank(logs) == 1


def test_a_traceback_is_a_failure():
    assert J.failed_rank({0: "fine\n", 2: "Traceback (most recent call last):\n  x\nValueError: v\n"}) == 2


def test_after_a_stall_the_rank_the_watchdogs_waited_on_is_blamed():
    line = "rank {r}: gradient allreduce at step 4 did not finish within 5s; waiting on rank {w} (raise ...)\n"
    # Rank 1 stalled: rank 2 waited on it; rank 0 waited on rank 2, which was itself only waiting.
    logs = {0: line.format(r=0, w=2), 1: "step 3\n", 2: line.format(r=2, w=1)}
    assert J.failed_rank(logs) == 1


def test_without_a_record_in_any_log_the_rank_whose_process_failed_first_is_blamed(tmp_path):
    logs = {0: "validation error: 0.3\n", 1: "", 2: "step 4\n"}
    exits = {2: (105.0, -9), 1: (100.5, -9), 0: (106.0, 1)}
    assert J.failure_report(logs, exits=exits) == (1, [(1, [])])
    assert J.failure_report({0: "rank 0: RuntimeError: x\n"}, exits={1: (1.0, -9)})[0] == 0  # the record wins
    (tmp_path / "rank-3.exit").write_text("123.5 -9\n")
    (tmp_path / "rank-4.exit").write_text("garbage\n")
    assert J.read_exit_records(str(tmp_path)) == {3: (123.5, -9)}
    assert J.parse_exit_record("1.5 2") == (1.5, 2) and J.parse_exit_record("x y") is None


def test_only_the_tail_of_a_long_log_is_read(tmp_path):
    path = tmp_path / "rank-0.log"
    path.write_bytes(b"x" * 10 + b"\n" + b"filler line\n" * 100_000 + b"the end\n")
    tail = J.read_tail(str(path), limit=4096)
    assert len(tail) <= 4096 and tail.endswith("the end\n") and tail.startswith("filler line\n")
    assert J.read_rank_logs(str(tmp_path))[0].endswith("the end\n")


# --- what a failed job leaves behind ------------------------------------------------

def test_only_segments_made_during_the_job_and_mapped_by_nobody_are_leftovers():
    before = {"/dev/shm/mpich_shm_old": 5.0, "/dev/shm/mpich_shm_again": 5.0}
    after = {"/dev/shm/mpich_shm_old": 5.0, "/dev/shm/mpich_shm_again": 101.0, "/dev/shm/mpich_shm_new": 100.0,
             "/dev/shm/mpich_shm_busy": 100.0, "/dev/shm/mpich_shm_stale": 50.0}
    assert leftovers.leftovers(before, after, {"/dev/shm/mpich_shm_busy"}, since=100.0) == [
        "/dev/shm/mpich_shm_again", "/dev/shm/mpich_shm_new"]


def test_sweep_removes_the_new_unmapped_segments_only(tmp_path):
    old = tmp_path / "mpich_shm_old"
    old.write_bytes(b"o")
    before = leftovers.segments(str(tmp_path))
    since = os.path.getmtime(old) + 5
    new = tmp_path / "mpich_shm_new"
    new.write_bytes(b"n")
    os.utime(new, (since + 1, since + 1))
    (tmp_path / "unrelated").write_bytes(b"u")
    assert leftovers.sweep(before, since, directory=str(tmp_path), settle=0) == [str(new)]
    assert sorted(os.listdir(tmp_path)) == ["mpich_shm_old", "unrelated"]


# --- ending what was started ---------------------------------------------------------

@pytest.mark.parametrize("first, second, forced, started, expected", [
    (1.0, None, False, True, "wait"),
    (reaper.FORCE_AFTER + 1, None, False, True, "force"),
    (reaper.FORCE_AFTER + 1, None, True, True, "wait"),
    (reaper.FORCE_AFTER + reaper.KILL_AFTER + 1, None, True, True, "kill"),
    (5.0, 0.1, False, True, "force"),
    (5.0, reaper.INSIST_KILL_AFTER + 0.1, True, True, "kill"),
    (reaper.NOTHING_STARTED_AFTER + 0.1, None, False, False, "kill"),
    (0.5, None, False, False, "wait"),
])
def test_the_escalation_after_a_stop_signal(first, second, forced, started, expected):
    assert reaper.next_step(first, second, forced, started) == expected


# --- symbolic links in -o --------------------------------------------------------------

def test_a_rank_log_never_writes_through_a_link(tmp_path):
    target = tmp_path / "precious"
    target.write_text("keep me\n")
    link = tmp_path / "rank-0.log"
    link.symlink_to(target)
    os.close(open_log(str(link), restart=0))
    assert target.read_text() == "keep me\n" and not link.is_symlink()
    link.unlink()
    link.symlink_to(target)
    with pytest.raises(OSError):  # a restart appends, and a link put there since is refused
        open_log(str(link), restart=1)
    assert target.read_text() == "keep me\n"


def test_the_hostfile_replaces_a_link_instead_of_writing_its_target(tmp_path):
    target = tmp_path / "precious"
    target.write_text("keep me\n")
    link = tmp_path / "hostfile"
    link.symlink_to(target)
    write_replacing(str(link), "localhost:2\n")
    assert target.read_text() == "keep me\n"
    assert not link.is_symlink() and link.read_text() == "localhost:2\n"
    assert sorted(os.listdir(tmp_path)) == ["hostfile", "precious"]

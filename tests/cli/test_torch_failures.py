"""ringtrain.torch's failure model in real jobs: a rank that raises, exits, is killed, shuts down, lags or never comes.

Each job runs under a time bound (a hang is a failed assertion that shows
what the job printed); assertions come after it ends. The program is
tests/cli/programs/hvd_failures.py; rank 1 is the one that fails. Skipped
without torch.
"""

import os
import re
import sys

import pytest

import mpirun
from mpirun import ROOT, show

pytest.importorskip("torch", reason="torch is not installed (pip install torch==2.13.0)")

PROGRAM = os.path.join(ROOT, "tests", "cli", "programs", "hvd_failures.py")


def job(np, case, timeout=90, **env):
    return mpirun.mpirun(np, [sys.executable, PROGRAM, case], timeout=timeout, env=mpirun.test_env(**env))


def failures(result, op):
    """``{rank: message}`` of the ranks that printed ``<op> failed: <message>`` (mpiexec may join two ranks'
    lines: a message ends where the next rank's begins)."""
    return {int(r): m for r, m in re.findall(rf"rank (\d+): {op} failed: (.*?)(?=rank \d+: |$)", result.stdout,
                                             re.M)}


@pytest.mark.parametrize("np", [2, 3])
def test_a_rank_that_raises_fails_every_other_ranks_ops_naming_it_and_the_job_ends(np):
    result = job(np, "raise")
    assert result.returncode != 0, show(result)
    assert "boom on purpose" in result.stderr, show(result)
    for op in ("loss", "pending", "later"):
        found = failures(result, op)
        assert sorted(found) == [r for r in range(np) if r != 1], show(result)
        for message in found.values():
            assert f"{op}'" in message and "rank 1 raised RuntimeError: boom on purpose" in message, show(result)


@pytest.mark.parametrize("np", [2, 3])
def test_a_rank_that_exits_fails_every_other_ranks_ops_and_the_job_ends_with_its_status(np):
    result = job(np, "exit")
    assert result.returncode == 3, show(result)
    found = failures(result, "loss")
    assert sorted(found) == [r for r in range(np) if r != 1], show(result)
    assert all("rank 1 has been shut down" in m for m in found.values()), show(result)


def test_a_killed_rank_ends_the_job():
    result = job(3, "kill")
    assert result.returncode != 0, show(result)
    assert not re.findall(r"loss ok", result.stdout), show(result)


@pytest.mark.parametrize("np", [2, 3])
def test_ops_after_a_peers_shutdown_and_ops_pending_at_shutdown_fail_without_waiting(np):
    result = job(np, "shutdown")
    assert result.returncode == 0, show(result)
    for op in ("loss", "pending", "later"):
        found = failures(result, op)
        assert sorted(found) == [r for r in range(np) if r != 1], show(result)
        assert all("rank 1 has been shut down" in m for m in found.values()), show(result)
    mine = failures(result, "mine")
    assert sorted(mine) == list(range(np)), show(result)
    assert all("has been shut down" in m for m in mine.values()), show(result)


def test_a_rank_that_shuts_down_right_after_its_last_op_leaves_a_peer_still_hearing_that_op_to_finish_it():
    # Rank 2's announcements reach rank 1 late: ranks 0 and 2 finish the last op and shut down first.
    result = job(3, "shutdown-race", timeout=60)
    assert result.returncode == 0, show(result)
    assert sorted(re.findall(r"rank (\d+): loop ok", result.stdout)) == ["0", "1", "2"], show(result)


def test_a_stall_is_reported_naming_the_late_rank_then_fails_the_waiting_ranks_before_it_arrives():
    # Horovod's test/integration/test_stall.py: check after 2 s, shut down after 5 s, a rank 20 s late.
    result = job(3, "stall", timeout=120)
    assert result.returncode == 0, show(result)
    assert re.search(r"WARNING rank 0: process set 0 .*\nMissing ranks:\n1: \[[^]]*allreduce\.loss", result.stderr), \
        show(result)
    assert re.search(r"1!: \[[^]]*allreduce\.loss", result.stderr) and "Will shutdown" in result.stderr, show(result)
    found = failures(result, "loss")
    assert sorted(found) == [0, 1, 2], show(result)  # the late rank's op fails too, once it comes
    assert all("rank(s) [1] kept an op waiting more than 5s" in m for m in found.values()), show(result)
    assert "rank 1: a peer failed before I arrived" in result.stdout, show(result)


def test_a_stall_in_a_process_set_is_reported_for_that_set_and_its_missing_rank():
    result = job(3, "set-stall")
    assert result.returncode == 0, show(result)
    # Reported by the set's leader (its lowest rank, 1), naming the set and the rank that has not come.
    assert re.search(r"WARNING rank 1: process set 1 \(ranks \[1, 2\]\): .*\nMissing ranks:\n2: \[allreduce\.in-set\]",
                     result.stderr), show(result)
    assert "process set 0" not in result.stderr, show(result)
    assert sorted(re.findall(r"rank (\d): in-set ok", result.stdout)) == ["1", "2"], show(result)


@pytest.mark.parametrize("np", [2, 3])
def test_ringtrains_bound_names_the_users_op_and_the_missing_rank_and_ends_the_job(np):
    # Rank 1 sleeps two minutes: only the bound can end the job within the test's.
    result = job(np, "bound", timeout=60, RINGTRAIN_TIMEOUT="5")
    assert result.returncode != 0, show(result)
    # The oldest op a rank waits on is named: the async one it submitted first, or the blocking one.
    lines = re.findall(r"rank (\d+): allreduce '(?:pending|loss)' did not finish within 5s; rank\(s\) \[1\] have not "
                       r"submitted it", result.stderr)
    assert set(lines) <= {str(r) for r in range(np) if r != 1} and lines, show(result)


@pytest.mark.parametrize("np", [2, 3])
def test_a_rank_that_raises_or_never_comes_after_a_loop_of_lone_ops_ends_the_job_naming_it(np):
    # The loop's ops run alone on every rank (no board); the failing op then takes the general path,
    # which must still fail it naming rank 1 (raise), or end the job at the bound (never comes).
    result = job(np, "alone-raise")
    assert result.returncode != 0, show(result)
    found = failures(result, "loss")
    assert sorted(found) == [r for r in range(np) if r != 1], show(result)
    assert all("rank 1 raised RuntimeError: boom on purpose" in m for m in found.values()), show(result)
    result = job(np, "alone-bound", timeout=60, RINGTRAIN_TIMEOUT="5")
    assert result.returncode != 0, show(result)
    assert re.search(r"rank [02]: allreduce 'loss' did not finish within 5s; rank\(s\) \[1\] have not submitted it",
                     result.stderr), show(result)


def test_after_a_loop_of_lone_ops_a_rank_calling_another_name_of_the_same_length_never_pairs_with_the_others():
    # The loop's calls are checked against each member's last one of the record by their bytes: rank 1's
    # next call, "lost", is the same record with a name as long as "loss", and must not be taken for it.
    result = job(2, "alone-rename", timeout=60, RINGTRAIN_TIMEOUT="5")
    assert result.returncode != 0, show(result)
    assert not re.search(r"(loss|lost) ok", result.stdout), show(result)
    assert re.search(r"rank [01]: allreduce '(loss|lost)' did not finish within 5s; rank\(s\) \[[01]\] have not "
                     r"submitted it", result.stderr), show(result)


# --- helpers that run around the engine: broadcast_parameters, the optimizer's reductions, hvd.elastic ---

def test_a_rank_that_exits_in_backward_fails_a_later_helper_and_ends_a_rank_stuck_in_its_reduction():
    # Rank 1 exits inside its backward; rank 2 is in the optimizer's gradient reduction (a collective
    # that rank 1 never joins); rank 0 calls an op and then broadcast_parameters after hearing of it.
    result = job(3, "exit-helpers", timeout=60)
    assert result.returncode != 0, show(result)
    assert "rank 0: probe failed: allreduce 'probe': rank 1 has been shut down" in result.stdout, show(result)
    assert "rank 0: broadcast_parameters failed: broadcast_parameters: rank 1 has been shut down" in result.stdout, \
        show(result)
    assert re.search(r"rank 2: DistributedOptimizer: a gradient bucket's reduction in backward\(\) cannot finish: "
                     r"rank 1 has been shut down", result.stderr), show(result)


@pytest.mark.parametrize("np", [2, 3])
def test_ringtrains_bound_reaches_the_optimizers_reductions_and_names_them(np):
    # Rank 1 sleeps two minutes before its backward: only the bound can end the job within the test's.
    result = job(np, "bound-optimizer", timeout=60, RINGTRAIN_TIMEOUT="5")
    assert result.returncode != 0, show(result)
    waiting = re.findall(r"rank (\d+): DistributedOptimizer: [^\n]* did not finish within 5s", result.stderr)
    assert waiting and set(waiting) <= {str(r) for r in range(np) if r != 1}, show(result)


@pytest.mark.parametrize("np", [2, 3])
def test_a_rank_that_exits_in_an_elastic_loop_ends_the_job_instead_of_retrying_without_it(np):
    # An MPI world cannot lose a rank: hvd.elastic.run must not restore and retry in a broken engine
    # (its state.sync would wait for the gone rank for ever); the job ends, for the launcher to restart.
    result = job(np, "exit-elastic", timeout=60)
    assert result.returncode != 0, show(result)
    assert "rank 1 has been shut down" in result.stderr, show(result)

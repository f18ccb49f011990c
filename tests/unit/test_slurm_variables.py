"""Slurm's variables, the launcher check and the time-limit rule: pure functions, without Slurm or MPI.

The variables are the ones a real one-node Slurm 22.05 set (tests/cli/test_slurm.py
runs the real thing): a batch script has SLURM_NTASKS but no step id; an
srun task has SLURM_STEP_ID and SLURM_STEP_NUM_TASKS.
"""

import re
import subprocess

import pytest

from ringtrain.cluster.hostfiles import Host
from ringtrain.cluster.jobs import should_restart
from ringtrain.cluster.launch import check_request, slurm_request
from ringtrain.cluster.slurm import (allocation_hosts, allocation_tasks, expand_counts, expand_hostlist,
                                     parse_time_left, step_tasks, time_left)
from ringtrain.cluster.topology import launcher_mismatch, refuse_launcher_mismatch
from ringtrain.errors import UsageError
from ringtrain.training.stopping import EXIT_SLACK, Deadline, stop_margin

# What Slurm 22.05 set, seen on a one-node Slurm: a batch script of --ntasks=2, a task of srun -n 2,
# a task of srun -n 1 inside that batch job, and a task of srun --mpi=pmi2 -n 2.
BATCH = {"SLURM_JOB_ID": "2", "SLURM_JOB_NODELIST": "vm", "SLURM_LOCALID": "0", "SLURM_NODELIST": "vm",
         "SLURM_NPROCS": "2", "SLURM_NTASKS": "2", "SLURM_PROCID": "0", "SLURM_TASKS_PER_NODE": "2"}
STEP = dict(BATCH, SLURM_PROCID="1", SLURM_LOCALID="1", SLURM_STEPID="0", SLURM_STEP_ID="0",
            SLURM_STEP_NUM_TASKS="2")
STEP_OF_ONE = dict(BATCH, SLURM_NPROCS="1", SLURM_NTASKS="1", SLURM_STEPID="0", SLURM_STEP_ID="0",
                   SLURM_STEP_NUM_TASKS="1")
PMI2_STEP = dict(STEP, PMI_FD="13", PMI_JOBID="2.1", PMI_RANK="1", PMI_SIZE="2")
# What torchrun --nproc_per_node 2 sets in its second worker (torch 2.13), beside WORLD_SIZE.
TORCHRUN = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "GROUP_RANK": "0",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "none"}


# --- host lists and counts -------------------------------------------------------------

@pytest.mark.parametrize("text, names", [
    ("vm", ["vm"]),
    ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
    ("a[8-10]-ib,b", ["a8-ib", "a9-ib", "a10-ib", "b"]),
    ("c[1,3]", ["c1", "c3"]),
])
def test_host_lists_expand_as_slurm_writes_them(text, names):
    assert expand_hostlist(text) == names


@pytest.mark.parametrize("text", ["", "a,,b", "a[1-x]", "a[1-2", "a]"])
def test_a_host_list_that_is_none_is_refused_quoting_it(text):
    with pytest.raises(ValueError, match="host list"):
        expand_hostlist(text)


def test_task_counts_expand_repeats():
    assert expand_counts("2(x3),1") == [2, 2, 2, 1] and expand_counts("4") == [4]
    with pytest.raises(ValueError, match=r"expected 'N' or 'N\(xK\)', got '2x3'"):
        expand_counts("2x3")


def test_the_allocation_gives_hosts_and_tasks_and_nothing_outside_one():
    assert allocation_hosts(BATCH) == (Host("vm", 2),) and allocation_tasks(BATCH) == 2
    two = dict(BATCH, SLURM_JOB_NODELIST="n[1-2]", SLURM_TASKS_PER_NODE="2(x2)", SLURM_NTASKS="4")
    assert allocation_hosts(two) == (Host("n1", 2), Host("n2", 2)) and allocation_tasks(two) == 4
    no_tasks = {"SLURM_JOB_ID": "3", "SLURM_JOB_NODELIST": "vm", "SLURM_JOB_CPUS_PER_NODE": "2"}
    assert allocation_hosts(no_tasks) == (Host("vm", 2),) and allocation_tasks(no_tasks) is None
    assert allocation_hosts({}) is None and allocation_tasks({}) is None
    with pytest.raises(ValueError, match="names 2 node"):
        allocation_hosts(dict(two, SLURM_TASKS_PER_NODE="2"))


def test_only_a_task_of_a_step_has_a_step_task_count():
    assert step_tasks(BATCH) is None  # a batch script: SLURM_NTASKS=2, but one process
    assert step_tasks(STEP) == 2 and step_tasks(STEP_OF_ONE) == 1 and step_tasks({}) is None
    # srun --preserve-env passes the allocation's SLURM_NTASKS on; the step's own count wins.
    assert step_tasks(dict(STEP_OF_ONE, SLURM_NTASKS="2")) == 1
    assert step_tasks({"SLURM_STEPID": "0", "SLURM_NPROCS": "3"}) == 3  # without SLURM_STEP_NUM_TASKS


# --- the launcher check ----------------------------------------------------------------

@pytest.mark.parametrize("env", [{}, BATCH, STEP_OF_ONE, {"PMI_RANK": "1"}, {"WORLD_SIZE": "1"}, {"WORLD_SIZE": "4"},
                                 dict(TORCHRUN, WORLD_SIZE="1", LOCAL_WORLD_SIZE="1"),
                                 {"OMPI_COMM_WORLD_SIZE": "1"}, {"SLURM_NTASKS": "4", "SLURM_JOB_ID": "1"}])
def test_one_process_is_not_a_mismatch(env):
    assert launcher_mismatch(env, 1) is None


@pytest.mark.parametrize("env", [STEP, PMI2_STEP, {"WORLD_SIZE": "2"}, {"OMPI_COMM_WORLD_SIZE": "2"}])
def test_mpi_that_joined_the_ranks_is_believed(env):
    assert launcher_mismatch(env, 2) is None and launcher_mismatch(env, 3) is None


@pytest.mark.parametrize("env, words", [
    (STEP, ["srun started 2 tasks (SLURM_STEP_NUM_TASKS=2) but MPI sees 1 rank in each", "srun --mpi=pmi2",
            "srun --mpi=pmix", "mpirun -np 2"]),
    (PMI2_STEP, ["srun started 2 tasks", "its pmi2 plugin was used, but this MPI did not take it"]),
    ({"OMPI_COMM_WORLD_SIZE": "3"}, ["Open MPI's mpirun started 3 processes (OMPI_COMM_WORLD_SIZE=3)",
                                     "another MPI than the one mpi4py was built with"]),
    ({"PMI_SIZE": "2", "PMI_RANK": "0"}, ["an MPICH (Hydra) mpirun started 2 processes (PMI_SIZE=2)"]),
    ({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}, ["torchrun started 4 processes (WORLD_SIZE=4)", "mpirun -np 4"]),
    ({"LOCAL_WORLD_SIZE": "2"}, ["torchrun started 2 processes (LOCAL_WORLD_SIZE=2)"]),
    (TORCHRUN, ["torchrun started 2 processes (WORLD_SIZE=2)"]),
    ({"WORLD_SIZE": "4", "TORCHELASTIC_RUN_ID": "x"}, ["torchrun started 4 processes (WORLD_SIZE=4)"]),
    ({"WORLD_SIZE": "4", "MASTER_ADDR": "n1"}, ["torchrun started 4 processes (WORLD_SIZE=4)"]),
])
def test_a_launcher_that_started_processes_mpi_did_not_join_is_named_with_the_fix(env, words):
    line = launcher_mismatch(env, 1)
    assert line is not None and "\n" not in line
    for word in words:
        assert word in line, line


def test_the_refusal_is_one_line_and_exit_status_2(capsys):
    refuse_launcher_mismatch(1, env=BATCH)
    with pytest.raises(SystemExit) as exit_:
        refuse_launcher_mismatch(1, env=STEP)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("ringtrain: error: srun started 2 tasks"), err


def test_launch_refuses_several_copies_of_itself_but_runs_in_a_batch_script_or_a_step_of_one():
    check_request(2, ["p"], env=BATCH)
    check_request(2, ["p"], env=STEP_OF_ONE)
    with pytest.raises(UsageError, match=r"^srun started 2 copies of ringtrain launch \(SLURM_STEP_NUM_TASKS=2\)"):
        check_request(2, ["p"], env=STEP)
    with pytest.raises(UsageError, match=r"^srun started 2 copies"):  # with --mpi=pmi2: srun is named, not mpirun
        check_request(2, ["p"], env=PMI2_STEP)
    with pytest.raises(UsageError, match=r"^torchrun started 2 copies of ringtrain launch \(WORLD_SIZE=2\)"):
        check_request(2, ["p"], env=TORCHRUN)
    check_request(2, ["p"], env={"WORLD_SIZE": "2"})  # WORLD_SIZE alone is no torchrun: one launcher, as asked


def test_inside_an_allocation_made_without_n_launch_names_what_it_found_and_the_fix():
    no_tasks = {"SLURM_JOB_ID": "3", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_CPUS_PER_NODE": "4(x2)"}
    with pytest.raises(UsageError) as refused:
        slurm_request(None, None, None, no_tasks)
    line = str(refused.value)
    assert "outside a Slurm allocation" not in line and "\n" not in line
    for words in ("SLURM_JOB_ID=3", "SLURM_JOB_NODELIST=n[1-2]", "SLURM_JOB_CPUS_PER_NODE=4(x2)",
                  "SLURM_NTASKS is unset", "give -np N", "8 slot(s) on 2 host(s)", "-n N"):
        assert words in line, line
    assert slurm_request(3, None, None, no_tasks) == (3, (Host("n1", 4), Host("n2", 4)))


def test_launch_takes_the_allocations_hosts_and_rank_count_unless_told():
    assert slurm_request(None, None, None, BATCH) == (2, (Host("vm", 2),))
    assert slurm_request(1, None, None, BATCH) == (1, (Host("vm", 2),))
    assert slurm_request(4, "hosts", None, BATCH) == (4, None)
    assert slurm_request(4, None, "a:2", BATCH) == (4, None)
    assert slurm_request(3, None, None, {}) == (3, None)
    with pytest.raises(UsageError, match=r"^-np N is required outside a Slurm allocation"):
        slurm_request(None, None, None, {})
    with pytest.raises(UsageError, match="cannot read the Slurm allocation's hosts: .*; give --hostfile or -H"):
        slurm_request(None, None, None, dict(BATCH, SLURM_JOB_NODELIST="a[1-"))


# --- the time limit ----------------------------------------------------------------------

@pytest.mark.parametrize("text, seconds", [("5:00", 300), ("0:59", 59), ("1:02:03", 3723), ("2-01:00:00", 176400),
                                           ("UNLIMITED", None), ("NOT_SET", None), ("17\n", 17)])
def test_squeue_time_left_is_read_in_each_of_its_forms(text, seconds):
    assert parse_time_left(text) == seconds


def test_squeue_time_left_that_is_not_one_is_refused():
    with pytest.raises(ValueError, match="expected"):
        parse_time_left("5 minutes")


def test_time_left_comes_from_the_end_time_variable_then_squeue():
    assert time_left({"SLURM_JOB_END_TIME": "1000", "SLURM_JOB_ID": "7"}, now=400) == (600, "SLURM_JOB_END_TIME")
    assert time_left({}, now=0) == (None, "not in a Slurm job")
    asked = []

    def squeue(args, **kw):
        asked.append(args)
        return subprocess.CompletedProcess(args, 0, "4:10\n", "")

    assert time_left({"SLURM_JOB_ID": "7"}, now=0, run=squeue) == (250, "squeue")
    assert asked == [["squeue", "-h", "-j", "7", "-o", "%L"]]

    def broken(args, **kw):
        raise subprocess.TimeoutExpired(args, 10)

    seconds, why = time_left({"SLURM_JOB_ID": "7"}, now=0, run=broken)
    assert seconds is None and why.startswith("squeue did not answer")


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_the_margin_is_twice_what_a_stop_costs_plus_the_slack():
    assert stop_margin(1.0, 2.0, 3.0) == EXIT_SLACK + 12.0
    assert stop_margin(0, 0, 0, slack=5) == 5


def test_the_deadline_stops_once_the_time_left_is_within_the_margin_of_measured_times():
    clock = Clock()
    deadline = Deadline(100.0, checkpoint_bytes=0, eval_steps=3, clock=clock)
    clock.now = 50.0  # the first step carries start-up costs: not timed
    assert not deadline.reached()
    clock.now = 52.0  # a 2 s step: the margin is slack + 2 x (2 + 3 x 2 (evaluation, assumed) + 0)
    assert not deadline.reached() and deadline.margin() == EXIT_SLACK + 16
    with deadline.timed("checkpoint"):
        clock.now = 57.0  # a 5 s checkpoint, measured: it replaces the assumption
    assert deadline.margin() == EXIT_SLACK + 2 * (2 + 6 + 5)
    clock.now = 58.0  # a 1 s step: 42 s left, more than the margin
    assert not deadline.reached() and 100 - clock.now > deadline.margin()
    clock.now = 61.0  # a 3 s step: the margin grows to slack + 2 x (3 + 9 + 5) = 49 s, and 39 s are left
    assert deadline.reached() and deadline.margin() == EXIT_SLACK + 34


def test_launch_does_not_restart_a_run_that_stopped_before_the_time_limit():
    assert should_restart(75, 0, 3) is False  # no time left in the job: its requeue goes on, not a restart
    assert should_restart(138, 0, 3) is False  # SIGUSR1 reached the ranks: checkpoint and stop, not a failure
    assert should_restart(137, 0, 3) is True


def test_no_limit_never_stops_and_the_checkpoint_is_assumed_slow_until_timed():
    clock = Clock()
    never = Deadline(None, clock=clock)
    clock.now = 1e9
    assert not never.reached() and not never.reached()
    assumed = Deadline(1000.0, checkpoint_bytes=500e6, clock=clock)
    assert assumed.margin() == stop_margin(0, 0, 10.0)  # 500 MB at the assumed 50 MB/s


@pytest.mark.parametrize("text, message", [
    ("n[1-99999999999]", "names more than 100,000 nodes"),
    ("n[1-60000],m[1-60000]", "names more than 100,000 nodes"),
    ("n[²]", "expected numbers"),
    ("n[1-" + "9" * 400 + "]", "expected numbers"),
])
def test_a_host_list_is_expanded_within_a_bound_or_refused(text, message):
    with pytest.raises(ValueError, match=message):
        expand_hostlist(text)
    assert len(expand_hostlist("n[1-100000]")) == 100_000


@pytest.mark.parametrize("text", ["1(x99999999999)", "2(x60000),1(x60000)", "²", "1(x" + "9" * 400 + ")"])
def test_task_counts_are_expanded_within_a_bound_or_refused(text):
    with pytest.raises(ValueError):
        expand_counts(text)


@pytest.mark.parametrize("text", ["²:00", "1-²:00:00", "1" * 400 + ":00"])
def test_squeue_time_left_that_is_no_plain_count_is_a_value_error_not_a_crash(text):
    from ringtrain.cluster.slurm import parse_time_left
    with pytest.raises(ValueError, match="expected"):
        parse_time_left(text)


@pytest.mark.parametrize("text, message", [("n[3-1]", "runs backwards"), ("n[1,5-2]", "runs backwards")])
def test_a_backward_range_is_refused_not_read_as_no_node(text, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        expand_hostlist(text)


@pytest.mark.parametrize("text", ["0(x2)", "1(x0),1(x2)", "0"])
def test_task_counts_of_no_tasks_or_no_nodes_are_refused_saying_so(text):
    # The mismatch line it gave ("names 2 node(s) ... gives 2 count(s)") described no mismatch at all.
    with pytest.raises(ValueError, match="gives a node no tasks, or repeats it no times"):
        expand_counts(text)

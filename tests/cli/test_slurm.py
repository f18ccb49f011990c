"""The Slurm page's commands, run as written on a real one-node Slurm (tests/slurm.py).

* ``srun --mpi=pmi2`` starts one job of 2 ranks; ``srun --mpi=none`` starts
  two processes MPI does not join, and each says so in one line, exit 2,
  with nothing written.
* ``salloc`` + ``mpirun``, and ``ringtrain launch`` taking its hosts and
  rank count from the allocation.
* The job script (scripts/slurm_train.sbatch) preempted twice by SIGUSR1
  (``scancel -s USR1``, what ``--signal`` and a preemption send) requeues
  itself, resumes, and ends with parameters bitwise equal to the straight
  ``srun`` run's; it also read the job's time limit from ``squeue``.
* Last, on a second Slurm whose two nodes are the suite's network-namespace
  hosts (tests/netns.py), ``srun -N 2`` trains one job across both, its
  traffic crossing the virtual network.

Every command is a string that the documentation shows verbatim
(test_the_docs_show_the_commands_these_tests_run); each runs from a fresh
directory, under a time bound. Skipped, saying why, where no Slurm can be
started (not root, packages missing).
"""

import glob
import json
import os
import re
import shutil
import time

import numpy as np
import pytest

from mpirun import ROOT, run, show
from ringtrain.io.checkpoint import list_checkpoints, read_checkpoint

JOB_SCRIPT = os.path.join("scripts", "slurm_train.sbatch")
SRUN = "srun --mpi=pmi2 -n 2 ringtrain train --dataset mnist5k --run-dir runs/straight"
SRUN_WITHOUT_PLUGIN = "srun --mpi=none -n 2 ringtrain train --dataset mnist5k --run-dir runs/two-jobs"
SALLOC_MPIRUN = "salloc -n 2 mpirun -np 2 ringtrain info"
SALLOC_LAUNCH = "salloc -n 2 ringtrain launch -- ringtrain info"
SBATCH = f"sbatch {JOB_SCRIPT}"
SIGNAL = "scancel -s USR1 $JOBID"
SRUN_TWO_NODES = "srun --mpi=pmi2 -N 2 -n 2 ringtrain train --dataset digits --epochs 2 --run-dir runs/two-nodes"
INFO_TWO_NODES = "srun --mpi=pmi2 -N 2 -n 2 ringtrain info"
COMMANDS = (SRUN, SRUN_WITHOUT_PLUGIN, SALLOC_MPIRUN, SALLOC_LAUNCH, SBATCH, SIGNAL, SRUN_TWO_NODES, INFO_TWO_NODES)


def shell(slurm, command, cwd, timeout=180):
    """``command`` through bash where Slurm's commands reach the controller (its first node), in ``cwd``."""
    return run(slurm.command(["bash", "-c", command]), timeout=timeout, env=slurm.env, cwd=str(cwd))


def final_checkpoint(run_dir):
    arrays, meta = read_checkpoint(list_checkpoints(os.path.join(run_dir, "checkpoints"))[0])
    return {k: v for k, v in arrays.items() if k.startswith("params/")}, meta


def test_the_docs_show_the_commands_these_tests_run():
    pages = glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True) + [os.path.join(ROOT, "README.md")]
    text = "".join(open(page, encoding="utf-8").read() for page in pages)
    for command in COMMANDS:
        assert command in text, f"no page shows {command!r}"
    with open(os.path.join(ROOT, JOB_SCRIPT), encoding="utf-8") as f:
        script = f.read()
    assert script in text, f"no page shows {JOB_SCRIPT} as it is"
    # mnist5k is not in the quick start's install: the script and the page say what to install, and the page
    # activates the environment that sbatch passes on before it submits.
    assert "--dataset mnist5k" not in script or "pip install -e '.[mpich,train,mnist]'" in script
    assert f". .venv/bin/activate\n{SBATCH}\n" in text, "the docs must activate the environment before sbatch"


@pytest.fixture(scope="module")
def straight(slurm_session, tmp_path_factory):
    """The documented srun command, trained to its end: the reference for the preempted job."""
    where = tmp_path_factory.mktemp("srun")
    result = shell(slurm_session.one_node(), SRUN, where)
    return where, result


def test_srun_with_the_pmi2_plugin_trains_one_job_of_two_ranks(straight):
    where, result = straight
    assert result.returncode == 0, show(result)
    assert result.stdout.count("ringtrain: 2 rank(s)") == 1, show(result)
    _, meta = final_checkpoint(where / "runs" / "straight")
    assert meta["world_size"] == 2 and meta["final"] and meta["epoch"] == 30, meta


def test_srun_without_a_plugin_is_refused_by_every_task_in_one_line(slurm, tmp_path):
    result = shell(slurm, SRUN_WITHOUT_PLUGIN, tmp_path)
    assert result.returncode == 2, show(result)
    ours = [line for line in result.stderr.splitlines() if line.startswith("ringtrain")]
    assert len(ours) == 2 and ours[0] == ours[1], show(result)  # one line from each task, the same
    assert ours[0].startswith("ringtrain: error: srun started 2 tasks (SLURM_STEP_NUM_TASKS=2) but MPI sees 1 rank "
                              "in each"), show(result)
    assert "srun --mpi=pmi2" in ours[0] and "mpirun -np 2" in ours[0], show(result)
    assert "Traceback" not in result.stderr + result.stdout and result.stdout == "", show(result)
    assert not (tmp_path / "runs").exists()


def test_salloc_and_mpirun_make_one_job_of_two_ranks(slurm, tmp_path):
    result = shell(slurm, SALLOC_MPIRUN, tmp_path)
    assert result.returncode == 0, show(result)
    assert result.stdout.count("ringtrain: 2 rank(s) on 1 node(s)") == 1, show(result)


def test_launch_in_an_allocation_takes_its_hosts_and_rank_count_from_slurm(slurm, tmp_path):
    result = shell(slurm, SALLOC_LAUNCH, tmp_path)
    assert result.returncode == 0, show(result)
    assert re.search(rf"ringtrain launch: 2 rank\(s\) on Slurm job \d+'s hosts: {slurm.node}:2", result.stderr), \
        show(result)
    assert f"-hosts {slurm.node}:2 -np 2" in result.stderr, show(result)
    assert result.stdout.count("ringtrain: 2 rank(s) on 1 node(s)") == 1, show(result)


def _legs_started(run_dir):
    """How many runs of the job have begun training (a start or resumed event each)."""
    try:
        with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
            return sum(json.loads(line)["event"] in ("start", "resumed") for line in f if line.strip())
    except (OSError, ValueError):
        return 0


def _wait(what, predicate, timeout=120):
    until = time.monotonic() + timeout
    while time.monotonic() < until:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"{what}: not within {timeout} s")


def test_the_job_script_preempted_twice_requeues_and_ends_bitwise_equal_to_the_straight_run(slurm, straight,
                                                                                           tmp_path):
    os.makedirs(tmp_path / "scripts")
    shutil.copy(os.path.join(ROOT, JOB_SCRIPT), tmp_path / JOB_SCRIPT)
    submitted = shell(slurm, SBATCH, tmp_path, timeout=60)
    assert submitted.returncode == 0, show(submitted)
    job = re.search(r"Submitted batch job (\d+)", submitted.stdout).group(1)
    run_dir = tmp_path / "runs" / "slurm"
    for leg in (1, 2):  # signal each of the first two runs as soon as it trains; each requeues itself
        _wait(f"run {leg} of job {job} to start training", lambda leg=leg: _legs_started(run_dir) >= leg)
        signalled = shell(slurm, SIGNAL.replace("$JOBID", job), tmp_path, timeout=60)
        assert signalled.returncode == 0, show(signalled)
        _wait(f"job {job} to requeue after run {leg}", lambda leg=leg: int(slurm.job(job).get("Restarts", 0)) >= leg)
    state = _wait(f"job {job} to end", lambda: slurm.job(job).get("JobState") in ("COMPLETED", "FAILED",
                                                                                   "CANCELLED", "TIMEOUT"),
                  timeout=240)
    with open(tmp_path / f"slurm-{job}.out", encoding="utf-8") as f:
        output = f.read()
    fields = slurm.job(job)
    assert state and fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", (fields, output)
    stops = re.findall(r"ringtrain: stopped at step (\d+) \(SIGUSR1\); checkpoint", output)
    assert len(stops) == 2 and int(stops[0]) < int(stops[1]), output
    assert output.count("resumed from") == 2, output
    # The job's time limit, read from squeue by the last run: its start plus --time=60.
    said = re.findall(r"the Slurm job's time limit is at (\S+) \(squeue\)", output)
    expected = _epoch(fields["StartTime"]) + 60 * 60
    assert said and abs(_epoch(said[-1]) - expected) <= 3, (said, fields["StartTime"])
    got, meta = final_checkpoint(run_dir)
    want, want_meta = final_checkpoint(straight[0] / "runs" / "straight")
    assert meta["step"] == want_meta["step"] and meta["epoch"] == 30, meta
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def _epoch(stamp):
    """Seconds since the epoch of Slurm's local-time stamp ``2026-11-26T17:21:44``."""
    return time.mktime(time.strptime(stamp, "%Y-%m-%dT%H:%M:%S"))



def test_srun_spans_two_nodes_on_the_namespace_hosts(slurm_two_nodes, tmp_path):
    cluster = slurm_two_nodes.cluster
    info = shell(slurm_two_nodes, INFO_TWO_NODES, tmp_path)
    assert info.returncode == 0, show(info)
    assert "ringtrain: 2 rank(s) on 2 node(s)" in info.stdout, show(info)
    assert re.search(r"^0\s+h1\s+0/1\s+0/2", info.stdout, re.M) and re.search(r"^1\s+h2\s+0/1\s+1/2", info.stdout,
                                                                            re.M), show(info)
    received, sent = cluster.iface_bytes("h2")
    result = shell(slurm_two_nodes, SRUN_TWO_NODES, tmp_path)
    assert result.returncode == 0 and result.stdout.count("ringtrain: 2 rank(s)") == 1, show(result)
    _, meta = final_checkpoint(tmp_path / "runs" / "two-nodes")
    assert meta["world_size"] == 2 and meta["epoch"] == 2, meta
    # The gradients crossed h2's veth: far more than Slurm's own messages.
    now_received, now_sent = cluster.iface_bytes("h2")
    assert now_received - received > 1_000_000 and now_sent - sent > 1_000_000, (received, now_received)

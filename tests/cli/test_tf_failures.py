"""The TensorFlow face's failure model in real jobs: ranks that disagree (MPMD), and a rank that raises.

Each job runs under a time bound; assertions come after it ends. Skipped
without tensorflow.
"""

import os
import re
import sys

import pytest

import mpirun
from mpirun import ROOT, run, show
from ringtrain.cluster.launch import find_mpirun

pytest.importorskip("tensorflow", reason="tensorflow is not installed (pip install tensorflow-cpu==2.21.0)")

PROGRAM = os.path.join(ROOT, "tests", "cli", "programs", "tf_roles.py")


def mpmd(first, second):
    return [find_mpirun(), "-np", "1", sys.executable, PROGRAM, *first, ":", "-np", "1", sys.executable, PROGRAM,
            *second]


def test_ranks_that_disagree_on_a_shape_all_raise_eagerly_and_in_a_tf_function():
    result = run(mpmd(["shape", "3"], ["shape", "4"]), timeout=240, env=mpirun.test_env())
    assert result.returncode == 0, show(result)
    # (Two ranks' lines may reach mpirun's output joined, without the newline between them.)
    verdicts = re.findall(r"agreed|mismatch: (?:(?!agreed|mismatch: )[^\n])*?shape", result.stdout)
    assert len(verdicts) == 4 and all(v.startswith("mismatch") for v in verdicts), show(result)


def test_an_exception_on_one_rank_ends_the_job_naming_the_rank():
    result = run(mpmd(["raise"], ["wait"]), timeout=240, env=mpirun.test_env())
    assert result.returncode != 0, show(result)
    assert "rank 0: RuntimeError: this rank gave up" in result.stderr, show(result)
    assert "wait returned" not in result.stdout, show(result)


def test_an_exception_inside_a_tf_function_is_named_in_one_line_on_both_ranks():
    # TensorFlow's message spans many lines and starts with "Graph execution error:"; the line each
    # rank prints, and the reason the peer's op fails with, keep the cause.
    result = run(mpmd(["graph_raise"], ["graph_second"]), timeout=240, env=mpirun.test_env())
    assert result.returncode != 0, show(result)
    cause = "RuntimeError: this rank gave up in a graph"
    assert f"rank 0: UnknownError: Graph execution error: ... {cause}" in result.stderr, show(result)
    assert re.search(rf"allreduce 'second': rank 0 raised UnknownError: Graph execution error: \.\.\. {cause}",
                     result.stderr), show(result)
    assert "graph returned" not in result.stdout, show(result)


@pytest.mark.parametrize("size", [2, 3])
def test_tf1_graphs_after_a_refused_op_run_on_every_rank(size):
    # A rank's refusal stays in flight until every member has heard it: the next graph's collectives,
    # and each fetch of them, must not reuse its name (they once hung, one rank never submitting).
    result = run([find_mpirun(), "-np", str(size), sys.executable, PROGRAM, "graphs"], timeout=240,
                 env=mpirun.test_env())
    assert result.returncode == 0, show(result)
    assert result.stdout.count("graphs ok") == size, show(result)


def test_a_tf1_graph_op_a_peer_never_submits_ends_the_job_within_the_bound():
    env = mpirun.test_env()
    env["RINGTRAIN_TIMEOUT"] = "5"
    result = run(mpmd(["graph_wait"], ["idle"]), timeout=240, env=env)
    assert result.returncode != 0, show(result)
    assert "never.matched" in result.stderr and "wait returned" not in result.stdout, show(result)


@pytest.mark.parametrize("message", ["allreduce 'x': ranks submitted different shape: (3,) and (4,)",
                                     "a NUL \0 inside, and a name é", "long " + "x" * 6000,
                                     "allreduce 'a/../../../../etc/hostname': rank 1 refused it"])
def test_a_graph_collectives_failure_is_horovods_error_and_reads_as_its_message_alone(message):
    # One process: the path a failed collective's graph reads (mpi_ops.failure_path) must fail with
    # FAILED_PRECONDITION whatever the message holds, and describe() must give the message back.
    import tensorflow as tf

    from ringtrain.failure import describe
    from ringtrain.tensorflow.mpi_ops import failure_path

    read = tf.function(lambda path: tf.io.read_file(path))
    with pytest.raises(tf.errors.FailedPreconditionError) as failed:
        read(tf.constant(failure_path(message)))
    line = describe(failed.value)
    kept = message.replace("\0", " ")[:2000]  # (slashes too: the read must not leave /dev/null)
    assert line.startswith("FailedPreconditionError: ") and kept in line, line[:300]
    assert "/dev/null" not in line and "Not a directory" not in line, line[:300]

"""A real multi-host job: two hosts made as network namespaces, launched from a hostfile.

See tests/netns.py for how the hosts are made. Skipped, with the reason,
where namespaces cannot be made (not root, no iproute2).
"""

import json
import os
import sys

import numpy as np
import pytest

from mpirun import ROOT, mpirun, ringtrain, show
from ringtrain import load_checkpoint
from netns import cluster  # noqa: F401  (the module-scope fixture)

PROGRAM = os.path.join(ROOT, "tests", "cli", "programs", "allreduce_across_hosts.py")


def test_info_reports_two_nodes_with_their_host_names(cluster, tmp_path):  # noqa: F811
    # A hostfile in Open MPI syntax, comments included: the launcher rewrites
    # it for MPICH's Hydra.
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# two hosts on the test bridge\nh1 slots=2\n\nh2 slots=2 max_slots=2  # second\n")
    launcher = [sys.executable, "-m", "ringtrain", "launch", "-np", "4", "--hostfile", str(hostfile), "--"]
    result = cluster.run(4, ringtrain("info", "--json"), timeout=90, launcher=launcher)
    assert result.returncode == 0, show(result)
    info = json.loads(result.stdout)
    assert info["size"] == 4 and info["num_nodes"] == 2, show(result)
    assert [r["hostname"] for r in info["ranks"]] == ["h1", "h1", "h2", "h2"]
    assert [r["node_rank"] for r in info["ranks"]] == [0, 0, 1, 1]
    assert [r["local_rank"] for r in info["ranks"]] == [0, 1, 0, 1]
    assert "-f " in result.stderr and "ringtrain launch: " in result.stderr, show(result)


def allreduce_across_hosts(cluster, n, algorithm="ring"):
    """Run the allreduce program on 2 hosts x 2 ranks; check it against MPI.

    Returns the program's report and the bytes each host received over its veth link.
    """
    before = {h: cluster.iface_bytes(h) for h in cluster.names}
    result = cluster.run(4, [sys.executable, PROGRAM, str(n), algorithm], timeout=90)
    after = {h: cluster.iface_bytes(h) for h in cluster.names}
    assert result.returncode == 0, show(result)
    report = json.loads(result.stdout)
    assert [r["host"] for r in report["ranks"]] == ["h1", "h1", "h2", "h2"]
    for r in report["ranks"]:
        assert r["error"] <= 1e-12 * max(1.0, report["scale"]), r
    return report, {h: after[h][0] - before[h][0] for h in cluster.names}


def test_ring_allreduce_across_hosts_matches_mpi_and_crosses_the_network(cluster):  # noqa: F811
    n = 1 << 18  # 2 MiB of float64 per rank
    _, received = allreduce_across_hosts(cluster, n)
    # Each host must have received at least one rank's share of the data over
    # its veth link: the job did not go through shared memory.
    for host, count in received.items():
        assert count > n * 8, f"{host} received only {count} bytes over the virtual network"


def test_per_rank_logs_come_from_each_host(cluster, tmp_path):  # noqa: F811
    logs = tmp_path / "logs"
    command = ["sh", "-c", 'echo "rank $PMI_RANK on $(hostname)"; exit 0']
    launcher = [sys.executable, "-m", "ringtrain", "launch", "-np", "4", "-H", "h1:2,h2:2", "-o", str(logs), "--"]
    result = cluster.run(4, command, timeout=90, launcher=launcher)
    assert result.returncode == 0, show(result)
    texts = [(logs / f"rank-{r}.log").read_text() for r in range(4)]
    assert texts == [f"rank {r} on {'h1' if r < 2 else 'h2'}\n" for r in range(4)]


def test_exit_status_of_a_remote_rank_reaches_the_launcher(cluster):  # noqa: F811
    command = ["sh", "-c", 'if [ "$(hostname)" = h2 ]; then exit 3; fi']
    result = cluster.run(4, command, timeout=90)
    assert result.returncode == 3, show(result)


def test_hierarchical_allreduce_across_hosts_matches_mpi_and_only_chunk_owners_cross(cluster):  # noqa: F811
    n = 1 << 18  # 2 MiB of float64 per rank
    report, received = allreduce_across_hosts(cluster, n, "hierarchical")
    assert len({r["digest"] for r in report["ranks"]}) == 1, "ranks hold different results"
    # Two ranks on each host: both phases, and local rank l of h1 talks across
    # only to local rank l of h2, the other owner of window chunk l.
    assert [(r["two_phase"], r["across"]) for r in report["ranks"]] == [(True, [0, 2]), (True, [1, 3]),
                                                                         (True, [0, 2]), (True, [1, 3])]
    # Each host receives the vector once (each owner half of its chunk in the
    # reduce-scatter, half in the allgather), plus MPI's own Allreduce of the
    # reference, where the flat ring's 4-rank loop would bring in 1.5
    # vectors on top of that.
    for host, count in received.items():
        assert n * 8 < count < (2 + 0.3) * n * 8, f"{host} received {count} bytes"


# "auto": across hosts this small model's sharded step runs on MPI's own
# Reduce_scatter/Allgatherv; on one host, on shared memory.
@pytest.mark.parametrize("algorithm", ["ring", "hierarchical", "auto"])
def test_training_across_hosts_ends_like_the_same_run_on_one_host(cluster, tmp_path, algorithm):  # noqa: F811
    # The run directories are on the filesystem every namespace shares; only rank 0 writes.
    args = ["train", "--dataset", "digits", "--epochs", "2", "--hidden", "32", "--seed", "5",
            "--allreduce", algorithm]
    across = cluster.run(4, ringtrain(*args, "--run-dir", str(tmp_path / "across")), timeout=180)
    assert across.returncode == 0, show(across)
    here = mpirun(4, ringtrain(*args, "--run-dir", str(tmp_path / "here")), timeout=180)
    assert here.returncode == 0, show(here)
    got, got_meta = load_checkpoint(str(tmp_path / "across"))
    want, want_meta = load_checkpoint(str(tmp_path / "here"))
    assert got_meta["step"] == want_meta["step"] > 0 and got_meta["world_size"] == 4
    assert sorted(got) == sorted(want)
    # hierarchical: two ranks on each host, so both phases, and the sharded step runs on them.
    transport = {"ring": ("ring", "ring"), "hierarchical": ("hierarchical", "hierarchical"),
                 "auto": ("mpi", "shm")}[algorithm]
    for result, kind in zip((across, here), transport):
        line = f"sharded optimizer step (reduce-scatter, update, allgather) over {kind}"
        assert line in result.stdout, show(result)
    if algorithm == "ring":
        # The ring's order of additions does not depend on where ranks run: bitwise equal.
        assert all(got[k].tobytes() == want[k].tobytes() for k in want), "parameters differ"
    else:
        # Another order of additions across hosts than on one host: equal to rounding.
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-4, atol=1e-5, err_msg=k)

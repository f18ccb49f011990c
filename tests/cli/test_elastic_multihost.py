"""An elastic launch across two hosts made as network namespaces: a host leaves and comes back.

See tests/netns.py for how the hosts are made (skipped, with the reason,
where they cannot be). The discovery script prints the lines of a file the
training program itself rewrites at known steps, so the test does not depend
on timing.
"""

import importlib.util
import sys

import pytest

from mpirun import ringtrain, show
from netns import cluster  # noqa: F401  (the module-scope fixture)
from test_elastic_launch import PROGRAM, check_last_commit, check_trained, read_report


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed (pip install "
                    "torch==2.13.0): the program trains through hvd.elastic")
def test_a_host_removed_and_added_back_by_discovery_ends_with_the_training_done(cluster, tmp_path):  # noqa: F811
    hosts, report, commits = tmp_path / "hosts", tmp_path / "report.json", tmp_path / "commits"
    hosts.write_text("h1:1\nh2:1\n")
    program = [sys.executable, PROGRAM, str(report), "--samples", "48", "--epochs", "2", "--sleep", "0.05",
               "--hosts", str(hosts), "--set", "0:5:h1:1", "--set", "1:5:h1:1;h2:1"]
    launcher = ringtrain("launch", "-np", "2", "--min-np", "1", "--host-discovery-script", f"cat {hosts}", "--")
    result = cluster.run(2, program, timeout=240, launcher=launcher, RINGTRAIN_ELASTIC_DIR=str(commits))
    assert result.returncode == 0, show(result)
    got = read_report(report)
    # Two hosts, then h1 alone once h2 left the discovery's list, then both again.
    assert got["hosts"] == [["h1", "h2"], ["h1"], ["h1", "h2"]], show(result)
    assert got["sizes"] == [2, 1, 2] and got["resets"] == [2], got
    lines = result.stderr.splitlines()
    assert "ringtrain launch: restarting 1 rank(s) on h1:1: " in "\n".join(lines), show(result)
    assert "ringtrain launch: restarting 2 rank(s) on h1:1,h2:1: " in "\n".join(lines), show(result)
    check_trained(got, 48, 2)
    check_last_commit(commits, got)

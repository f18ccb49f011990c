"""Where rank 0's lines go (ringtrain.io.console), without MPI."""

import os
import subprocess
import sys

from ringtrain.io import console


def test_only_a_pipe_or_socket_counts_as_mpis_forwarding(tmp_path):
    read, write = os.pipe()
    with os.fdopen(write, "w") as pipe, open(tmp_path / "rank-0.log", "w") as log:
        assert console._forwarded(pipe)
        assert not console._forwarded(log)  # launch -o's rank log stays where it is
    os.close(read)


def test_without_a_launcher_above_it_stdout_is_kept():
    code = "from ringtrain.io.console import launcher_stdout; print(launcher_stdout())"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert result.stdout.strip() == "None", result.stderr


def test_a_launcher_is_found_by_name_among_the_ancestors(monkeypatch):
    tree = {10: (5, "python3"), 5: (3, "hydra_pmi_proxy"), 3: (1, "mpiexec.hydra")}
    monkeypatch.setattr(os, "getppid", lambda: 10)
    monkeypatch.setattr(console, "_parent_and_name", tree.get)
    assert console._launcher_pid() == 3
    del tree[3]
    assert console._launcher_pid() is None

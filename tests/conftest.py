import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def pytest_ignore_collect(collection_path, config):
    # tests/mpi holds tests that run inside mpirun (pytest --with-mpi); the
    # plain run reaches them through tests/test_mpi_suite.py, at every size.
    if collection_path.name == "mpi" and collection_path.parent.name == "tests":
        return not config.getoption("with_mpi", default=False)
    return None


@pytest.fixture(scope="session")
def slurm():
    """A one-node Slurm (tests/slurm.py), started once per session; skips, saying why, where it cannot run."""
    from slurm import Slurm, why_unavailable

    reason = why_unavailable()
    if reason is not None:
        pytest.skip(f"no one-node Slurm here: {reason}")
    with Slurm() as cluster:
        yield cluster

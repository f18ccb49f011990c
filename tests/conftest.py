import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def pytest_ignore_collect(collection_path, config):
    # tests/mpi holds tests that run inside mpirun (pytest --with-mpi); the
    # plain run reaches them through tests/test_mpi_suite.py, at every size.
    if collection_path.name == "mpi" and collection_path.parent.name == "tests":
        return not config.getoption("with_mpi", default=False)
    return None

import os
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def pytest_ignore_collect(collection_path, config):
    # tests/mpi holds tests that run inside mpirun (pytest --with-mpi); the
    # plain run reaches them through tests/test_mpi_suite.py, at every size.
    if collection_path.name == "mpi" and collection_path.parent.name == "tests":
        return not config.getoption("with_mpi", default=False)
    return None


EVERY_FILE_COLLECTS = "RINGTRAIN_TESTS_EVERY_FILE_COLLECTS"  # set by tests/test_mpi_suite.py for its jobs


def pytest_collection_finish(session):
    """Under tests/test_mpi_suite.py, exit 5 if a file it named collected nothing (it was skipped at import).

    pytest exits 5 only when a whole run collects nothing, and the suite runs
    several files in one pytest: one of them skipped whole would otherwise
    pass unseen beside the others.
    """
    if os.environ.get(EVERY_FILE_COLLECTS) != "1":
        return
    here = session.config.invocation_params.dir
    named = {(here / arg.split("::")[0]).resolve() for arg in session.config.args}
    empty = sorted(str(path) for path in named - {item.path.resolve() for item in session.items})
    if empty:
        pytest.exit(f"no tests collected from {', '.join(empty)} (skipped at import?)", returncode=5)


@pytest.fixture(scope="session", autouse=True)
def no_shared_memory_left():
    """Remove the MPICH segments the session's jobs left in /dev/shm, at its end.

    ``mpirun.run`` sweeps after each job that fails, but jobs started
    otherwise (the launch and elastic tests' own processes, jobs a launcher
    restarted) leave theirs. MPICH names a singleton's segment by its pid,
    so one that root's run leaves makes another user's ``MPI_Init`` fail
    (``MPIDI_POSIX_comm_bootstrap: Out of memory``) when that pid comes
    round again. Only this user's segments made since the session began,
    and that no live process maps, are removed.
    """
    started = time.time()
    yield
    from mpirun import _sweep_shared_memory

    _sweep_shared_memory(started)


@pytest.fixture(scope="session")
def slurm_session():
    """The session's one Slurm at a time (tests/slurm.py); skips, saying why, where none can be started."""
    from slurm import SlurmSession, why_unavailable

    reason = why_unavailable()
    if reason is not None:
        pytest.skip(f"no Slurm here: {reason}")
    session = SlurmSession()
    try:
        yield session
    finally:
        session.close()


@pytest.fixture
def slurm(slurm_session):
    """A one-node Slurm on this machine, started once and kept for the tests that follow."""
    return slurm_session.one_node()


@pytest.fixture
def slurm_two_nodes(slurm_session):
    """A Slurm with a slurmd on each of two network-namespace hosts."""
    return slurm_session.two_nodes()

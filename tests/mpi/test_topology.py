"""TaskSpec checked against values computed from MPI directly, at every size."""


import pytest
from mpi4py import MPI

from ringtrain import TaskSpec


@pytest.mark.mpi
def test_taskspec_matches_mpi():
    comm = MPI.COMM_WORLD
    spec = TaskSpec.from_mpi(comm, device_count=0)
    # Reference values straight from MPI, computed independently.
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    expected_local = (local.Get_rank(), local.Get_size())
    local.Free()
    hosts = comm.allgather(MPI.Get_processor_name())
    everyone = comm.allgather(spec)
    # Every assertion after the last collective.
    assert (spec.rank, spec.size) == (comm.Get_rank(), comm.Get_size())
    assert (spec.local_rank, spec.local_size) == expected_local
    assert spec.hosts == tuple(hosts)
    assert spec.hostname == MPI.Get_processor_name()
    assert spec.is_master == (comm.Get_rank() == 0)
    assert spec.device is None
    assert spec.num_nodes == len(set(hosts))
    assert sorted(s.local_rank for s in everyone if s.hostname == spec.hostname) == list(range(spec.local_size))
    assert all(s.hosts == spec.hosts for s in everyone)


@pytest.mark.mpi
def test_device_is_local_rank_modulo_gpu_count():
    comm = MPI.COMM_WORLD
    spec = TaskSpec.from_mpi(comm, device_count=2)
    assert spec.device == spec.local_rank % 2


@pytest.mark.mpi
def test_subcommunicator():
    comm = MPI.COMM_WORLD
    sub = comm.Split(color=comm.Get_rank() % 2, key=comm.Get_rank())
    spec = TaskSpec.from_mpi(sub, device_count=0)
    expected = (sub.Get_rank(), sub.Get_size())
    sub.Free()
    assert (spec.rank, spec.size) == expected

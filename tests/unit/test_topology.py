import pytest

from ringtrain import TaskSpec
from ringtrain.cluster.topology import node_layout


def test_node_layout_numbers_hosts_by_lowest_rank():
    nodes, local = node_layout(["b", "a", "b", "c", "a"])
    assert nodes == [0, 1, 0, 2, 1]
    assert local == [0, 0, 1, 0, 1]


def test_without_mpirun_is_rank_zero_of_one():
    spec = TaskSpec.from_mpi(device_count=0)
    assert (spec.rank, spec.size, spec.local_rank, spec.local_size) == (0, 1, 0, 1)
    assert spec.is_master and spec.num_nodes == 1 and spec.hosts == (spec.hostname,)


def test_taskspec_is_frozen():
    spec = TaskSpec()
    with pytest.raises(AttributeError):
        spec.rank = 3


def test_threads_per_rank_is_a_fair_share_of_cores():
    from ringtrain.cluster.topology import threads_per_rank

    assert [threads_per_rank(8, n) for n in (1, 2, 3, 4, 8, 16)] == [8, 4, 2, 2, 1, 1]


def test_an_explicit_thread_variable_wins():
    assert TaskSpec().thread_cap(environ={"OMP_NUM_THREADS": "3"}) is None

"""ringtrain.torch's process sets do not wait on each other (issue 31), against references computed with MPI.

Run at 1, 2, 3 and 4 ranks by tests/test_mpi_suite.py. Whether a set's ops
finish while a rank outside it is elsewhere is shown by causality, not by a
clock: the outside rank waits in a plain MPI receive (or in another set's
op) for word that the set's members send only once their ops are done. If a
set's op needed that rank, the job would hang, and the suite's time bound
would fail it.
"""

import numpy as np
import pytest
from mpi4py import MPI

torch = pytest.importorskip("torch", reason="torch is not installed (pip install torch==2.13.0)")
hvd = pytest.importorskip("ringtrain.torch")

COMM = MPI.COMM_WORLD
DONE = 41  # the tag of the word a set's members send once their ops are done


@pytest.fixture(autouse=True)
def runtime():
    hvd.init()
    yield
    hvd.barrier()


def _values(seed, shape=(6,)):
    return np.random.default_rng(seed).integers(-3, 4, size=shape).astype(np.float64)


def _set_ops(ps, members):
    """Every kind of op over ``ps``, each checked against MPI's allgather of every member's data."""
    rank = COMM.Get_rank()
    index = members.index(rank)
    mine = _values(rank)
    everyone = np.stack([_values(r) for r in members])
    got = hvd.allreduce(torch.tensor(mine), op=hvd.Sum, name="small", process_set=ps)
    np.testing.assert_array_equal(got.numpy(), everyone.sum(0), err_msg="small allreduce")
    big = np.tile(mine, 5000)  # beyond the size whose data travels with the announcement
    got = hvd.allreduce(torch.tensor(big), op=hvd.Sum, name="big", process_set=ps)
    np.testing.assert_array_equal(got.numpy(), np.tile(everyone.sum(0), 5000), err_msg="large allreduce")
    got = hvd.broadcast(torch.tensor(mine), root_rank=members[-1], name="bcast", process_set=ps)
    np.testing.assert_array_equal(got.numpy(), everyone[-1], err_msg="broadcast")
    rows = torch.tensor(mine).repeat(index + 1).view(index + 1, -1)
    got = hvd.allgather(rows, name="gather", process_set=ps)
    want = np.concatenate([np.tile(everyone[i], (i + 1, 1)) for i in range(len(members))])
    np.testing.assert_array_equal(got.numpy(), want, err_msg="allgather")
    got = hvd.reducescatter(torch.tensor(np.tile(mine, (len(members), 1))), op=hvd.Sum, name="rs", process_set=ps)
    np.testing.assert_array_equal(got.numpy(), everyone.sum(0)[None, :], err_msg="reducescatter")
    hvd.barrier(process_set=ps)


@pytest.mark.mpi(min_size=2)
def test_a_sets_ops_finish_while_a_rank_outside_it_waits_for_them_in_plain_mpi():
    rank, size = COMM.Get_rank(), COMM.Get_size()
    members = list(range(size - 1))
    ps = hvd.add_process_set(members)
    try:
        if rank in members:
            _set_ops(ps, members)
            if rank == 0:
                COMM.send("done", dest=size - 1, tag=DONE)
        else:
            # The outside rank is busy elsewhere until the set is done: here, in MPI itself.
            assert COMM.recv(source=0, tag=DONE) == "done"
    finally:
        hvd.remove_process_set(ps)


@pytest.mark.mpi(min_size=3)
def test_a_set_finishes_while_a_member_of_another_waits_in_that_sets_op():
    # Set A is ranks 0 and 1; set B is every rank but 0. The last rank waits in B's op, which B's
    # other members join only once A has finished: A must finish while that rank waits in B.
    rank, size = COMM.Get_rank(), COMM.Get_size()
    a, b = hvd.add_process_set([0, 1]), hvd.add_process_set(list(range(1, size)))
    try:
        tensor = torch.tensor(_values(rank))
        if rank == size - 1:
            got = hvd.allreduce(tensor, op=hvd.Sum, name="b", process_set=b)
        else:
            if rank in (0, 1):
                got_a = hvd.allreduce(tensor, op=hvd.Sum, name="a", process_set=a)
                np.testing.assert_array_equal(got_a.numpy(), _values(0) + _values(1))
            if rank != 0:
                got = hvd.allreduce(tensor, op=hvd.Sum, name="b", process_set=b)
        if rank != 0:
            np.testing.assert_array_equal(got.numpy(), sum(_values(r) for r in range(1, size)))
    finally:
        hvd.remove_process_set(b)
        hvd.remove_process_set(a)


@pytest.mark.mpi(min_size=3)
def test_overlapping_sets_in_any_order_on_each_rank_never_deadlock():
    # Every pair of ranks is a set. Each rank submits its pairs' ops in an order of its own and waits
    # for them in another: collectives of different sets run on different threads, so no order can
    # leave two ranks each waiting in the other's set.
    rank, size = COMM.Get_rank(), COMM.Get_size()
    pairs = [(i, j) for i in range(size) for j in range(i + 1, size)]
    sets = {pair: hvd.add_process_set(list(pair)) for pair in pairs}
    try:
        rng = np.random.default_rng(rank)
        mine = [p for p in pairs if rank in p]
        handles = {}
        for p in rng.permutation(len(mine)):
            pair = mine[p]
            big = np.tile(_values(rank + 10 * pair[0] + 100 * pair[1]), 3000)  # collectives, ordered by the leader
            handles[pair] = hvd.allreduce_async(torch.tensor(big), op=hvd.Sum, name=f"pair{pair}",
                                                process_set=sets[pair])
        for p in rng.permutation(len(mine)):
            pair = mine[p]
            want = sum(np.tile(_values(r + 10 * pair[0] + 100 * pair[1]), 3000) for r in pair)
            np.testing.assert_array_equal(hvd.synchronize(handles[pair]).numpy(), want, err_msg=str(pair))
    finally:
        for ps in sets.values():
            hvd.remove_process_set(ps)


@pytest.mark.mpi
def test_a_removed_set_refuses_ops_and_a_new_one_gets_a_new_id():
    size = COMM.Get_size()
    ps = hvd.add_process_set(list(range(size)))
    first = ps.process_set_id
    hvd.remove_process_set(ps)
    with pytest.raises(ValueError, match="not registered"):
        hvd.allreduce(torch.ones(2), process_set=ps)
    again = hvd.add_process_set(list(range(size)))
    try:
        assert again.process_set_id > first
        got = hvd.allreduce(torch.ones(2), op=hvd.Sum, process_set=again)
        np.testing.assert_array_equal(got.numpy(), np.full(2, float(size)))
    finally:
        hvd.remove_process_set(again)

"""ringtrain.interop against MPI's own Allreduce (skipped where torch is not installed)."""

import numpy as np
import pytest
from mpi4py import MPI

try:
    import torch

    from ringtrain.torch.interop import average_gradients_, broadcast_parameters_, bucket_view_
except ImportError:  # collected and skipped, so a run of this file alone still lists its tests
    torch = None

pytestmark = pytest.mark.skipif(torch is None, reason="torch is not installed")


def _model_with_grads(comm, flat):
    torch.manual_seed(comm.Get_rank())  # different weights per rank until the broadcast
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    broadcast_parameters_(model)
    if flat:
        bucket_view_(model)
    torch.manual_seed(100 + comm.Get_rank())  # each rank its own batch
    model(torch.randn(4, 7)).square().sum().backward()
    return model


@pytest.mark.mpi
@pytest.mark.parametrize("flat", [False, True])
def test_average_gradients_matches_mpi_allreduce(flat):
    comm = MPI.COMM_WORLD
    model = _model_with_grads(comm, flat)
    mine = [p.grad.numpy().copy() for p in model.parameters()]
    pointers = [p.grad.data_ptr() for p in model.parameters()]
    weights = comm.allgather([p.detach().numpy().copy() for p in model.parameters()])
    expected = [comm.allreduce(g, op=MPI.SUM) / comm.Get_size() for g in mine]
    average_gradients_(model)
    averaged = [p.grad.numpy() for p in model.parameters()]
    everyone = comm.allgather([a.tobytes() for a in averaged])
    assert all(all(np.array_equal(a, b) for a, b in zip(w, weights[0])) for w in weights)
    assert pointers == [p.grad.data_ptr() for p in model.parameters()]  # in place, no new tensors
    for got, want in zip(averaged, expected):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    assert all(e == everyone[0] for e in everyone)


@pytest.mark.mpi
def test_average_gradients_matches_by_parameter_when_ranks_differ():
    # Rank r backpropagates through head r % 2 only, so the heads' gradients exist on some ranks only;
    # "never" takes part nowhere and must keep grad None. Before: lists were zipped by position.
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    torch.manual_seed(0)
    net = torch.nn.ModuleDict({"body": torch.nn.Linear(4, 3), "a": torch.nn.Linear(3, 2), "b": torch.nn.Linear(3, 5),
                               "never": torch.nn.Linear(2, 2)})
    torch.manual_seed(10 + rank)
    net["ab"[rank % 2]](net["body"](torch.randn(6, 4))).square().sum().backward()
    anywhere = {n: comm.allreduce(int(p.grad is not None), op=MPI.MAX) for n, p in net.named_parameters()}
    names = [n for n in anywhere if anywhere[n]]
    mine = {n: (p.grad.numpy().copy() if p.grad is not None else np.zeros(p.shape, np.float32))
            for n, p in net.named_parameters() if n in names}
    expected = {n: comm.allreduce(g, op=MPI.SUM) / comm.Get_size() for n, g in mine.items()}
    average_gradients_(net)
    got = {n: p.grad for n, p in net.named_parameters()}
    assert got["never.weight"] is None and got["never.bias"] is None
    assert all(got[n] is None for n in anywhere if not anywhere[n])
    for n in names:
        np.testing.assert_allclose(got[n].numpy(), expected[n], rtol=1e-6, atol=1e-7)


@pytest.mark.mpi
def test_broadcast_parameters_takes_bool_and_uint8_buffers():
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    net = torch.nn.Linear(3, 2)
    net.register_buffer("mask", torch.tensor([rank % 2 == 0, rank % 2 == 1, True]))
    net.register_buffer("counts", torch.arange(4, dtype=torch.uint8) + rank)
    with torch.no_grad():
        net.weight.fill_(rank)
    broadcast_parameters_(net, root=0)
    root = comm.bcast({k: v.clone() for k, v in net.state_dict().items()} if rank == 0 else None, root=0)
    assert all(torch.equal(v, root[k]) and v.dtype == root[k].dtype for k, v in net.state_dict().items())
    assert torch.equal(net.mask, torch.tensor([True, False, True]))

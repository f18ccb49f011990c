"""ringtrain.interop against MPI's own Allreduce (skipped where torch is not installed)."""

import numpy as np
import pytest
from mpi4py import MPI

from ringtrain.torch.interop import average_gradients_, broadcast_parameters_, bucket_view_

try:
    import torch
except ImportError:  # collected and skipped, so the suite still sees this file's tests
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

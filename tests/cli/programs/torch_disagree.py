"""One rank of an MPMD job whose ranks disagree about a torch model (tests/cli/test_torch_mpmd.py).

    python torch_disagree.py HEAD [EXTRA]

HEAD (``a`` or ``b``) is the head this rank backpropagates through; the other
head gets no gradient here. With EXTRA, this rank's model has one more
layer, so the ranks' gradients cannot be matched. Each rank checks
``average_gradients_`` and ``DistributedOptimizer`` against MPI's own
Allreduce and prints one line: ``ok``, ``mismatch: ...`` or ``wrong: ...``.
"""

import sys

import numpy as np
import torch
from mpi4py import MPI

import ringtrain.torch as hvd
from ringtrain.errors import MismatchError
from ringtrain.torch.interop import average_gradients_


def build(extra):
    torch.manual_seed(0)
    layers = {"body": torch.nn.Linear(4, 3), "a": torch.nn.Linear(3, 2), "b": torch.nn.Linear(3, 2)}
    if extra:
        layers["extra"] = torch.nn.Linear(2, 2)
    return torch.nn.ModuleDict(layers)


def main(head, extra):
    comm = MPI.COMM_WORLD
    hvd.init()
    net = build(extra)
    torch.manual_seed(10 + comm.Get_rank())
    x = torch.randn(6, 4)
    net[head](net["body"](x)).square().sum().backward()
    try:
        mine = [p.grad.numpy().copy() if p.grad is not None else np.zeros(p.shape, np.float32)
                for p in net.parameters()]
        average_gradients_(net)
    except MismatchError as exc:
        print(f"mismatch: {exc}", flush=True)
        return 3
    expected = [comm.allreduce(g, op=MPI.SUM) / comm.Get_size() for g in mine]
    if not all(np.allclose(p.grad.numpy(), e, rtol=1e-6, atol=1e-7) for p, e in zip(net.parameters(), expected)):
        print("wrong: average_gradients_ differs from MPI's Allreduce", flush=True)
        return 1
    # The same through DistributedOptimizer with plain SGD (lr 1): the step is minus the average.
    net = build(extra)
    before = [p.detach().clone() for p in net.parameters()]
    opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=1.0), named_parameters=net.named_parameters())
    opt.zero_grad()
    net[head](net["body"](x)).square().sum().backward()
    opt.step()
    if not all(np.allclose((b - p.detach()).numpy(), e, rtol=1e-5, atol=1e-6)
               for p, b, e in zip(net.parameters(), before, expected)):
        print("wrong: DistributedOptimizer's step differs from MPI's Allreduce", flush=True)
        return 1
    print("ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], len(sys.argv) > 2))

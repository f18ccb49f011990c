"""A Horovod script, written as Horovod's examples/pytorch/pytorch_mnist.py is, with no line changed for ringtrain.

Its imports and calls are the example's: ``import horovod``, ``import
horovod.torch as hvd``, ``hvd.init``, ``broadcast_parameters``,
``broadcast_optimizer_state``, ``DistributedOptimizer`` with a compression
and an op, ``hvd.allreduce`` by name, and ``horovod.run(main, args=(args,),
np=N, hosts=..., use_gloo=..., use_mpi=...)`` when ``--num-proc`` is given.
Each rank trains a small linear model on its own rows for a few steps and
returns (or, under mpirun, rank 0 prints them all as one JSON line) what the test compares with a straight run.

    python -m ringtrain.horovod horovod_script.py --num-proc 3
    mpirun -np 2 python -m ringtrain.horovod horovod_script.py
"""

import argparse
import json
import sys

import torch

import horovod
import horovod.torch as hvd

ROWS, FEATURES, STEPS = 8, 4, 3

parser = argparse.ArgumentParser(description="a Horovod-style script")
parser.add_argument("--seed", type=int, default=42)
parser.add_argument("--lr", type=float, default=0.1)
parser.add_argument("--fail-on-rank", type=int, default=-1)
parser.add_argument("--num-proc", type=int)
parser.add_argument("--hosts")
parser.add_argument("--communication")


def rows_of(rank):
    """Rank ``rank``'s training rows: the same on every run, different on every rank."""
    generator = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(ROWS, FEATURES, generator=generator), torch.randn(ROWS, 1, generator=generator)


def main(args):
    hvd.init()
    torch.manual_seed(args.seed + hvd.rank())  # different start weights: broadcast_parameters must fix them
    if hvd.rank() == args.fail_on_rank:
        raise ValueError(f"rank {hvd.rank()} fails on purpose")
    model = torch.nn.Linear(FEATURES, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.5)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    start = [p.detach().clone() for p in model.parameters()]
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=hvd.Compression.none, op=hvd.Average)
    x, y = rows_of(hvd.rank())
    for _ in range(STEPS):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    mean_rank = hvd.allreduce(torch.tensor(float(hvd.rank())), name="mean_rank").item()
    return {"rank": hvd.rank(), "size": hvd.size(), "mean_rank": mean_rank, "version": horovod.__version__,
            "hvd": hvd.__name__, "argv": sys.argv[1:], "start": [p.tolist() for p in start],
            "end": [p.detach().tolist() for p in model.parameters()]}


if __name__ == "__main__":
    args = parser.parse_args()
    if args.num_proc:
        results = horovod.run(main, args=(args,), np=args.num_proc, hosts=args.hosts,
                              use_gloo=args.communication == "gloo", use_mpi=args.communication == "mpi")
        print("results", json.dumps(results), flush=True)
    else:
        results = hvd.allgather_object(main(args))  # rank 0 prints every rank's: mpiexec may join lines
        if hvd.rank() == 0:
            print("results", json.dumps(results), flush=True)

"""What a commit of hvd.elastic costs: Horovod's in-memory commit against ringtrain's, which also writes it.

    python scripts/bench_elastic_commit.py [--sizes-mib 0.1 10 100] [--repeats 9] [--dir DIR]
    mpirun -np 2 python scripts/bench_elastic_commit.py ...

For models of about the given sizes (float32 parameters, SGD with momentum,
so the state is twice that), each repeat times one ``state.commit()`` of a
``TorchState`` without a commit directory (what Horovod does: a copy in
memory and a check for host changes) and one with ``RINGTRAIN_ELASTIC_DIR``
set (the same, and rank 0 writes the commit to DIR, fsynced), interleaved.
Prints the medians, their ratio and rank 0's write rate, with the machine's
load average. DIR defaults to a new directory under the system's temporary
directory; give one on the file system the commits will really go to.
"""

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch

import ringtrain.torch as hvd
from ringtrain.torch.elastic.commits import CommitStore


def model_of(mib):
    """A stack of square linear layers with about ``mib`` MiB of float32 parameters."""
    width = 128 if mib < 1 else 512 if mib < 16 else 1024
    per_layer = (width * width + width) * 4 / 2**20
    layers = max(1, round(mib / per_layer))
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])


def state_for(mib):
    torch.manual_seed(0)
    model = model_of(mib)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model(torch.randn(2, model[0].in_features)).sum().backward()
    optimizer.step()  # momentum buffers exist, as after any step
    state = hvd.elastic.TorchState(model, optimizer, epoch=0, batch=0)
    return state, sum(p.numel() * 4 for p in model.parameters()) / 2**20


def timed(state):
    hvd.barrier()
    started = time.perf_counter()
    state.commit()
    return time.perf_counter() - started


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes-mib", type=float, nargs="+", default=[0.1, 10, 100])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--dir")
    args = parser.parse_args()
    hvd.init()
    made = args.dir is None and hvd.rank() == 0
    directory = args.dir or (tempfile.mkdtemp(prefix="ringtrain-commit-bench-") if made else None)
    directory = hvd.broadcast_object(directory)
    try:
        measure(args, directory)
    finally:
        hvd.barrier()
        if made:
            shutil.rmtree(directory, ignore_errors=True)


def measure(args, directory):
    if hvd.rank() == 0:
        print(f"load average {os.getloadavg()[0]:.2f}, {hvd.size()} rank(s), commits to {directory}")
        print(f"{'params MiB':>10} {'in memory ms':>13} {'written ms':>11} {'ratio':>6} {'write MiB/s':>12}")
    for mib in args.sizes_mib:
        state, params = state_for(mib)
        memory, written, writes = [], [], []
        for _ in range(args.repeats):
            state._store = None  # Horovod's commit: memory only
            memory.append(timed(state))
            state._store = CommitStore(directory)  # ringtrain's under an elastic launch
            written.append(timed(state))
            if state.last_write_seconds is not None:
                writes.append(state.last_write_seconds)
        if hvd.rank() == 0:
            m, w = statistics.median(memory), statistics.median(written)
            rate = 2 * params / statistics.median(writes)  # parameters and momentum
            print(f"{params:>10.1f} {m * 1e3:>13.1f} {w * 1e3:>11.1f} {w / m:>6.1f} {rate:>12.0f}")


if __name__ == "__main__":
    main()

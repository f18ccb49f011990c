"""The small-call path: a 4 KiB ``ringtrain.allreduce_`` against MPI's own ``Allreduce``, and against another tree.

One launch (under mpirun) times both, interleaved: rounds of CALLS calls
each, ringtrain's batch then MPI's, every batch started after a barrier; the
per-call time of a round is the slowest rank's, and the launch prints the
medians over rounds as one JSON line::

    mpirun -np 2 python scripts/bench_small_calls.py --bytes 4096 --calls 2000 --rounds 15

``--compare TREE [TREE ...]`` runs LAUNCHES launches of this tree and of each
TREE (other checkouts of ringtrain, e.g. a ``git worktree`` of an older commit),
in turn, and prints the median of each tree's launch medians, the ratios
(each tree's against MPI's Allreduce in the same launches, this tree's against
each TREE's) and the load average before and after::

    python scripts/bench_small_calls.py --compare /tmp/old-tree --launches 16

Figures depend on the machine and its load: quote them with both.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def one_launch(nbytes, calls, rounds, op):
    import numpy as np
    from mpi4py import MPI

    import ringtrain

    comm = MPI.COMM_WORLD
    x = np.zeros(nbytes // 4, np.float32)  # zeros: a sum of zeros stays zero, no overflow to inf
    y = x.copy()
    mpi_op = {"sum": MPI.SUM, "max": MPI.MAX}[op]

    def ours():
        for _ in range(calls):
            ringtrain.allreduce_(x, op=op)

    def mpis():
        for _ in range(calls):
            comm.Allreduce(MPI.IN_PLACE, y, mpi_op)

    contestants = {"ringtrain": ours, "mpi": mpis}
    for fn in contestants.values():  # warm-up: plans made, caches hot
        fn()
    times = np.empty((len(contestants), rounds))
    for r in range(rounds):
        order = list(contestants.items()) if r % 2 == 0 else list(contestants.items())[::-1]
        for name, fn in order:
            comm.Barrier()
            start = time.perf_counter()
            fn()
            times[list(contestants).index(name), r] = (time.perf_counter() - start) / calls
    comm.Allreduce(MPI.IN_PLACE, times, MPI.MAX)
    if comm.Get_rank() == 0:
        medians = {name: float(np.median(times[k])) * 1e6 for k, name in enumerate(contestants)}
        print(json.dumps({"ranks": comm.Get_size(), "bytes": nbytes, "op": op, "us": medians,
                          "ratio_to_mpi": medians["ringtrain"] / medians["mpi"],
                          "ringtrain_file": ringtrain.__file__}), flush=True)


def _launch(tree, args):
    mpirun = os.path.join(os.path.dirname(sys.executable), "mpirun")
    env = dict(os.environ, PYTHONPATH=tree, OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    command = [mpirun, "-np", str(args.np), sys.executable, os.path.abspath(__file__), "--bytes", str(args.bytes),
               "--calls", str(args.calls), "--rounds", str(args.rounds), "--op", args.op]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, cwd="/")
    if done.returncode != 0:
        sys.exit(f"bench_small_calls: a launch in {tree} failed:\n{done.stderr[-2000:]}")
    record = json.loads(done.stdout.strip().splitlines()[-1])
    if not record["ringtrain_file"].startswith(tree):
        sys.exit(f"bench_small_calls: the launch for {tree} imported {record['ringtrain_file']}")
    return record


def compare(args):
    trees = {"this": ROOT}
    trees.update({f"other{i}" if len(args.compare) > 1 else "other": os.path.abspath(t)
                  for i, t in enumerate(args.compare, 1)})
    records = {name: [] for name in trees}
    load_before = os.getloadavg()
    names = list(trees)
    for i in range(args.launches):
        for name in names[i % len(names):] + names[:i % len(names)]:  # each tree first in turn
            records[name].append(_launch(trees[name], args))
    load_after = os.getloadavg()
    us = {name: statistics.median(r["us"]["ringtrain"] for r in records[name]) for name in trees}
    us["mpi"] = statistics.median([r["us"]["mpi"] for rs in records.values() for r in rs])
    result = {
        "np": args.np, "bytes": args.bytes, "op": args.op, "launches": args.launches, "calls": args.calls,
        "rounds": args.rounds, "trees": trees, "us": us,
        "ratio_to_mpi": {name: statistics.median(r["ratio_to_mpi"] for r in records[name]) for name in trees},
        "ratio_this_to": {name: us["this"] / us[name] for name in trees if name != "this"},
        "load_average_before": [round(v, 2) for v in load_before],
        "load_average_after": [round(v, 2) for v in load_after],
    }
    print(json.dumps(result, indent=1))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bytes", type=int, default=4096)
    parser.add_argument("--calls", type=int, default=2000, help="calls per timed batch")
    parser.add_argument("--rounds", type=int, default=15, help="timed batches per contestant in a launch")
    parser.add_argument("--op", choices=["sum", "max"], default="sum")
    parser.add_argument("--compare", metavar="TREE", nargs="+",
                        help="other ringtrain checkouts to launch against, in turn")
    parser.add_argument("--launches", type=int, default=16, help="with --compare: launches of each tree")
    parser.add_argument("--np", type=int, default=2, help="with --compare: ranks per launch")
    args = parser.parse_args()
    if args.bytes <= 0 or args.bytes % 4:
        parser.error(f"--bytes must be a positive multiple of 4 (float32), got {args.bytes}")
    if args.compare:
        compare(args)
    else:
        one_launch(args.bytes, args.calls, args.rounds, args.op)


if __name__ == "__main__":
    main()

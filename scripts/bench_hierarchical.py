"""Hierarchical allreduce against the flat ring, side by side in one run.

    ringtrain launch -np 4 --hostfile hosts -- python scripts/bench_hierarchical.py
    mpirun -np 4 python scripts/bench_hierarchical.py --sizes 4M,16M,64M --iters 7 --json

For each float32 message size every iteration runs the flat ring
(``transport="ring"``), the hierarchical allreduce and MPI's own
``Allreduce`` in turn, so a change in load hits all three alike. An
iteration's time is the slowest rank's; the table shows the median over
iterations after one warm-up, the bus bandwidth ``bytes * 2(N-1)/N / time``,
and ring / hierarchical (above 1: hierarchical is faster). Both ringtrain
results are checked against MPI's.

The hierarchy comes from MPI's shared-memory split, so it only differs from
the flat ring when several ranks share a host.
"""

import argparse
import json
import statistics
import sys
import time

import numpy as np
from mpi4py import MPI

from ringtrain.comm import allreduce_
from ringtrain.commands.bench import parse_bytes
from ringtrain.comm.transports.hierarchical import Hierarchy
from ringtrain.cluster.topology import TaskSpec

CONTESTANTS = ("ring", "hierarchical", "mpi")


def timed(comm, x, reference, iters):
    """Median seconds per contestant (slowest rank per iteration) and the largest error seen."""
    work = np.empty_like(x)
    times = {name: [] for name in CONTESTANTS}
    error = 0.0
    for i in range(iters + 1):  # the first round warms caches and buffers
        for name in CONTESTANTS:
            work[...] = x
            comm.Barrier()
            start = time.perf_counter()
            allreduce_(work, op="sum", comm=comm, transport=name)
            elapsed = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
            if i:
                times[name].append(elapsed)
            error = max(error, float(np.max(np.abs(work - reference))))
    return {name: statistics.median(t) for name, t in times.items()}, error


def main(argv=None):
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="4M,16M,64M", help="comma-separated message sizes (default 4M,16M,64M)")
    parser.add_argument("--iters", type=int, default=5, help="timed iterations per size (default 5)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = parser.parse_args(argv)
    comm = MPI.COMM_WORLD
    spec = TaskSpec.from_mpi(comm, device_count=0)
    hierarchy = Hierarchy.of(comm)
    sizes = [parse_bytes(s) for s in args.sizes.split(",") if s]
    rows = []
    for nbytes in sizes:
        n = nbytes // 4
        x = np.random.default_rng(comm.Get_rank()).standard_normal(n).astype(np.float32)
        reference = np.empty_like(x)
        comm.Allreduce(x, reference, op=MPI.SUM)
        medians, error = timed(comm, x, reference, args.iters)
        error = comm.allreduce(error, op=MPI.MAX)
        bus = nbytes * 2 * (spec.size - 1) / spec.size
        rows.append({"bytes": nbytes, "error": error,
                     "ring_over_hierarchical": medians["ring"] / medians["hierarchical"],
                     **{f"{k}_s": v for k, v in medians.items()},
                     **{f"{k}_busbw_gbs": bus / v / 1e9 for k, v in medians.items()}})
    if spec.rank != 0:
        return 0
    setup = {"ranks": spec.size, "hosts": spec.num_nodes, "leaders": hierarchy.num_hosts,
             "ranks_per_host": [len(spec.ranks_on(i)) for i in range(spec.num_nodes)],
             "mpi": MPI.Get_library_version().splitlines()[0].strip(), "iters": args.iters}
    if args.json:
        print(json.dumps({"setup": setup, "rows": rows}, indent=2))
        return 0
    print(f"# {spec.size} ranks on {spec.num_nodes} host(s) {setup['ranks_per_host']}, "
          f"median of {args.iters}, float32 sum; busbw = bytes * 2(N-1)/N / time")
    print(f"{'size':>8}  {'ring ms':>9}  {'hier ms':>9}  {'mpi ms':>9}  {'ring GB/s':>9}  {'hier GB/s':>9}"
          f"  {'ring/hier':>9}  {'max err':>8}")
    for r in rows:
        print(f"{r['bytes'] >> 20:>6}Mi  {r['ring_s'] * 1e3:>9.1f}  {r['hierarchical_s'] * 1e3:>9.1f}"
              f"  {r['mpi_s'] * 1e3:>9.1f}  {r['ring_busbw_gbs']:>9.3f}  {r['hierarchical_busbw_gbs']:>9.3f}"
              f"  {r['ring_over_hierarchical']:>9.2f}  {r['error']:>8.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

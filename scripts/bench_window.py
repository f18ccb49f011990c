"""The shared-memory window against the ring and MPI, side by side in one run, on one host.

    mpirun -np 2 python scripts/bench_window.py                       # 16M, 64M, 256M
    mpirun -np 2 python scripts/bench_window.py --sizes 4K,8K,64K,1M,4M --iters 200
    mpirun -np 2 python scripts/bench_window.py --before HEAD~3       # also the window as it was at HEAD~3

For each float32 message size, every iteration runs each contestant in
turn (so a change in machine load hits all alike): ``mpi`` (MPI's own
``Allreduce``), ``ring``, ``shm`` and ``auto`` through
:func:`ringtrain.comm.allreduce_` (the header check included), and with
``--before REF`` the window transport as it was at git revision ``REF``
(called directly, without the header check: a few microseconds less). An
iteration's time is the slowest rank's; the table shows medians after one
warm-up, the bus bandwidth ``bytes * 2(N-1)/N / time``, and the paired
ratios: each iteration's ``X / ring`` bus bandwidth and ``X / mpi`` time,
then their median, so the ratios compare runs made moments apart. The load
average is printed before and after.
"""

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time

import numpy as np
from mpi4py import MPI

from ringtrain.comm import allreduce_
from ringtrain.commands.bench import parse_bytes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def window_before(ref):
    """The window module as it was at git revision ``ref``, loaded beside today's."""
    source = subprocess.run(["git", "-C", ROOT, "show", f"{ref}:ringtrain/comm/window.py"], check=True,
                            capture_output=True, text=True).stdout
    spec = importlib.util.spec_from_loader("ringtrain.comm._window_before", loader=None)
    module = importlib.util.module_from_spec(spec)
    module.__package__ = "ringtrain.comm"
    exec(compile(source, f"{ref}:ringtrain/comm/window.py", "exec"), module.__dict__)
    return module


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="16M,64M,256M", help="comma-separated sizes (default 16M,64M,256M)")
    parser.add_argument("--iters", type=int, default=9, help="timed iterations per size (default 9)")
    parser.add_argument("--before", metavar="REF", help="also time the window transport as it was at REF")
    parser.add_argument("--only", default="mpi,ring,shm,auto", help="contestants (default mpi,ring,shm,auto)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = parser.parse_args(argv)
    comm = MPI.COMM_WORLD
    size = comm.Get_size()
    load_before = os.getloadavg()
    old = None
    if args.before:
        old = window_before(args.before).WindowTransport.create(comm)
    factor = 2 * (size - 1) / size
    rows = []
    for nbytes in [parse_bytes(s) for s in args.sizes.split(",") if s]:
        x = np.empty(nbytes // 4, np.float32)
        contestants = {}
        for name in args.only.split(","):
            if name == "mpi":
                contestants[name] = lambda x=x: comm.Allreduce(MPI.IN_PLACE, [x, MPI.FLOAT], MPI.SUM)
            else:
                contestants[name] = lambda name=name, x=x: allreduce_(x, "sum", comm, transport=name)
        if old is not None:
            contestants["before"] = lambda x=x: old.allreduce(x)
        times = np.empty((len(contestants), args.iters + 1))
        for i in range(args.iters + 1):
            for k, fn in enumerate(contestants.values()):
                x[...] = 1.0
                comm.Barrier()
                start = time.perf_counter()
                fn()
                times[k, i] = time.perf_counter() - start
                if x[0] != size or x[-1] != size:
                    raise SystemExit(f"bench_window: {list(contestants)[k]} gave {x[0]}, expected {size}")
        comm.Allreduce(MPI.IN_PLACE, times, MPI.MAX)
        times = {name: times[k, 1:] for k, name in enumerate(contestants)}
        row = {"bytes": nbytes}
        for name, t in times.items():
            median = float(np.median(t))
            row[name] = {"time_us": median * 1e6, "busbw_GBps": nbytes * factor / median / 1e9}
            if "ring" in times and name != "ring":
                row[name]["vs_ring_busbw"] = float(np.median(times["ring"] / t))
            if "mpi" in times and name != "mpi":
                row[name]["vs_mpi_time"] = float(np.median(t / times["mpi"]))
        rows.append(row)
        del x
    if old is not None:
        old.close()
    if comm.Get_rank() != 0:
        return 0
    load_after = os.getloadavg()
    if args.json:
        print(json.dumps({"ranks": size, "load_before": load_before, "load_after": load_after, "rows": rows}))
        return 0
    names = list(rows[0].keys())[1:]
    print(f"# {size} ranks, float32 sum, median of {args.iters}; load average before "
          f"{' '.join(f'{v:.2f}' for v in load_before)}, after {' '.join(f'{v:.2f}' for v in load_after)}")
    print(f"# {'size':>6} | " + " | ".join(f"{n + ' us':>10} {'GB/s':>6} {'/ring':>6} {'/mpi t':>6}" for n in names))
    for row in rows:
        cells = []
        for n in names:
            r = row[n]
            cells.append(f"{r['time_us']:10.1f} {r['busbw_GBps']:6.2f} {r.get('vs_ring_busbw', 1):5.2f}x "
                         f"{r.get('vs_mpi_time', 1):5.2f}x")
        label = f"{row['bytes'] >> 20}M" if row["bytes"] >= 1 << 20 else f"{row['bytes'] >> 10}K"
        print(f"  {label:>6} | " + " | ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

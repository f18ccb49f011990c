"""``ringtrain bench allreduce``: ringtrain's ring and auto choice against MPI's own Allreduce.

In the style of nccl-tests: for float32 messages from 4 KiB to 256 MiB it
prints the time (median over iterations after warm-up, each iteration's time
being the slowest rank's), algbw = bytes / time and busbw = algbw * 2(N-1)/N
for three contestants measured side by side in the same run, plus the
single-core memcpy rate measured in that run as the physical reference.

    mpirun -np 2 ringtrain bench allreduce
    mpirun -np 2 ringtrain bench allreduce --max-bytes 16M --iters 20 --json
"""

import json
import re
import statistics
import time

from ..errors import UsageError

HELP = "benchmark the ring allreduce against MPI's Allreduce (nccl-tests style)"

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
# 2^31 - 1 float32 elements is the largest count every MPI's Allreduce takes
# (MPI-4's large counts are not everywhere yet); 8G is twice nccl-tests' usual top.
MAX_BYTES = 4 * ((1 << 31) - 1)


def parse_bytes(text):
    """``"4K"`` -> 4096, ``"256M"`` -> 268435456, ``"100"`` -> 100 (pure)."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(?:i?B)?\s*", str(text), re.IGNORECASE)
    if not match:
        raise UsageError(f"bad size {text!r}; expected a number of bytes like 4096, 64K or 256M", everywhere=True)
    return int(match.group(1)) * _UNITS[match.group(2).upper()]


def message_sizes(min_bytes, max_bytes):
    """Powers of two from ``min_bytes`` to ``max_bytes``, multiples of 4 bytes (pure)."""
    sizes, size = [], max(4, min_bytes)
    while size <= max_bytes:
        sizes.append(size - size % 4)
        size *= 2
    return sizes


def add_arguments(parser):
    parser.add_argument("what", choices=["allreduce"], help="what to benchmark")
    parser.add_argument("--min-bytes", type=parse_bytes, default=4 << 10, help="smallest message (default 4K)")
    parser.add_argument("--max-bytes", type=parse_bytes, default=256 << 20, help="largest message (default 256M)")
    parser.add_argument("--iters", type=int, default=50, help="timed iterations per size (fewer for big sizes)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed iterations per size")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def _timed(comm, contestants, reset, iters, warmup):
    """Median seconds per contestant, each iteration's time the slowest rank's.

    The contestants take turns within each iteration, so a change in machine
    load during the run affects them alike.
    """
    import numpy as np
    from mpi4py import MPI

    for _ in range(warmup):
        for fn in contestants.values():
            reset()
            fn()
    times = np.empty((len(contestants), iters))
    for i in range(iters):
        for k, fn in enumerate(contestants.values()):
            reset()
            comm.Barrier()
            start = time.perf_counter()
            fn()
            times[k, i] = time.perf_counter() - start
    comm.Allreduce(MPI.IN_PLACE, times, MPI.MAX)
    return {name: float(np.median(times[k])) for k, name in enumerate(contestants)}


def memcpy_rate(nbytes=64 << 20, iters=10):
    """Single-core copy rate in bytes per second (one array copied to another)."""
    import numpy as np

    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    best = []
    for _ in range(iters + 2):
        start = time.perf_counter()
        np.copyto(dst, src)
        best.append(time.perf_counter() - start)
    return nbytes / statistics.median(best[2:])


def run(args):
    import numpy as np
    from mpi4py import MPI

    from ..comm import allreduce_
    from ..comm.policy import RING_BYTES, SMALL_BYTES

    if args.iters < 1 or args.warmup < 0:
        raise UsageError("--iters must be at least 1 and --warmup at least 0", everywhere=True)
    if args.min_bytes > args.max_bytes:
        raise UsageError(f"--min-bytes {args.min_bytes} is above --max-bytes {args.max_bytes}", everywhere=True)
    if args.max_bytes > MAX_BYTES:
        raise UsageError(f"--max-bytes {args.max_bytes:,} is too large; ringtrain bench goes up to {MAX_BYTES:,} "
                         "bytes (2^31 - 1 float32 elements, the largest count every MPI accepts)", everywhere=True)
    comm = MPI.COMM_WORLD
    size, rank = comm.Get_size(), comm.Get_rank()
    if size < 2:  # every rank sees the size, so every rank raises this
        raise UsageError("bench allreduce needs at least 2 ranks (there is nothing to reduce across one); run it "
                         "as mpirun -np 2 ringtrain bench allreduce", everywhere=True)
    factor = 2 * (size - 1) / size if size > 1 else 1.0
    copy = memcpy_rate()
    copy = comm.allreduce(copy, MPI.MIN)
    rows = []
    for nbytes in message_sizes(args.min_bytes, args.max_bytes):
        x = np.empty(nbytes // 4, np.float32)
        # Fresh values every iteration (untimed), so sums never run into inf.
        def reset():
            x[...] = 1.0
        # Fewer iterations for big messages: about 2 GiB moved per contestant.
        iters = max(3, min(args.iters, (2 << 30) // max(nbytes, 1)))
        row = {"bytes": nbytes, "count": x.size, "iters": iters}
        contestants = {
            "mpi": lambda: comm.Allreduce(MPI.IN_PLACE, [x, MPI.FLOAT], MPI.SUM),
            "ring": lambda: allreduce_(x, "sum", comm, algorithm="ring"),
            "auto": lambda: allreduce_(x, "sum", comm, algorithm="auto"),
        }
        for name, seconds in _timed(comm, contestants, reset, iters, args.warmup).items():
            algbw = nbytes / seconds
            row[name] = {"time_us": seconds * 1e6, "algbw_GBps": algbw / 1e9, "busbw_GBps": algbw * factor / 1e9}
        row["ring_vs_mpi_busbw"] = row["ring"]["busbw_GBps"] / row["mpi"]["busbw_GBps"]
        row["auto_vs_mpi_time"] = row["auto"]["time_us"] / row["mpi"]["time_us"]
        row["ring_busbw_vs_memcpy"] = row["ring"]["busbw_GBps"] * 1e9 / copy
        rows.append(row)
        if rank == 0 and not args.json:
            if len(rows) == 1:
                _print_header(size, copy, SMALL_BYTES, RING_BYTES)
            _print_row(row)
        del x
    if rank == 0 and args.json:
        print(json.dumps({"ranks": size, "dtype": "float32", "op": "sum", "memcpy_GBps": copy / 1e9,
                          "small_bytes": SMALL_BYTES, "ring_bytes": RING_BYTES, "busbw_factor": factor,
                          "mpi_library": MPI.Get_library_version().strip().splitlines()[0],
                          "rows": rows}, indent=2))
    return 0


def _size(nbytes):
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return str(nbytes)


def _print_header(size, copy, small, ring):
    from ..comm.policy import WINDOW_BYTES

    print(f"# ringtrain bench allreduce: {size} rank(s), float32 sum, busbw = algbw * 2(N-1)/N")
    print(f"# memcpy (one core, this run): {copy / 1e9:.2f} GB/s; auto = doubling up to {_size(small)}, then "
          f"shared memory up to {_size(WINDOW_BYTES)} on one host (else MPI Allreduce below {_size(ring)}), "
          f"ring from there")
    print(f"# {'size':>6} {'count':>10} | {'mpi us':>9} {'busbw':>6} | {'ring us':>9} {'busbw':>6} | "
          f"{'auto us':>9} {'busbw':>6} | {'ring/mpi':>8} {'ring/cpy':>8} {'auto/mpi':>8}")
    print(f"# {'':>6} {'':>10} | {'':>9} {'GB/s':>6} | {'':>9} {'GB/s':>6} | {'':>9} {'GB/s':>6} | "
          f"{'busbw':>8} {'busbw':>8} {'time':>8}")


def _print_row(row):
    cells = [f"  {_size(row['bytes']):>6} {row['count']:>10}"]
    for name in ("mpi", "ring", "auto"):
        cells.append(f"{row[name]['time_us']:9.1f} {row[name]['busbw_GBps']:6.2f}")
    cells.append(f"{row['ring_vs_mpi_busbw']:7.2f}x {row['ring_busbw_vs_memcpy']:7.0%} "
                 f"{row['auto_vs_mpi_time']:7.2f}x")
    print(" | ".join(cells), flush=True)

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

HELP = "benchmark the ring allreduce against MPI's Allreduce, on the CPU or a GPU (nccl-tests style)"

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
    # Optional to argparse, so that a bare `ringtrain bench` is told what to type, not "required: what".
    parser.add_argument("what", nargs="?", choices=["allreduce"], help="what to benchmark: allreduce")
    parser.add_argument("--device", choices=["cpu", "gpu"], default="cpu",
                        help="cpu: NumPy buffers against MPI's Allreduce; gpu: CuPy buffers against MPI's "
                             "Allreduce staged through the host (and torch gloo on CUDA tensors where torch has "
                             "CUDA) (default: cpu)")
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


def memcpy_rate(nbytes=64 << 20, iters=10, xp=None):
    """Copy rate in bytes per second (one array copied to another): one core, or the GPU's device memory."""
    import numpy as np

    xp = np if xp is None else xp
    src = xp.ones(nbytes // 4, np.float32)
    dst = xp.empty_like(src)
    best = []
    for _ in range(iters + 2):
        start = time.perf_counter()
        dst[...] = src
        _synchronize(dst)
        best.append(time.perf_counter() - start)
    return nbytes / statistics.median(best[2:])


def _synchronize(x):
    from .. import backend

    backend.synchronize(x)


def _check(args, size):
    """One-line errors for arguments no rank can run with (every rank sees the same ones)."""
    from .. import backend

    if args.what is None:
        raise UsageError("say what to benchmark: ringtrain bench allreduce (under mpirun -np 2 or more)",
                         everywhere=True)

    if args.iters < 1 or args.warmup < 0:
        raise UsageError("--iters must be at least 1 and --warmup at least 0", everywhere=True)
    if args.min_bytes > args.max_bytes:
        raise UsageError(f"--min-bytes {args.min_bytes} is above --max-bytes {args.max_bytes}", everywhere=True)
    if args.max_bytes > MAX_BYTES:
        raise UsageError(f"--max-bytes {args.max_bytes:,} is too large; ringtrain bench goes up to {MAX_BYTES:,} "
                         "bytes (2^31 - 1 float32 elements, the largest count every MPI accepts)", everywhere=True)
    if size < 2:
        raise UsageError("bench allreduce needs at least 2 ranks to compare anything; run it under "
                         "mpirun -np 2 (or more)", everywhere=True)
    if args.device == "gpu" and not backend.gpu_available():
        raise UsageError("bench allreduce --device gpu needs a CUDA GPU and CuPy (pip install ringtrain[cuda12]); "
                         "use --device cpu here", everywhere=True)


class Suite:
    """The contestants of one device, the baseline they are compared with, and the reference copy rate.

    CPU: MPI's own Allreduce (the baseline), ringtrain's ring, and ringtrain's
    ``auto``. GPU: MPI's Allreduce staged through the host, as a user writes it
    by hand (the baseline), ringtrain's ring and ``auto`` on CuPy buffers, and
    torch's gloo on CUDA tensors where torch has CUDA.
    """

    def __init__(self, device, comm):
        from .. import backend
        from ..cluster.topology import TaskSpec

        self.device, self.comm = device, comm
        self.xp = backend.xp_for(device)
        # Each rank on its own GPU where the host has several (local rank modulo
        # the count), as the trainer does: else every rank, and gloo with it,
        # would measure GPU 0, and "one GPU per rank" would be N ranks sharing one.
        self.gpu = TaskSpec.from_mpi(comm).device if device == "gpu" else None
        backend.use_device(self.gpu)
        self.baseline = "mpi" if device == "cpu" else "staged"
        self.copy_label = "memcpy (one core)" if device == "cpu" else "device-to-device copy"
        self._gloo = _gloo_group(comm) if device == "gpu" else None

    def contestants(self, x):
        """name -> a function that sums ``x`` over the ranks in place."""
        from mpi4py import MPI

        from ..comm import allreduce_

        comm = self.comm
        ours = {"ring": lambda: allreduce_(x, "sum", comm, transport="ring"),
                "auto": lambda: allreduce_(x, "sum", comm, transport="auto")}
        if self.device == "cpu":
            return {"mpi": lambda: comm.Allreduce(MPI.IN_PLACE, [x, MPI.FLOAT], MPI.SUM), **ours}
        host = np_empty_pinned_like(x)

        def staged():
            _synchronize(x)
            x.get(out=host)
            comm.Allreduce(MPI.IN_PLACE, [host, MPI.FLOAT], MPI.SUM)
            x.set(host)
            _synchronize(x)

        everyone = {"staged": staged, **ours}
        if self._gloo is not None:
            everyone["gloo"] = self._gloo(x)
        # GPU work is queued on a stream: a contestant's time ends when its kernels have.
        return {name: _then_synchronized(fn, x) for name, fn in everyone.items()}

    def ratios(self, row):
        """``(label, value)`` pairs: ringtrain against the baseline (and gloo), and against the copy rate."""
        auto, base = row["auto"]["busbw_GBps"], row[self.baseline]["busbw_GBps"]
        pairs = [(f"auto/{self.baseline}", auto / base), ("ring/" + self.baseline, row["ring"]["busbw_GBps"] / base)]
        if "gloo" in row:
            pairs.append(("auto/gloo", auto / row["gloo"]["busbw_GBps"]))
        pairs.append(("auto/copy", auto * 1e9 / row["copy_Bps"]))
        return pairs


def _then_synchronized(fn, x):
    def timed():
        fn()
        _synchronize(x)

    return timed


def np_empty_pinned_like(x):
    """A pinned host array like the CuPy array ``x`` (staging that moves at full PCIe speed)."""
    import numpy as np

    from .. import backend

    memory = backend.get_array_module(x).cuda.alloc_pinned_memory(x.nbytes)
    return np.frombuffer(memory, x.dtype, x.size)


def _gloo_group(comm):
    """torch's gloo all_reduce as a contestant on CUDA tensors, or None where torch (with CUDA) is missing."""
    try:
        from ..torch.peers import gloo_allreduce
    except ImportError:
        return None
    return gloo_allreduce(comm)


def run(args):
    import numpy as np
    from mpi4py import MPI

    from ..comm.policy import RING_BYTES, SMALL_BYTES

    comm = MPI.COMM_WORLD
    size, rank = comm.Get_size(), comm.Get_rank()
    _check(args, size)
    suite = Suite(args.device, comm)
    factor = 2 * (size - 1) / size
    copy = comm.allreduce(memcpy_rate(xp=suite.xp), MPI.MIN)
    rows = []
    for nbytes in message_sizes(args.min_bytes, args.max_bytes):
        x = suite.xp.empty(nbytes // 4, np.float32)

        def reset(x=x):  # fresh values every iteration (untimed), so sums never run into inf
            x[...] = 1.0
            _synchronize(x)  # the fill kernel must not run inside the timed region

        # Fewer iterations for big messages: about 2 GiB moved per contestant.
        iters = max(3, min(args.iters, (2 << 30) // max(nbytes, 1)))
        row = {"bytes": nbytes, "count": x.size, "iters": iters, "copy_Bps": copy}
        for name, seconds in _timed(comm, suite.contestants(x), reset, iters, args.warmup).items():
            algbw = nbytes / seconds
            row[name] = {"time_us": seconds * 1e6, "algbw_GBps": algbw / 1e9, "busbw_GBps": algbw * factor / 1e9}
        row["ratios"] = dict(suite.ratios(row))
        rows.append(row)
        if rank == 0 and not args.json:
            if len(rows) == 1:
                _print_header(size, suite, copy, SMALL_BYTES, RING_BYTES, row)
            _print_row(row)
        del x
    if rank == 0 and args.json:
        print(json.dumps({"ranks": size, "device": args.device, "dtype": "float32", "op": "sum",
                          "copy_GBps": copy / 1e9, "copy": suite.copy_label, "baseline": suite.baseline,
                          "small_bytes": SMALL_BYTES, "ring_bytes": RING_BYTES, "busbw_factor": factor,
                          "mpi_library": MPI.Get_library_version().strip().splitlines()[0],
                          "rows": rows}, indent=2))
    return 0


def _size(nbytes):
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return str(nbytes)


def _print_header(size, suite, copy, small, ring, row):
    from ..comm.policy import WINDOW_BYTES

    names = [k for k in row if isinstance(row[k], dict) and "time_us" in row[k]]
    print(f"# ringtrain bench allreduce --device {suite.device}: {size} rank(s), float32 sum, "
          "busbw = algbw * 2(N-1)/N")
    if suite.device == "cpu":
        how = (f"auto, on one host: the shared-memory board up to {_size(small)}, the window up to "
               f"{_size(WINDOW_BYTES)}, the ring from there (across hosts: doubling, MPI Allreduce, the ring)")
    else:
        how = (f"auto = the board (host-staged) up to {_size(small)}, then CUDA IPC on one host; "
               "staged = MPI via host")
    print(f"# {suite.copy_label}, this run: {copy / 1e9:.2f} GB/s; {how}")
    print("# " + " | ".join([f"{'size':>6} {'count':>10}"] + [f"{n + ' us':>9} {'busbw':>6}" for n in names]
                            + [" ".join(f"{label:>9}" for label, _ in row["ratios"].items())]))


def _print_row(row):
    names = [k for k in row if isinstance(row[k], dict) and "time_us" in row[k]]
    cells = [f"  {_size(row['bytes']):>6} {row['count']:>10}"]
    cells += [f"{row[n]['time_us']:9.1f} {row[n]['busbw_GBps']:6.2f}" for n in names]
    cells.append(" ".join(f"{value:8.2f}x" for value in row["ratios"].values()))
    print(" | ".join(cells), flush=True)

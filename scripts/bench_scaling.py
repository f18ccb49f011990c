"""Scaling efficiency of ``ringtrain train`` from 1 to 2 ranks, one thread per rank.

    python scripts/bench_scaling.py                    # 5 repeats, the issue's workload
    python scripts/bench_scaling.py --variant= --variant=--no-shard-optimizer
    python scripts/bench_scaling.py --repeats 3 -- --no-overlap

Runs ``mpirun -np 1`` and ``mpirun -np 2`` of

    ringtrain train --dataset mnist5k --model mlp --hidden 512,512 --batch-size 64

alternately (1, 2, 1, 2, ..., and each ``--variant`` in turn within a
repeat) so that background load hits all alike, with
``OMP_NUM_THREADS=1``. Each run's throughput is the median of its steady-state
``samples_per_sec`` train events in ``metrics.jsonl`` (the first window,
which pays for warm-up, is dropped); the reported figure is the median over
repeats. Efficiency = samples/s at 2 ranks / (2 x samples/s at 1 rank).
Arguments after ``--`` go to ``ringtrain train`` for both sizes.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from ringtrain.cluster.launch import detect_flavour, find_mpirun, mpi_env, mpirun_command

WORKLOAD = ["--dataset", "mnist5k", "--model", "mlp", "--hidden", "512,512", "--batch-size", "64"]


def one_run(np, run_dir, epochs, extra):
    """Train once on ``np`` ranks; return the median steady-state samples/s."""
    env = mpi_env(detect_flavour(find_mpirun()))
    env.update(OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    command = [sys.executable, "-m", "ringtrain", "train", *WORKLOAD, "--epochs", str(epochs),
               "--log-every", "10", "--eval-every", "0", "--resume", "none", "--no-progress",
               "--run-dir", run_dir, *extra]
    done = subprocess.run(mpirun_command(np, command), env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        sys.exit(f"bench_scaling: {np}-rank run failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        events = [json.loads(line) for line in fh]
    speeds = [e["samples_per_sec"] for e in events if e["event"] == "train"][1:]
    return statistics.median(speeds)


def main(argv=None):
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="runs at each size (default 5)")
    parser.add_argument("--epochs", type=int, default=3, help="epochs per run (default 3)")
    parser.add_argument("--variant", action="append", metavar="FLAGS",
                        help="a setting to measure, as ringtrain train flags in one string (repeatable; "
                             "default: the defaults alone); e.g. --variant= --variant=--no-shard-optimizer "
                             "(with '=', since the flags start with a dash)")
    parser.add_argument("--json", action="store_true", help="print one JSON object per variant instead of a table")
    parser.add_argument("extra", nargs="*", help="after --: more ringtrain train flags, for every variant")
    args = parser.parse_args(argv)
    variants = args.variant or [""]
    load = os.getloadavg()[0]
    speeds = {(v, np): [] for v in variants for np in (1, 2)}
    with tempfile.TemporaryDirectory(prefix="bench-scaling-") as tmp:
        for r in range(args.repeats):
            for k, variant in enumerate(variants):
                for np in (1, 2):
                    run_dir = os.path.join(tmp, f"{k}-{np}-{r}")
                    speeds[variant, np].append(one_run(np, run_dir, args.epochs, variant.split() + args.extra))
    results = []
    for variant in variants:
        one, two = statistics.median(speeds[variant, 1]), statistics.median(speeds[variant, 2])
        pairs = [b / (2 * a) for a, b in zip(speeds[variant, 1], speeds[variant, 2])]
        results.append({"variant": variant, "samples_per_sec_1": one, "samples_per_sec_2": two,
                        "efficiency": two / (2 * one), "efficiency_per_repeat": pairs,
                        "runs_1": speeds[variant, 1], "runs_2": speeds[variant, 2], "extra": args.extra})
    after = os.getloadavg()[0]
    if args.json:
        for result in results:
            print(json.dumps({**result, "load_before": load, "load_after": after}))
        return 0
    print(f"ringtrain train {' '.join(WORKLOAD + args.extra)}  ({args.repeats} repeats, OMP_NUM_THREADS=1)")
    print(f"{'variant':<24} {'ranks':>5}  {'samples/s (median)':>18}  runs")
    for result in results:
        for np in (1, 2):
            runs = " ".join(f"{s:,.0f}" for s in result[f"runs_{np}"])
            print(f"{result['variant'] or '(defaults)':<24} {np:>5}  {result[f'samples_per_sec_{np}']:>18,.0f}  {runs}")
    for result in results:
        print(f"scaling efficiency at 2 ranks, {result['variant'] or '(defaults)'}: {result['efficiency']:.1%}  "
              f"(per repeat: {', '.join(f'{p:.0%}' for p in result['efficiency_per_repeat'])})")
    print(f"load average: {load:.2f} before, {after:.2f} after")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""One table of every figure scripts/gpu_acceptance.sh measured, against the GPU path's targets.

    python scripts/gpu_report.py DIR        # DIR: the acceptance run's files (steps.tsv, bench-2.json, ...)

Reads what the run left in DIR and prints one row per figure: what was
measured, the target, and whether it was met ("-" where the step did not
run). The exit status is the number of failed steps plus missed targets, so
the acceptance script's status is this one's. Only figures seen in DIR are
reported: nothing is carried over from another run or machine.
"""

import json
import os
import statistics
import sys

MIB = 1 << 20


def read_steps(directory):
    """name -> (exit status, seconds) for every step the script ran."""
    steps = {}
    path = os.path.join(directory, "steps.tsv")
    if os.path.exists(path):
        with open(path) as fh:
            for line in fh:
                name, status, seconds = line.rstrip("\n").split("\t")
                steps[name] = (int(status), float(seconds))
    return steps


def bench_busbw(directory):
    """bytes -> ringtrain's "auto" bus bandwidth (GB/s) at 2 ranks, from ``bench --json``."""
    try:
        with open(os.path.join(directory, "bench-2.json")) as fh:
            rows = json.load(fh)["rows"]
    except (OSError, ValueError, KeyError):
        return {}
    return {row["bytes"]: row["auto"]["busbw_GBps"] for row in rows}


def probe_busbw(directory):
    """bytes -> the CUDA IPC probe's bus bandwidth (GB/s) at 2 ranks, from its lines "2 ranks BYTES {json}"."""
    found = {}
    try:
        with open(os.path.join(directory, "probe-2.txt")) as fh:
            for line in fh:
                parts = line.split(None, 3)
                if len(parts) == 4 and parts[1] == "ranks":
                    found[int(parts[2])] = json.loads(parts[3])["busbw_GBs"]["ipc"]
    except (OSError, ValueError, KeyError):
        return {}
    return found


def samples_per_sec(run_dir):
    """The median training throughput over a run's epochs after the first (which compiles and warms up)."""
    try:
        with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
            rates = [event["samples_per_sec"] for event in map(json.loads, fh) if event.get("event") == "train"]
    except (OSError, ValueError, KeyError):
        return None
    return statistics.median(rates[1:] or rates) if rates else None


def same_final_checkpoint(a, b):
    """True when two runs' final checkpoints hold bitwise the same parameters at the same step; None if absent."""
    try:
        import numpy as np

        import ringtrain

        (pa, ma), (pb, mb) = ringtrain.load_checkpoint(a), ringtrain.load_checkpoint(b)
    except Exception:  # noqa: BLE001 - a missing or unreadable run is "not measured", not a crash
        return None
    return ma["step"] == mb["step"] and pa.keys() == pb.keys() and all(np.array_equal(pa[k], pb[k]) for k in pa)


def figures(directory):
    """``(figure, measured, target, met)`` rows; ``met`` is None where nothing was measured."""
    steps = read_steps(directory)
    bench, probe = bench_busbw(directory), probe_busbw(directory)
    rows = [(f"step: {name}", "passed" if status == 0 else f"exit {status}", "exit 0", status == 0)
            for name, (status, _) in steps.items()]

    def at_least(figure, value, target, unit):
        shown = "-" if value is None else f"{value:,.2f}{unit}"
        rows.append((figure, shown, f">= {target:,}{unit}", None if value is None else value >= target))

    at_least("allreduce 256 MiB busbw, 2 ranks", bench.get(256 * MIB), 150, " GB/s")
    at_least("allreduce 64 MiB busbw, 2 ranks", bench.get(64 * MIB), 80, " GB/s")
    ours, theirs = bench.get(256 * MIB), probe.get(256 * MIB)
    rows.append(("IPC probe 256 MiB busbw, 2 ranks (reference)", "-" if theirs is None else f"{theirs:,.2f} GB/s",
                 "-", None))
    at_least("allreduce 256 MiB / probe", None if ours is None or not theirs else 100 * ours / theirs, 80, "%")
    gpu, cpu = samples_per_sec(os.path.join(directory, "train-warm")), samples_per_sec(os.path.join(directory,
                                                                                                 "train-cpu"))
    for label, value in (("mnist5k MLP on the GPU, samples/s", gpu), ("mnist5k MLP on the CPU (sharded), samples/s",
                                                                      cpu)):
        rows.append((label, "-" if value is None else f"{value:,.0f}", "-", None))
    at_least("GPU / CPU samples/s", None if gpu is None or not cpu else gpu / cpu, 1.5, "x")
    cold, warm = steps.get("train, cold kernel cache"), steps.get("train, warm kernel cache")
    compile_s = cold[1] - warm[1] if cold and warm and cold[0] == warm[0] == 0 else None
    rows.append(("cold-cache run's compile time (cold wall - warm wall)", "-" if compile_s is None else
                 f"{compile_s:.1f} s", "< 5 s", None if compile_s is None else compile_s < 5))
    same = same_final_checkpoint(os.path.join(directory, "straight"), os.path.join(directory, "resumed"))
    rows.append(("resume after a stop equals the straight run", {None: "-", True: "bitwise", False: "differs"}[same],
                 "bitwise", same))
    return rows


def main(argv):
    if len(argv) != 1 or not os.path.isdir(argv[0]):
        print("usage: python scripts/gpu_report.py DIR (the acceptance run's files)", file=sys.stderr)
        return 2
    rows = figures(argv[0])
    widths = [max(len(str(row[i])) for row in rows + [("figure", "measured", "target")]) for i in range(3)]
    print(f"{'figure':<{widths[0]}}  {'measured':>{widths[1]}}  {'target':<{widths[2]}}  met")
    for figure, measured, target, met in rows:
        verdict = {None: "-", True: "yes", False: "NO"}[met]
        print(f"{figure:<{widths[0]}}  {measured:>{widths[1]}}  {target:<{widths[2]}}  {verdict}")
    missed = sum(met is False for *_, met in rows)
    print(f"gpu_report: {missed} failed step(s) or missed target(s); files in {argv[0]}")
    return min(missed, 125)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

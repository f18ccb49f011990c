"""Where a step's time goes: per-phase medians from a ``ringtrain train --timeline`` trace.

    mpirun -np 2 ringtrain train --dataset mnist5k --hidden 512,512 --batch-size 64 \\
        --timeline trace.json --eval-every 0
    python scripts/phases.py trace.json            # one column per rank
    python scripts/phases.py trace.json --skip 50  # drop more warm-up steps

For each rank: the median duration of each phase over the steps (the first
``--skip`` steps, which pay for warm-up, are left out), and the median step
period (start of one step's ``data`` phase to the next's; gaps over 20 ms,
where evaluation or a checkpoint ran, are left out). The difference between
the period and the sum of the phases is time outside them: the metrics sum
or allreduce, the finiteness check and Python's own overhead.
"""

import argparse
import collections
import json
import statistics
import sys


def summarise(trace, skip):
    """``{rank: {phase: median µs, ..., "period": median µs}}`` from a Chrome trace dict."""
    spans = collections.defaultdict(lambda: collections.defaultdict(list))
    starts = collections.defaultdict(list)
    for event in trace["traceEvents"]:
        step = event.get("args", {}).get("step")
        if event.get("ph") != "X" or event.get("tid") != 0 or step is None or step < skip:
            continue
        spans[event["pid"]][event["name"]].append(event["dur"])
        if event["name"] == "data":
            starts[event["pid"]].append(event["ts"])
    table = {}
    for rank in sorted(spans):
        row = {name: statistics.median(durations) for name, durations in spans[rank].items()}
        ordered = sorted(starts[rank])
        periods = [b - a for a, b in zip(ordered, ordered[1:]) if b - a < 20_000]
        if periods:
            row["period"] = statistics.median(periods)
        table[rank] = row
    return table


ORDER = ["data", "forward+backward", "allreduce", "allreduce wait", "reduce-scatter", "optimizer", "allgather"]


def main(argv=None):
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    parser.add_argument("trace", help="a --timeline file")
    parser.add_argument("--skip", type=int, default=20, help="leave out the first this many steps (default 20)")
    args = parser.parse_args(argv)
    try:
        with open(args.trace) as fh:
            trace = json.load(fh)
    except (OSError, ValueError) as exc:
        print(f"phases: cannot read {args.trace}: {exc}; give a file written by ringtrain train --timeline",
              file=sys.stderr)
        return 2
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        print(f"phases: {args.trace} is not a Chrome trace (no traceEvents list); give a file written by "
              "ringtrain train --timeline", file=sys.stderr)
        return 2
    table = summarise(trace, args.skip)
    if not table:
        print(f"phases: {args.trace} has no steps past --skip {args.skip}", file=sys.stderr)
        return 2
    names = [n for n in ORDER if any(n in row for row in table.values())]
    names += sorted({n for row in table.values() for n in row} - set(names) - {"period"})
    print(f"{'phase (median µs)':<20}" + "".join(f"{'rank ' + str(r):>10}" for r in table))
    for name in names + ["other", "period"]:
        cells = []
        for row in table.values():
            if name == "other":
                value = row.get("period", 0) - sum(row.get(n, 0) for n in names)
            else:
                value = row.get(name)
            cells.append(f"{value:>10,.0f}" if value is not None else f"{'-':>10}")
        print(f"{name:<20}" + "".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())

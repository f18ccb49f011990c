"""``ringtrain plot RUN_DIR``: the loss, accuracy and throughput curves of a run, as a PNG.

Reads ``RUN_DIR/metrics.jsonl`` (written by rank 0 during training) and draws
three panels side by side: loss and accuracy against the step, the train
windows as lines and the evaluations as markers, and the training throughput
in samples per second (all ranks together). A resumed run appends to the same
file, so a step recorded twice keeps its latest record; each resumption (a
``resumed`` event) is marked with a dotted vertical line, and the title says
how many ranks ran (from the ``start`` and ``resumed`` events). Needs matplotlib
(``pip install matplotlib``, or ``pip install -e '.[plot]'`` in a clone); it draws with the Agg backend, so no
display is needed.

With ``--timeline TRACE`` (a file from ``ringtrain train --timeline``) it
also draws ``timeline.png``: a few consecutive steps of every rank, one row
per rank (and one per communication thread), each phase a coloured bar on
one shared clock, so a rank that waits for another shows as a long
communication bar.

Example::

    ringtrain plot runs/mnist -o figures     # writes figures/metrics.png
    ringtrain plot runs/mnist --timeline trace.json --steps 3   # and figures/timeline.png
"""

import json
import math
import os
import statistics
import sys

from ..errors import UsageError
from . import given
from ..io.safeio import GiB, MiB, one_line, read_regular

__all__ = ["read_metrics", "draw", "read_trace", "timeline_window", "draw_timeline", "describe_ranks"]

HELP = "draw a run's loss, accuracy and throughput curves (and its timeline) to PNG"

FILENAME = "metrics.png"
TIMELINE_FILENAME = "timeline.png"
METRICS_MAX_BYTES = 4 * GiB  # a month-long run logging every step writes well under 1 GiB
TRACE_MAX_BYTES = 4 * GiB
CONFIG_MAX_BYTES = 16 * MiB


def _warn(line):
    print(f"ringtrain: warning: {one_line(line)}", file=sys.stderr, flush=True)


def add_arguments(parser):
    parser.add_argument("run_dir", type=given, metavar="RUN_DIR", help="a run directory (holding metrics.jsonl)")
    parser.add_argument("-o", "--out-dir", type=given, metavar="OUT_DIR",
                        help=f"where {FILENAME} (and {TIMELINE_FILENAME}) go (default: RUN_DIR)")
    parser.add_argument("--timeline", type=given, metavar="TRACE",
                        help=f"also draw {TIMELINE_FILENAME} from this 'ringtrain train --timeline' file")
    parser.add_argument("--steps", type=int, default=3, metavar="N",
                        help="with --timeline: how many consecutive steps to draw (default 3)")
    parser.add_argument("--from-step", type=int, default=None, metavar="S",
                        help="with --timeline: the first step drawn (default 20, past warm-up, or as late "
                             "as the run allows)")


def read_metrics(run_dir, warn=_warn):
    """Return ``{"train": [...], "eval": [...], "starts": [...]}``: the events of ``run_dir``.

    ``train`` and ``eval`` are by step, one per step; ``starts`` are the
    ``start`` and ``resumed`` events in file order (each job's beginning).

    A torn last line (a run killed mid-write, or still writing) is skipped
    with a one-line ``warn``; any other line that is not a JSON object is a
    UsageError naming the line. A FIFO, a device or a file that is not UTF-8
    text is a UsageError too, never a hang or a traceback.
    """
    if not os.path.isdir(run_dir):
        raise UsageError(f"{run_dir}: no such run directory")
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.lexists(path):
        raise UsageError(f"{run_dir}: no metrics.jsonl there; give the run directory of 'ringtrain train'")
    raw = read_regular(path, None, METRICS_MAX_BYTES, "metrics files")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"{path}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start}); "
                         "give the run directory of 'ringtrain train'") from None
    lines = text.splitlines()
    latest = {"train": {}, "eval": {}}
    starts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise ValueError
        except (ValueError, RecursionError):  # RecursionError: nested past any record ringtrain writes
            if number == len(lines):
                warn(f"{path} line {number}: skipping a torn last line (the run was killed mid-write, "
                     "or is still writing it)")
                continue
            raise UsageError(f"{path} line {number}: not a JSON object: {line[:60]!r}") from None
        kind = record.get("event")
        if kind in latest and isinstance(record.get("step"), int):
            latest[kind][record["step"]] = record
        elif kind in ("start", "resumed") and isinstance(record.get("step"), int):
            starts.append(record)
    metrics = {kind: [by_step[s] for s in sorted(by_step)] for kind, by_step in latest.items()}
    metrics["starts"] = starts
    return metrics


def describe_ranks(starts):
    """``"2 ranks"``, ``"2 then 3 ranks"``, or "" when the log does not say (pure)."""
    counts = [r["ranks"] for r in starts if isinstance(r.get("ranks"), int)]
    counts = [n for i, n in enumerate(counts) if i == 0 or n != counts[i - 1]]
    if not counts:
        return ""
    return " then ".join(map(str, counts)) + (" rank" if counts == [1] else " ranks")


def _title(run_dir, starts=()):
    ranks = describe_ranks(starts)
    try:
        cfg = json.loads(read_regular(os.path.join(run_dir, "config.json"), None, CONFIG_MAX_BYTES))
        if not isinstance(cfg, dict):
            raise ValueError
    except (UsageError, ValueError, RecursionError):  # the title is a nicety: a bad config.json only loses it
        return os.path.basename(os.path.normpath(run_dir)) + (f", {ranks}" if ranks else "")
    model = cfg.get("model_name")  # what was trained, a custom or torch model included
    if not isinstance(model, str):
        model = str(cfg.get("model", "?"))
        if model == "mlp" and isinstance(cfg.get("hidden"), list) and cfg["hidden"]:
            model += " " + "-".join(map(str, cfg["hidden"]))
    return (f"{cfg.get('dataset', '?')}, {model}, batch {cfg.get('batch_size', '?')} per rank"
            + (f", {ranks}" if ranks else ""))


# ringtrain is installed from a clone (it is not on PyPI), so the extra is named as a clone installs it.
PLOT_INSTALL = "pip install matplotlib (or, in ringtrain's clone, pip install -e '.[plot]')"


def _pyplot():
    """matplotlib's pyplot on the Agg backend (no display needed), or a UsageError saying how to get it."""
    try:
        import matplotlib
    except ImportError:
        raise UsageError(f"ringtrain plot needs matplotlib, which is not installed: {PLOT_INSTALL}") from None
    matplotlib.use("Agg")
    from matplotlib import pyplot

    return pyplot


def _save(plt, fig, path, title, set_title):
    if title:
        set_title(title)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def draw(metrics, path, title=""):
    """Draw the three panels of ``metrics`` (from :func:`read_metrics`) to the PNG ``path``."""
    plt = _pyplot()
    from matplotlib.ticker import FuncFormatter, PercentFormatter

    train, evals = metrics["train"], metrics["eval"]
    resumed = [r["step"] for r in metrics.get("starts", ()) if r.get("event") == "resumed"]
    fig, (loss_ax, acc_ax, speed_ax) = plt.subplots(1, 3, figsize=(13, 3.8), layout="constrained")
    for ax in (loss_ax, acc_ax, speed_ax):
        for i, step in enumerate(resumed):
            ax.axvline(step, color="gray", linestyle=":", linewidth=1, label="resumed" if i == 0 else None)
    for ax, key, label in ((loss_ax, "loss", "loss"), (acc_ax, "accuracy", "accuracy")):
        # Only finite numbers are drawn: an empty test set has no accuracy, a record may be odd.
        for rows, style, colour, name in ((train, "-", "tab:blue", "train"), (evals, "o-", "tab:orange", "test")):
            points = [(r["step"], r[key]) for r in rows if _number(r.get(key))]
            if points:
                ax.plot(*zip(*points), style, color=colour, markersize=4, label=name)
        ax.set_title(label)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    losses = [r.get("loss") for r in train + evals if _number(r.get("loss"))]
    if losses and all(v > 0 for v in losses):
        loss_ax.set_yscale("log")
    acc_ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    speeds = [(r["step"], r["samples_per_sec"]) for r in train
              if isinstance(r.get("samples_per_sec"), (int, float)) and r["samples_per_sec"] == r["samples_per_sec"]]
    if speeds:
        median = statistics.median(s for _, s in speeds)
        speed_ax.plot(*zip(*speeds), ".-", color="tab:green", label="train")
        speed_ax.axhline(median, color="gray", linestyle="--", linewidth=1, label=f"median {median:,.0f}")
        speed_ax.set_ylim(bottom=0)
        speed_ax.legend()
    speed_ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
    speed_ax.set_title("throughput (samples/s, all ranks)")
    speed_ax.set_xlabel("step")
    speed_ax.grid(alpha=0.3)
    return _save(plt, fig, path, title, fig.suptitle)


def _number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def read_trace(path):
    """The complete spans (``"ph": "X"``, with a step) of a ``--timeline`` file; UsageError if it is not one."""
    try:
        trace = json.loads(read_regular(path, "--timeline", TRACE_MAX_BYTES, "timeline files"))
    except (ValueError, RecursionError):  # UnicodeDecodeError included; RecursionError: absurdly nested
        raise UsageError(f"--timeline {path}: not JSON; give a file written by 'ringtrain train --timeline'") from None
    events = trace.get("traceEvents") if isinstance(trace, dict) else None
    if not isinstance(events, list):
        raise UsageError(f"--timeline {path}: not a Chrome trace (no traceEvents list)")
    spans = [e for e in events if isinstance(e, dict) and e.get("ph") == "X"
             and isinstance(e.get("args", {}).get("step"), int)]
    if not spans:
        raise UsageError(f"--timeline {path}: no step spans in it")
    return spans


def timeline_window(spans, first, count):
    """The spans of steps ``[first, first + count)``, as ``{(rank, thread): [(name, start_ms, length_ms)]}``.

    Times are on the trace's shared clock, from the earliest span drawn.
    Pure; ``first`` is clipped so that the window lies inside the run.
    """
    last = max(e["args"]["step"] for e in spans)
    first = max(0, min(first, last - count + 1))
    chosen = [e for e in spans if first <= e["args"]["step"] < first + count]
    origin = min(e["ts"] for e in chosen)
    rows = {}
    for e in sorted(chosen, key=lambda e: e["ts"]):
        rows.setdefault((e["pid"], e["tid"]), []).append((e["name"], (e["ts"] - origin) / 1e3, e["dur"] / 1e3))
    return dict(sorted(rows.items())), first


def _phase(name):
    return "allreduce bucket" if name.startswith("allreduce bucket") else name


def draw_timeline(rows, path, title=""):
    """Draw :func:`timeline_window`'s rows as horizontal bars to the PNG ``path``."""
    plt = _pyplot()
    from matplotlib.patches import Patch

    phases = list(dict.fromkeys(_phase(n) for spans in rows.values() for n, _, _ in spans))
    colours = {p: plt.get_cmap("tab10")(i % 10) for i, p in enumerate(phases)}
    fig, ax = plt.subplots(figsize=(13, 1.0 + 0.55 * len(rows)), layout="constrained")
    for y, spans in enumerate(rows.values()):
        ax.broken_barh([(start, length) for _, start, length in spans], (y - 0.35, 0.7),
                       facecolors=[colours[_phase(n)] for n, _, _ in spans], edgecolor="white", linewidth=0.5)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"rank {r}" + (" comm" if t else "") for r, t in rows])
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(handles=[Patch(color=colours[p], label=p) for p in phases], loc="upper center",
              bbox_to_anchor=(0.5, -0.35 if len(rows) < 3 else -0.2), ncol=len(phases), frameon=False)
    return _save(plt, fig, path, title, ax.set_title)


def run(args):
    if args.steps < 1:
        raise UsageError(f"--steps must be at least 1, got {args.steps}")
    spans = read_trace(args.timeline) if args.timeline else None
    metrics = read_metrics(args.run_dir)
    if not metrics["train"] and not metrics["eval"]:
        raise UsageError(f"{args.run_dir}: metrics.jsonl has no train or eval events to plot yet")
    out_dir = args.out_dir or args.run_dir
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--out-dir {out_dir}: cannot create it ({exc.strerror})") from None
    path = draw(metrics, os.path.join(out_dir, FILENAME), _title(args.run_dir, metrics["starts"]))
    print(path)
    if spans is not None:
        rows, first = timeline_window(spans, 20 if args.from_step is None else args.from_step, args.steps)
        last = first + args.steps - 1
        window = f"steps {first}-{last}" if last > first else f"step {first}"
        title = f"{_title(args.run_dir, metrics['starts'])}: {window}"
        print(draw_timeline(rows, os.path.join(out_dir, TIMELINE_FILENAME), title))
    return 0

"""``ringtrain plot`` and ``--timeline`` on a real two-rank run."""

import json
import os
import sys

import pytest

from mpirun import ROOT, mpirun, ringtrain as rt, run, show

pytest.importorskip("matplotlib")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One short two-rank run with a timeline, shared by the tests here."""
    run_dir = tmp_path_factory.mktemp("plot") / "run"
    timeline = run_dir / "timeline.json"
    # Small buckets, so the overlapping reducer has several per step to show.
    result = mpirun(2, rt("train", "--dataset", "digits", "--epochs", "3", "--log-every", "10", "--bucket-mb", "0.05",
                          "--run-dir", str(run_dir), "--timeline", str(timeline)), timeout=120)
    assert result.returncode == 0, show(result)
    return run_dir, timeline


def test_plot_writes_a_png_with_three_panels(trained, tmp_path):
    run_dir, _ = trained
    result = run(rt("plot", str(run_dir), "-o", str(tmp_path / "out")), timeout=60)
    assert result.returncode == 0, show(result)
    png = tmp_path / "out" / "metrics.png"
    assert result.stdout.strip() == str(png)
    from matplotlib import image

    pixels = image.imread(str(png))
    assert pixels.shape[1] > 2 * pixels.shape[0] > 400  # a wide strip of three panels


def test_plot_skips_a_truncated_last_line_and_keeps_the_latest_record_per_step(trained, tmp_path):
    from ringtrain.commands.plot import read_metrics

    run_dir, _ = trained
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    copy = tmp_path / "copy"
    copy.mkdir()
    # A resumed run appends: the second record for a step wins.
    again = dict(json.loads(next(line for line in lines if '"train"' in line)), loss=123.0)
    (copy / "metrics.jsonl").write_text("\n".join(lines + [json.dumps(again), '{"event": "tra']) + "\n")
    metrics = read_metrics(str(copy))
    steps = [r["step"] for r in metrics["train"]]
    assert steps == sorted(set(steps)) and metrics["eval"]
    assert next(r for r in metrics["train"] if r["step"] == again["step"])["loss"] == 123.0


@pytest.mark.parametrize("make,needle", [
    (lambda p: p / "missing", "no such run directory"),
    (lambda p: p, "no metrics.jsonl there"),
    (lambda p: (p / "metrics.jsonl").write_text('not json\n{"event": "train"}\n') and p, "line 1: not a JSON object"),
    # Nested past Python's recursion limit (a RecursionError in json, not a ValueError).
    (lambda p: (p / "metrics.jsonl").write_text("[" * 100_000 + "\n{}\n") and p, "line 1: not a JSON object"),
    (lambda p: (p / "metrics.jsonl").write_text('{"event": "done"}\n') and p, "no train or eval events"),
])
def test_bad_run_dir_is_one_line_exit_2(tmp_path, make, needle):
    result = run(rt("plot", str(make(tmp_path))), timeout=60)
    assert result.returncode == 2, show(result)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], show(result)


def test_timeline_is_a_chrome_trace_with_every_phase_on_every_rank(trained):
    _, timeline = trained
    trace = json.loads(timeline.read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    threads = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names == {"rank 0", "rank 1"} and threads == {"main", "communication"}
    assert all({"name", "pid", "tid", "ts", "dur"} <= set(e) and e["dur"] >= 0 for e in spans)
    for rank in (0, 1):
        mine = {e["name"] for e in spans if e["pid"] == rank}
        assert {"data", "forward+backward", "allreduce wait", "optimizer"} <= mine, mine
        buckets = {e["name"] for e in spans if e["pid"] == rank and e["tid"] == 1}
        assert buckets == {f"allreduce bucket {k}" for k in range(4)}, buckets  # 64-256-128-10: 4 buckets
        steps = {e["args"]["step"] for e in spans if e["pid"] == rank and e["name"] == "optimizer"}
        assert steps == set(range(len(steps)))  # one per step, from step 0


def test_sharded_timeline_shows_its_phases_and_phases_py_summarises_them(tmp_path):
    # Default buckets: one bucket, so the sharded step runs and the timeline shows its three phases.
    timeline = tmp_path / "trace.json"
    result = mpirun(2, rt("train", "--dataset", "digits", "--epochs", "2", "--eval-every", "0",
                          "--run-dir", str(tmp_path / "run"), "--timeline", str(timeline)), timeout=120)
    assert result.returncode == 0, show(result)
    spans = [e for e in json.loads(timeline.read_text())["traceEvents"] if e["ph"] == "X"]
    for rank in (0, 1):
        mine = {e["name"] for e in spans if e["pid"] == rank}
        assert {"data", "forward+backward", "reduce-scatter", "optimizer", "allgather"} <= mine, mine
        assert "allreduce" not in mine
    summary = run([sys.executable, os.path.join(ROOT, "scripts", "phases.py"), str(timeline)], timeout=60)
    assert summary.returncode == 0, show(summary)
    rows = {line.split()[0]: line.split()[1:] for line in summary.stdout.splitlines()[1:]}
    assert summary.stdout.split("\n")[0].split()[-2:] == ["rank", "1"]
    for phase in ("reduce-scatter", "optimizer", "allgather", "period"):
        assert len(rows[phase]) == 2 and all(float(v.replace(",", "")) > 0 for v in rows[phase]), summary.stdout
    bad = run([sys.executable, os.path.join(ROOT, "scripts", "phases.py"), str(tmp_path / "run" / "config.json")],
              timeout=60)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, show(bad)


def test_plot_draws_the_timeline_of_a_few_steps(trained, tmp_path):
    run_dir, timeline = trained
    result = run(rt("plot", str(run_dir), "--timeline", str(timeline), "--steps", "2", "-o", str(tmp_path)),
                 timeout=60)
    assert result.returncode == 0, show(result)
    assert result.stdout.split() == [str(tmp_path / "metrics.png"), str(tmp_path / "timeline.png")]
    from matplotlib import image

    from ringtrain.commands.plot import read_trace, timeline_window

    assert image.imread(str(tmp_path / "timeline.png")).shape[1] > 800
    spans = read_trace(str(timeline))
    rows, first = timeline_window(spans, 10**6, 2)  # clipped to the run's last two steps
    last = max(e["args"]["step"] for e in spans)
    assert first == last - 1
    # Two ranks, each with its main row and its communication thread's row (four buckets).
    assert list(rows) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    starts = [start for spans_ in rows.values() for _, start, _ in spans_]
    assert min(starts) == 0.0
    expected = sum(1 for e in spans if first <= e["args"]["step"] <= last)
    assert sum(len(r) for r in rows.values()) == expected


@pytest.mark.parametrize("content, flags, needle", [
    (None, [], "no such file"),
    ("not json", [], "not JSON"),
    ("[" * 100_000, [], "not JSON"),
    ('{"events": []}', [], "not a Chrome trace"),
    ('{"traceEvents": [{"ph": "M", "name": "process_name"}]}', [], "no step spans"),
    ('{"traceEvents": []}', ["--steps", "0"], "--steps must be at least 1"),
])
def test_bad_timeline_is_one_line_exit_2(trained, tmp_path, content, flags, needle):
    run_dir, _ = trained
    trace = tmp_path / "trace.json"
    if content is not None:
        trace.write_text(content)
    result = run(rt("plot", str(run_dir), "--timeline", str(trace), *flags, "-o", str(tmp_path / "out")),
                 timeout=60)
    assert result.returncode == 2, show(result)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], show(result)
    assert not (tmp_path / "out").exists()  # nothing written


def test_title_names_the_ranks_and_resumptions_are_marked(trained, tmp_path):
    from ringtrain.commands.plot import _title, describe_ranks, draw, read_metrics

    run_dir, _ = trained
    metrics = read_metrics(str(run_dir))
    assert [(r["event"], r["step"], r["ranks"]) for r in metrics["starts"]] == [("start", 0, 2)]
    assert _title(str(run_dir), metrics["starts"]).endswith(", 2 ranks")
    # A run stopped at step 40 and resumed there on 3 ranks.
    metrics["starts"].append({"event": "resumed", "step": 40, "epoch": 1, "ranks": 3})
    assert describe_ranks(metrics["starts"]) == "2 then 3 ranks"
    assert describe_ranks([]) == "" and describe_ranks([{"ranks": 1}]) == "1 rank"
    png = draw(metrics, str(tmp_path / "metrics.png"), "resumed")
    assert os.path.getsize(png) > 1000

"""scripts/horovod_tests_summary.py: each rank's outcomes from its report or its log, and what runs again."""

import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("horovod_tests_summary",
                                               os.path.join(ROOT, "scripts", "horovod_tests_summary.py"))
summary = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(summary)

IDS = [f"test_torch.py::TorchTests::test_{c}" for c in "abcd"]
JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="test_torch.TorchTests" name="test_a" time="0.1"/>
<testcase classname="test_torch.TorchTests" name="test_b" time="0.1">
<failure message="AssertionError: rank 1 differs&#10;second line">trace</failure></testcase>
</testsuite></testsuites>"""


def _attempt(path, logs, xml=None):
    path.mkdir()
    for rank, text in enumerate(logs):
        (path / f"rank-{rank}.log").write_text(text)
    for rank, text in (xml or {}).items():
        (path / f"rank-{rank}.xml").write_text(text)
    return path


def test_a_killed_ranks_log_tells_what_it_finished_and_a_report_gives_the_message(tmp_path):
    attempt = _attempt(tmp_path / "chunk-000.000", [
        "test_torch.py::TorchTests::test_a PASSED   [ 25%]\ntest_torch.py::TorchTests::test_b ",  # killed in b
        "header\ntest_torch.py::TorchTests::test_a PASSED [ 25%]\n"],
        xml={1: JUNIT})
    per_rank = summary.attempt_outcomes(str(attempt), 2)
    assert per_rank[0] == {"test_a": ("passed", "")}
    assert per_rank[1]["test_b"] == ("failed", "AssertionError: rank 1 differs")
    outcome, message = summary.verdict([r.get("test_b") for r in per_rank])
    assert outcome == "failed"
    assert message.startswith("rank 0: no outcome from this rank") and "rank 1: AssertionError" in message
    # a and b are settled (b failed): the next attempt starts after b.
    assert summary.rest(IDS, per_rank) == IDS[2:]


def test_skips_and_expected_failures_count_as_done_and_a_failure_on_every_rank_is_one_failure():
    skipped = [("skipped", "needs a GPU"), ("passed", "")]
    assert summary.verdict(skipped) == ("skipped", "needs a GPU")
    assert summary.verdict([("passed", ""), ("passed", "")]) == ("passed", "")
    per_rank = [{"test_a": ("passed", ""), "test_b": ("skipped", "x"), "test_c": ("failed", "boom"),
                 "test_d": ("passed", "")}] * 2
    assert summary.rest(IDS, per_rank) == IDS[3:]
    everything = [{name.rsplit("::", 1)[-1]: ("passed", "") for name in IDS}] * 3
    assert summary.rest(IDS, everything) == []
    # Nothing ran (mpirun or pytest never started, or an id was not found): the chunk ends, rather than
    # running again one id shorter each time.
    assert summary.rest(IDS, [{}, {"test_other": ("passed", "")}]) == []
    lines = "".join(f"{i} {word}\n" for i, word in zip(IDS, ("PASSED", "XFAIL", "SKIPPED (why)", "ERROR")))
    log = summary._VERBOSE_LINE
    assert [log.match(line).group(2) for line in lines.splitlines()] == ["PASSED", "XFAIL", "SKIPPED", "ERROR"]
    # A parametrized test's name is whole, as its JUnit report and the id list give it.
    assert log.match("test_tensorflow.py::test_p[2-float32] PASSED [ 5%]").group(1) == "test_p[2-float32]"


def test_the_last_attempt_to_run_a_test_decides_it(tmp_path):
    # Attempt 00: b failed on rank 1; rank 0 went on into c and failed there when rank 1 left.
    _attempt(tmp_path / "chunk-000.000", [
        "x::test_a PASSED\nx::test_b PASSED\nx::test_c FAILED\n", "x::test_a PASSED\nx::test_b FAILED\n"])
    # Attempt 01 ran c and d again: both passed on both ranks.
    _attempt(tmp_path / "chunk-000.001", ["x::test_c PASSED\nx::test_d PASSED\n"] * 2)
    result = summary.summary(2, ["test_a", "test_b", "test_c", "test_d"], str(tmp_path))
    assert [n for n, _ in result["passed"]] == ["test_a", "test_c", "test_d"]
    assert [n for n, _ in result["failed"]] == ["test_b"]
    assert summary.summary(2, ["test_e"], str(tmp_path))["failed"][0][1].startswith("rank 0: no outcome")

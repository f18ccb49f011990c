"""Outcomes of Horovod's tests run under mpirun by horovod_tests.sh: the summary, and what to run again.

    python scripts/horovod_tests_summary.py NP ID_FILE REPORT_DIR
    python scripts/horovod_tests_summary.py --rest NP LIST_FILE ATTEMPT_DIR

REPORT_DIR holds one folder per mpirun (an attempt), each with every rank's
``rank-R.log`` (pytest ``-v``, written unbuffered) and, where pytest got to
write it, ``rank-R.xml``. A rank's outcome of a test comes from its JUnit
report, or else from its log's ``-v`` line, so a rank that mpirun killed
still tells what it finished. A test's outcome is that of the last attempt
that ran it (a later attempt reruns what an earlier one could not finish):
passed if it passed on every rank, skipped if some rank skipped it and none
failed, failed otherwise, a rank without an outcome (killed, or cut off by
the bound, while it ran) included.

The first form prints the counts and each failing test with every failing
rank's first line of its message, and exits 1 if any test failed. ``--rest`` prints the ids of
LIST_FILE that come after its first test without a pass or skip on every
rank in ATTEMPT_DIR: pytest ran with ``-x``, so a test that fails on one rank
ends that attempt, and the rest run again in the next (nothing when all passed).
"""

import glob
import os
import re
import sys
import xml.etree.ElementTree as ET

_VERBOSE_LINE = re.compile(r"^\S*::(\S+) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b")
# As pytest's JUnit report counts them: an expected failure is a skip, an unexpected pass a pass.
_OUTCOME = {"PASSED": "passed", "XPASS": "passed", "SKIPPED": "skipped", "XFAIL": "skipped"}
_NO_OUTCOME = ("no outcome from this rank (it did not run the test, or was killed or cut off by the bound "
               "while it ran: see the attempt's rank and mpirun logs)")


def name_of(test_id):
    """``test_x`` of ``test_file.py::Class::test_x``: what reports and logs name a test by (pure)."""
    return test_id.rsplit("::", 1)[-1]


def from_junit(path):
    """{test name: (outcome, first line of the message)} from one JUnit file."""
    found = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome, message = "failed", (child.get("message") or "").splitlines()[0:1]
            elif child.tag == "skipped":
                outcome, message = "skipped", (child.get("message") or "").splitlines()[0:1]
        found[case.get("name")] = (outcome, message[0] if message else "")
    return found


def from_log(path):
    """{test name: (outcome, "")} from the ``-v`` lines of one rank's pytest log (pure but for the read)."""
    found = {}
    with open(path, errors="replace") as fh:
        for line in fh:
            match = _VERBOSE_LINE.match(line)
            if match:
                found[match.group(1)] = (_OUTCOME.get(match.group(2), "failed"), "")
    return found


def attempt_outcomes(directory, np_):
    """Each rank's {test name: (outcome, message)} in one attempt's folder: JUnit over the log's lines."""
    per_rank = []
    for rank in range(np_):
        found = {}
        log, xml = os.path.join(directory, f"rank-{rank}.log"), os.path.join(directory, f"rank-{rank}.xml")
        if os.path.exists(log):
            found.update(from_log(log))
        if os.path.exists(xml):
            try:
                found.update(from_junit(xml))
            except ET.ParseError:  # cut off while pytest wrote it: the log's lines stand
                pass
        per_rank.append(found)
    return per_rank


def verdict(results):
    """One test's ``(outcome, message)`` from every rank's ``(outcome, message)`` or None (pure)."""
    results = [r if r is not None else ("failed", _NO_OUTCOME) for r in results]
    failed = [f"rank {rank}: {m[:160]}" for rank, (o, m) in enumerate(results) if o == "failed"]
    if failed:
        return "failed", "; ".join(failed)
    if any(o == "skipped" for o, _ in results):
        return "skipped", next(m for o, m in results if o == "skipped")
    return "passed", ""


def rest(ids, per_rank):
    """The test ids after the first one without a pass or skip on every rank; [] when there is none (pure).

    Also [] when no rank has an outcome for any of ``ids``: nothing ran (mpirun
    or pytest did not start, an id was not found), and running the list again,
    one id shorter each time, would cost a start or a bound per test.
    """
    names = {name_of(test_id) for test_id in ids}
    if not any(names & set(r) for r in per_rank):
        return []
    for i, test_id in enumerate(ids):
        if verdict([r.get(name_of(test_id)) for r in per_rank])[0] == "failed":
            return ids[i + 1:]
    return []


def read_ids(path):
    with open(path) as fh:
        return [line.strip() for line in fh if "::" in line]


def summary(np_, names, directory):
    """{outcome: [(name, message)]} over every attempt under ``directory``, the last to run a test deciding."""
    last = {}
    for attempt in sorted(glob.glob(os.path.join(directory, "*", ""))):  # chunk-NNN.AAA: in the order they ran
        per_rank = attempt_outcomes(attempt, np_)
        for name in {n for r in per_rank for n in r}:
            last[name] = [r.get(name) for r in per_rank]
    result = {"passed": [], "failed": [], "skipped": []}
    for name in names:
        outcome, message = verdict(last.get(name, [None] * np_))
        result[outcome].append((name, message))
    return result


def main(argv):
    if len(argv) == 5 and argv[1] == "--rest":
        for test_id in rest(read_ids(argv[3]), attempt_outcomes(argv[4], int(argv[2]))):
            print(test_id)
        return 0
    if len(argv) != 4:
        print("usage: horovod_tests_summary.py NP ID_FILE REPORT_DIR | --rest NP LIST_FILE ATTEMPT_DIR",
              file=sys.stderr)
        return 2
    np_ = int(argv[1])
    names = [name_of(test_id) for test_id in read_ids(argv[2])]
    result = summary(np_, names, argv[3])
    print(f"np={np_}: {len(result['passed'])} passed, {len(result['failed'])} failed, "
          f"{len(result['skipped'])} skipped, of {len(names)}")
    for name, message in result["failed"]:
        print(f"  FAILED {name}: {message}")
    if os.environ.get("SHOW_SKIPPED"):
        for name, message in result["skipped"]:
            print(f"  skipped {name}: {message[:160]}")
    return 1 if result["failed"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

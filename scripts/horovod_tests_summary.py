"""Summarise the per-rank JUnit reports of one run of Horovod's tests (used by horovod_tests.sh).

    python scripts/horovod_tests_summary.py NP REPORT_DIR

A test passed if it passed on every rank, was skipped if any rank skipped it
(and none failed), and failed otherwise. Prints the counts and each failing
test with the first line of its message; exits 1 if any test failed or a
rank wrote no report.
"""

import glob
import os
import sys
import xml.etree.ElementTree as ET


def outcomes(path):
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


def main(argv):
    if len(argv) != 3:
        print("usage: horovod_tests_summary.py NP REPORT_DIR", file=sys.stderr)
        return 2
    np_, directory = argv[1], argv[2]
    reports = sorted(glob.glob(os.path.join(directory, "rank-*.xml")))
    per_rank = [outcomes(p) for p in reports]
    names = sorted(set().union(*per_rank)) if per_rank else []
    summary = {"passed": [], "failed": [], "skipped": []}
    for name in names:
        results = [r.get(name, ("failed", "no result on this rank")) for r in per_rank]
        failed = [m for o, m in results if o == "failed"]
        if failed:
            summary["failed"].append((name, failed[0]))
        elif any(o == "skipped" for o, _ in results):
            summary["skipped"].append((name, next(m for o, m in results if o == "skipped")))
        else:
            summary["passed"].append((name, ""))
    print(f"np={np_}: {len(summary['passed'])} passed, {len(summary['failed'])} failed, "
          f"{len(summary['skipped'])} skipped, of {len(names)} ({len(reports)} rank report(s))")
    for name, message in summary["failed"]:
        print(f"  FAILED {name}: {message[:160]}")
    if os.environ.get("SHOW_SKIPPED"):
        for name, message in summary["skipped"]:
            print(f"  skipped {name}: {message[:160]}")
    return 1 if summary["failed"] or len(reports) < int(np_) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

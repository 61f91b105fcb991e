"""One summary line from a pytest JUnit XML report: "<label>: <passed>/<run> passed, <skipped> skipped".

    python scripts/junit_summary.py REPORT.xml causality

`run` counts the tests that ran (skipped ones excluded), so a CPU machine that skips the CUDA-only
tests does not print "67/67 passed" as if they had run; the skipped count sits on the same line.
"""
from __future__ import annotations

import sys
import xml.etree.ElementTree as ET


def summary(report: str, label: str) -> str:
    root = ET.parse(report).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    skipped = sum(int(s.get("skipped", 0)) for s in suites)
    run = sum(int(s.get("tests", 0)) for s in suites) - skipped
    bad = sum(int(s.get("failures", 0)) + int(s.get("errors", 0)) for s in suites)
    return f"{label}: {run - bad}/{run} passed, {skipped} skipped"


if __name__ == "__main__":
    print(summary(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "tests"))

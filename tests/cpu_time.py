"""A pytest plugin that writes each test's wall and CPU time (`-p tests.cpu_time`, file in NSA_TEST_CPU_LOG):
the test's own process, the processes it started and waited for, and those the fork server forked for it
(tests/forkserver.py reaps them, so their CPU shows in the server's children's time). What docs/BENCHMARKS.md
"The test suite's time" is measured with: a test that waits (a monitor's interval, a timeout it proves) shows wall
without CPU; one that starts processes shows CPU the wall of two workers hides."""
from __future__ import annotations

import json
import os
import resource
import time

import pytest

TICK = os.sysconf("SC_CLK_TCK")


def _children_of(pid: int) -> float:
    """CPU seconds of the reaped children of process pid (cutime + cstime from /proc)."""
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[13]) + int(fields[14])) / TICK


def _cpu() -> tuple[float, float, float]:
    from tests import conftest

    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    server = conftest.FORKSERVER
    forked = _children_of(server.proc.pid) if server is not None else 0.0
    return me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime, forked


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    path = os.environ.get("NSA_TEST_CPU_LOG")
    if not path:
        yield
        return
    t0, c0 = time.monotonic(), _cpu()
    yield
    t1, c1 = time.monotonic(), _cpu()
    row = {"test": item.nodeid, "wall": round(t1 - t0, 3), "self": round(c1[0] - c0[0], 3),
           "children": round(c1[1] - c0[1], 3), "forked": round(c1[2] - c0[2], 3)}
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")

"""A pytest plugin that times each test's CPU, not only its wall clock.

On a machine shared with other jobs a test's wall time says more about the
other jobs than about the test: in this project's full runs on a loaded
2-core machine, tests that take 1.5-2 s alone were listed at 80-143 s.
The process CPU time of a test (every thread of the test process, user and
system) barely moves with the load, so it is what to compare before and
after a change to the tests. (Time spent in subprocesses the test starts,
the multi-worker tests' workers, is not counted.)

Usage (from the repository root; one process, so that nothing else of the
suite shares the test's process):

    PYTHONPATH=tools python -m pytest -p cpu_durations -n 0 tests/test_x.py

prints the 25 tests with the most CPU time (`KIP_CPU_TOP` sets how many)
and the total; with `KIP_CPU_LOG=path` every test's line is also written
there as `cpu_s wall_s nodeid`, in the order the tests ran.
"""

import os
import time

import pytest

_rows = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    wall, cpu = time.perf_counter(), time.process_time()
    yield
    _rows.append((time.process_time() - cpu, time.perf_counter() - wall, item.nodeid))


def pytest_terminal_summary(terminalreporter):
    if not _rows:
        return
    path = os.environ.get("KIP_CPU_LOG")
    if path:
        with open(path, "w") as log:
            log.writelines(f"{cpu:8.2f} {wall:8.2f} {nodeid}\n" for cpu, wall, nodeid in _rows)
    top = int(os.environ.get("KIP_CPU_TOP", "25"))
    write = terminalreporter.write_line
    terminalreporter.section(f"most CPU time ({len(_rows)} tests' calls)")
    write(f"{'cpu s':>8} {'wall s':>8}")
    for cpu, wall, nodeid in sorted(_rows, reverse=True)[:top]:
        write(f"{cpu:8.2f} {wall:8.2f} {nodeid}")
    write(f"{sum(r[0] for r in _rows):8.2f} {sum(r[1] for r in _rows):8.2f} in all")

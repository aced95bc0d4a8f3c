"""A pytest plugin for the GPU run scripts: each test's outcome is appended to $ATLAS_OUTCOMES_LOG
as it finishes ("passed 12.3 tests/...::test_x[id]"), so a run its time limit cuts short still
says what it finished (pytest's own summary comes only at the end).

    PYTHONPATH=benchmarks python3 -m pytest -p pytest_outcomes ...
"""

from __future__ import annotations

import os


def pytest_runtest_logreport(report) -> None:
    path = os.environ.get("ATLAS_OUTCOMES_LOG")
    if not path or not (report.when == "call" or report.outcome != "passed"):
        return  # a test's call, or a setup or teardown that failed or skipped it
    with open(path, "a") as log:
        log.write(f"{report.outcome} {report.duration:.1f} {report.nodeid}\n")

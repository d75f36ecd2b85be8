"""pytest plugin of bench/gpu_check.sh (``-p pytest_rows``, bench/ on the path): one CSV row per test
(test, phase, outcome, seconds) written as each test ends to ``$GPU_CHECK_ROWS`` (a :class:`common.RowLog`
partial file), so a test step stopped at its timeout still reports every test it finished."""
from __future__ import annotations

import os
from pathlib import Path

import common

_rows: common.RowLog | None = None


def pytest_configure(config) -> None:
    global _rows
    path = os.environ.get("GPU_CHECK_ROWS")
    _rows = common.RowLog(Path(path)) if path else None


def pytest_runtest_logreport(report) -> None:
    """The test's call, or the phase that ended it early (a skip or an error in setup or teardown)."""
    if _rows is not None and (report.when == "call" or report.outcome != "passed"):
        _rows.append({"test": report.nodeid, "phase": report.when, "outcome": report.outcome,
                      "seconds": round(report.duration, 3)})

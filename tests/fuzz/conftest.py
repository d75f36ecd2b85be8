"""Fixtures of the fuzz suite: one crash-isolated worker per session (``helpers.fuzz.runner``) and ``run_case``."""
from __future__ import annotations

import json

import pytest

from helpers.fuzz.runner import Worker, WorkerDied


@pytest.fixture(scope="session")
def fuzz_worker():
    worker = Worker()
    yield worker
    worker.close()


@pytest.fixture
def run_case(fuzz_worker):
    """Run one case in the worker and fail, naming the case, unless the verdict passes."""

    def run(case: dict) -> str:
        try:
            verdict = fuzz_worker.run(case)
        except WorkerDied as e:
            raise AssertionError(f"case {json.dumps(case)}: {e}") from None
        assert verdict["ok"], f"case {json.dumps(case)}: {verdict['detail']}"
        return verdict["detail"]

    return run

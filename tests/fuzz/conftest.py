"""Fuzz suite: hypothesis draws cases in pytest's process; a worker process runs them (``_runner``).

Budget: ``DFLASH_FUZZ_EXAMPLES`` unset is the CI run (each test's own small ``max_examples``, no shrinking: the
first failing case is reported as drawn); set to N, every test draws N cases and hypothesis shrinks a failure to
a minimal case (each shrink step that crashes restarts the worker, so this is for local hunting). Draws are
derandomized: the same cases every run, so a failure replays and a strict xfail stays failing until its fix.
"""
from __future__ import annotations

import json
import os

import pytest
from hypothesis import HealthCheck, Phase, settings

from _runner import Worker, WorkerDied

HUNT = int(os.environ.get("DFLASH_FUZZ_EXAMPLES", "0"))


def fuzz_settings(ci_examples: int):
    """Hypothesis settings of a fuzz test that draws ``ci_examples`` cases in CI."""
    phases = (Phase.explicit, Phase.generate) + ((Phase.shrink,) if HUNT else ())
    return settings(max_examples=HUNT or ci_examples, derandomize=True, database=None, deadline=None,
                    phases=phases, print_blob=False,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.function_scoped_fixture])


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

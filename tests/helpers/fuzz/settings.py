"""Hypothesis settings of the fuzz suite.

Budget: ``DFLASH_FUZZ_EXAMPLES`` unset is the CI run (each test's own ``max_examples``, no shrinking: the first
failing case is reported as drawn); set to N, every test draws N cases and hypothesis shrinks a failure to a minimal
case (each shrink step that crashes restarts the worker, so this is for local hunting). Draws are derandomized: the
same cases every run, so a failure replays and a strict xfail stays failing until its fix.
"""
from __future__ import annotations

import os

from hypothesis import HealthCheck, Phase, settings

HUNT = int(os.environ.get("DFLASH_FUZZ_EXAMPLES", "0"))


def fuzz_settings(ci_examples: int):
    """Hypothesis settings of a fuzz test that draws ``ci_examples`` cases in CI."""
    phases = (Phase.explicit, Phase.generate) + ((Phase.shrink,) if HUNT else ())
    return settings(max_examples=HUNT or ci_examples, derandomize=True, database=None, deadline=None,
                    phases=phases, print_blob=False,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.function_scoped_fixture])

"""Fuzz ``dflash.generate`` on tiny random pairs: random block sizes (including 0, past the cap and huge), tree
budgets, max_new_tokens, stop lists, prompts (including ids outside the vocabulary), NaN draft logits, fp32/bf16,
both runtimes and the CPU kernel backends. Each case runs in the crash-isolated worker and must raise a clean error
or return the target's greedy output (``helpers.fuzz.generate_case``)."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from helpers.fuzz.settings import fuzz_settings

pytestmark = pytest.mark.fuzz

KNOBS = dict(
    arch=st.sampled_from(["qwen3", "llama"]),
    layers=st.integers(1, 3),
    draft_block=st.sampled_from([4, 2, 8, 16]),
    prompt_len=st.integers(1, 12),
    max_new=st.integers(0, 24),
    stops=st.lists(st.one_of(st.integers(0, 47), st.sampled_from([-1, 48, 2**40])), max_size=3),
    nan_draft=st.booleans(),
    batch=st.integers(1, 3),
)
GROUPS = {
    # block sizes and budgets the runtime accepts, valid prompts
    "valid": dict(block_size=st.sampled_from([None, 1, 2, 3, 5, 8, 16]),
                  tree_budget=st.one_of(st.none(), st.integers(1, 64)), mutation=st.just("none")),
    # block sizes of 0, past the cap or huge; budgets of 0 or past 64; prompt ids outside the vocabulary
    "bad_args": dict(block_size=st.sampled_from([0, 65, 100_000, 10**9, None, 4]),
                     tree_budget=st.sampled_from([None, 0, 65, 7, 10**6]),
                     mutation=st.sampled_from(["none", "none", "none", "negative", "past_end", "huge"])),
    # block sizes past the cap, up to one that would need gigabytes: a clear error (or the lossless output)
    "big_block": dict(block_size=st.sampled_from([100_000, 65, 10**9]), tree_budget=st.none(),
                      mutation=st.just("none")),
}
RUNTIMES = {"reference": ["torch"], "fast": ["cpu", "torch"]}
EXAMPLES = {"valid": 25, "bad_args": 20, "big_block": 6}
KNOWN: dict[tuple[str, str, str], str] = {}


def _params():
    for runtime, kernels in RUNTIMES.items():
        for kernel in kernels:
            for group in GROUPS:
                key = (runtime, kernel, group)
                marks = [pytest.mark.xfail(strict=True, reason=KNOWN[key])] if key in KNOWN else []
                yield pytest.param(*key, id="-".join(key), marks=marks)


@pytest.mark.parametrize("runtime,kernel_backend,group", list(_params()))
def test_fuzz_generate(runtime, kernel_backend, group, run_case):
    strategy = st.fixed_dictionaries(dict(KNOBS, **GROUPS[group], op=st.just("generate"), path=st.just("public"),
                                          backend=st.just(kernel_backend), runtime=st.just(runtime),
                                          kernel_backend=st.just(kernel_backend), seed=st.integers(0, 2**31 - 1),
                                          dtype=st.sampled_from(["fp32", "fp32", "bf16"])))

    @fuzz_settings(EXAMPLES[group])
    @given(case=strategy)
    def check(case):
        run_case(case)

    check()

"""Greedy reference loop == the target's own greedy decoding, across block sizes, prompts,
limits, stop tokens and draft shapes (fp32, tiny random models)."""
from __future__ import annotations

import pytest
import torch

from dflash import generate

from helpers.tiny_models import as_oracle, make_draft, make_target


def target_greedy(target, ids, max_new, stops=None):
    kwargs = {"eos_token_id": stops} if stops else {}
    return target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                           **kwargs)


# (block_size, prompt_len, max_new_tokens, draft_layers, taps, layer_types, window)
CASES = [
    (1, 5, 9, 1, None, None, None),
    (2, 1, 1, 1, None, None, None),
    (2, 3, 2, 2, [0, 2, 3], None, None),
    (4, 17, 3, 1, None, None, None),  # max_new = B-1
    (4, 9, 4, 2, [1], None, None),  # max_new = B, one tap for two layers
    (4, 2, 5, 3, None, None, None),  # max_new = B+1
    (8, 33, 23, 2, [0, 3], ["sliding_attention", "full_attention"], 4),
    (16, 64, 40, 1, None, None, None),
    (16, 11, 16, 3, [3, 1], ["full_attention", "sliding_attention", "sliding_attention"], 6),
    (7, 6, 30, 2, None, None, None),
]


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}-P{c[1]}-N{c[2]}-L{c[3]}")
def test_greedy_matches_target(arch, case):
    block, prompt_len, max_new, layers, taps, layer_types, window = case
    target = make_target(arch)
    draft = make_draft(target, layers=layers, taps=taps, block_size=block,
                       layer_types=layer_types, sliding_window=window)
    ids = torch.randint(0, target.config.vocab_size, (1, prompt_len))
    expected = target_greedy(target, ids, max_new)
    assert expected.shape[1] == prompt_len + max_new

    # A random draft (accepts almost nothing) and an oracle-fed draft (accepts every length).
    plain = generate(target, draft, ids, max_new, backend="reference")
    assert torch.equal(plain.sequences, expected)
    as_oracle(draft).attach(expected[0, prompt_len:], prompt_len, corrupt=0.25, seed=prompt_len)
    result = generate(target, draft, ids, max_new, backend="reference")
    assert torch.equal(result.sequences, expected)
    assert sum(result.acceptance_lengths) == max_new - 1  # the prefill token is not a round's
    assert all(1 <= a <= block for a in result.acceptance_lengths)
    if block > 2 and max_new > 2 * block:
        assert max(result.acceptance_lengths) > 1, "oracle proposals were never accepted"


@pytest.mark.parametrize("stop_index", [0, 1, 5, 12])
def test_stop_tokens(stop_index):
    target = make_target("qwen3")
    draft = make_draft(target, layers=2, block_size=8)
    ids = torch.randint(0, target.config.vocab_size, (1, 9))
    free = target_greedy(target, ids, 20)[0, 9:]
    stop = int(free[stop_index])
    other = (stop + 1) % target.config.vocab_size
    expected = target_greedy(target, ids, 20, stops=[other, stop])
    as_oracle(draft).attach(free, 9, corrupt=0.2, seed=stop_index)
    result = generate(target, draft, ids, 20, stop_token_ids=[other, stop], backend="reference")
    assert torch.equal(result.sequences, expected)
    assert int(result.sequences[0, -1]) in (stop, other)
    assert sum(result.acceptance_lengths) == result.num_generated_tokens - 1


def test_spec_generate_and_timings():
    target = make_target("llama")
    draft = make_draft(target, layers=1, block_size=4)
    ids = torch.randint(0, target.config.vocab_size, (1, 6))
    out = draft.spec_generate(target, ids, max_new_tokens=10, stop_token_ids=None)
    assert torch.equal(out, target_greedy(target, ids, 10))
    result = generate(target, draft, ids[0], 10, backend="reference")
    assert result.sequences.shape == (1, 16)
    assert result.total_time >= result.prefill_time + result.draft_time + result.verify_time > 0
    assert sum(result.acceptance_lengths) == 9 and all(1 <= a <= 4 for a in result.acceptance_lengths)
    assert result.tau == 9 / len(result.acceptance_lengths)
    # an always-right draft: every proposal accepted, B tokens per round after the prefill token, τ = B
    expected = target_greedy(target, ids, 1 + 3 * 4)
    as_oracle(draft).attach(expected[0, 6:], 6, corrupt=0.0)
    oracle = generate(target, draft, ids, 1 + 3 * 4, backend="reference")
    assert torch.equal(oracle.sequences, expected)
    assert oracle.acceptance_lengths == [4, 4, 4] and oracle.tau == 4.0

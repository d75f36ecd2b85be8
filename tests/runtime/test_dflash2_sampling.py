"""Sampling with a DFlash2 draft is lossless: the selector samples its path from softmax(score / T) over each
position's candidates and the reference verifies with rejection sampling over that sparse distribution, so
outputs are distributed exactly as the target's own samples (chi-square against the exact marginals, with a
wrong-rule control that must fail)."""
from __future__ import annotations

import pytest
import torch

from dflash.config import DFlash2Settings
from dflash.sampling import SamplingParams, rejection_sample_candidates, sampling_probs

from test_dflash2_model import make_dflash2
from test_sampling import assert_lossless, assert_wrong_rule_fails, peaked_target


@pytest.fixture
def dflash2_pair():
    target = peaked_target()
    settings = DFlash2Settings(conv_kernel_size=2, conv_group_size=4, selector_rank=8, selector_top_k=2)
    draft = make_dflash2(target, block_size=4, settings=settings, layers=1, mask_token_id=3)
    return target, draft, torch.tensor([[1, 2, 0]])


def wrong_rejection_sample(logits, proposals, candidates, draft_q, sampling, generator=None):
    """Deliberately wrong: accept each proposal with probability p(d) (ignoring q), resample from p."""
    p = sampling_probs(logits[0], sampling.temperature, sampling.top_p, sampling.top_k)
    for j in range(proposals.shape[1]):
        if torch.rand((), generator=generator).item() >= float(p[j, proposals[0, j]]):
            return torch.tensor([j]), torch.multinomial(p[j], 1, generator=generator)
    return torch.tensor([proposals.shape[1]]), torch.multinomial(p[-1], 1, generator=generator)


@pytest.mark.slow
@pytest.mark.parametrize("temperature,top_p,top_k", [(1.0, 1.0, 0), (0.8, 0.9, 3)])
def test_dflash2_sampling_is_lossless(dflash2_pair, temperature, top_p, top_k):
    assert_lossless(dflash2_pair, temperature, top_p, top_k)


@pytest.mark.slow
def test_dflash2_wrong_rule_fails(dflash2_pair, monkeypatch):
    assert_wrong_rule_fails(dflash2_pair, monkeypatch, "rejection_sample_candidates", wrong_rejection_sample, 1000)


def test_rejection_over_candidates_exact_cases():
    """Accept when q(d) <= p(d); on rejection the residual max(p - q, 0) excludes what q over-proposed."""
    logits = torch.log(torch.tensor([[[0.5, 0.3, 0.2, 1e-9], [0.1, 0.6, 0.3, 1e-9], [0.25, 0.25, 0.25, 0.25]]]))
    candidates = torch.tensor([[[0, 1], [1, 2]]])
    sampling = SamplingParams(temperature=1.0)
    # q puts 0.4 <= p on both proposals: always accepted, bonus from the last row.
    accepted, _ = rejection_sample_candidates(logits, torch.tensor([[0, 1]]), candidates,
                                              torch.tensor([[[0.4, 0.6], [0.5, 0.5]]]), sampling)
    assert accepted.tolist() == [2]
    # q(1) = 1 at row 0 while p(1) = 0.3: rejected 70% of the time, and then never token 1.
    seen = set()
    for seed in range(200):
        accepted, bonus = rejection_sample_candidates(logits, torch.tensor([[1, 1]]), candidates,
                                                      torch.tensor([[[0.0, 1.0], [1.0, 0.0]]]), sampling,
                                                      torch.Generator().manual_seed(seed))
        if int(accepted) == 0:
            seen.add(int(bonus))
    assert seen and 1 not in seen and seen <= {0, 2}

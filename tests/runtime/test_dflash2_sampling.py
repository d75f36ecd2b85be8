"""Sampling with a DFlash2 draft is lossless in both runtimes: the selector samples its path from
softmax(score / T) over each position's candidates (``candidate_select``) and verification is rejection sampling
over that sparse distribution (``verify_sample`` with ``draft_probs`` / ``draft_indices``), so outputs are
distributed exactly as the target's own samples (chi-square against the exact marginals, with a wrong-rule control
that must fail). The engine draws as the reference runtime does (the ops' references, keyed by seed and round), so
on the "cpu" kernels both give the same tokens until the first block shortened by the length limit."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

import dflash.engine as engine_module
import dflash.reference as reference_module
from dflash import generate
from dflash.config import DFlash2Settings
from test_dflash2_model import VOCAB, make_dflash2
from test_sampling import (
    assert_lossless, assert_wrong_rule_fails, chi2_rejects, exact_target_distribution, peaked_target,
    wrong_verify_sample,
)
from helpers.tiny_models import make_target


@pytest.fixture
def dflash2_pair():
    target = peaked_target()
    settings = DFlash2Settings(conv_kernel_size=2, conv_group_size=4, selector_rank=8, selector_top_k=2)
    draft = make_dflash2(target, block_size=4, settings=settings, layers=1, mask_token_id=3)
    return target, draft, torch.tensor([[1, 2, 0]])


def verify_ignoring_q(logits, draft_tokens, *, draft_probs=None, draft_indices=None, **kwargs):
    """Deliberately wrong: test_sampling's wrong rule (accept d with probability p(d), resample from p keeping d),
    blind to the selector's q; the engine's tensor arguments read as the one value they hold."""
    host = {k: v.reshape(-1)[0].item() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    return wrong_verify_sample(logits, draft_tokens, **host)


@pytest.mark.slow
@pytest.mark.parametrize("backend,temperature,top_p,top_k", [
    ("reference", 1.0, 1.0, 0), ("reference", 0.8, 0.9, 3), ("fast", 1.0, 1.0, 0), ("fast", 0.8, 0.9, 3)])
def test_dflash2_sampling_is_lossless(dflash2_pair, backend, temperature, top_p, top_k):
    assert_lossless(dflash2_pair, temperature, top_p, top_k, backend)


@pytest.mark.slow
def test_dflash2_sampling_is_lossless_in_a_ragged_captured_batch(dflash2_pair):
    """The engine with emulated graphs on a ragged batch of two (the chi-square prompt and a longer one with its own
    limit): the first request's continuations still follow the target's exact marginals."""
    target, draft, ids = dflash2_pair
    other = torch.tensor([2, 0, 1, 3, 1, 2])
    n, temperature, top_p, top_k = 1000, 0.8, 0.9, 3
    counts = Counter()
    for i in range(n):
        out = generate(target, draft, [ids[0], other], [3, 5], temperature=temperature, top_p=top_p, top_k=top_k,
                       seed=i, backend="fast", use_cuda_graphs="emulate")
        counts[tuple(out.sequences[0][ids.shape[1]:].tolist())] += 1
    expected = exact_target_distribution(target, ids, 3, temperature, top_p, top_k)
    rejects, stat, crit = chi2_rejects(counts, expected, n)
    assert not rejects, (stat, crit)


@pytest.mark.slow
@pytest.mark.parametrize("backend,module", [("reference", reference_module), ("fast", engine_module)])
def test_dflash2_wrong_rule_fails(dflash2_pair, monkeypatch, backend, module):
    assert_wrong_rule_fails(dflash2_pair, monkeypatch, "verify_sample", verify_ignoring_q, 1000, module=module,
                            backend=backend)


@pytest.mark.parametrize("graphs", [None, "emulate"])
def test_engine_draws_as_the_reference(graphs):
    """Ragged batch of three on the engine's "cpu" kernels, sampled with top-k and top-p: each request equals its
    own reference run (same seed) round for round until the first round whose block the length limit shortens
    (the reference then draws fewer uniforms), and the engine's tokens are the same with emulated graphs."""
    target = make_target("qwen3")
    draft = make_dflash2(target, block_size=6)
    prompts = [torch.randint(0, VOCAB, (n,)) for n in (5, 9, 3)]
    limits = [40, 23, 31]
    kw = dict(temperature=0.9, top_p=0.95, top_k=20, block_size=6)
    compared = 0
    for r, prompt in enumerate(prompts):
        ref = generate(target, draft, prompt[None], limits[r], backend="reference", seed=100 + r, **kw)
        fast = generate(target, draft, prompt[None], limits[r], backend="fast", kernel_backend="cpu", seed=100 + r,
                        use_cuda_graphs=graphs, **kw)
        start, rounds = prompt.shape[0], 0
        for n in ref.acceptance_lengths:  # rounds of full blocks
            if start + 6 > prompt.shape[0] + limits[r]:
                break
            start, rounds = start + n, rounds + 1
        assert rounds >= 3 and fast.acceptance_lengths[:rounds] == ref.acceptance_lengths[:rounds]
        assert fast.sequences[0, :start + 1].tolist() == ref.sequences[0, :start + 1].tolist()
        compared += rounds
    assert compared >= 9
    batch = generate(target, draft, prompts, limits, backend="fast", kernel_backend="cpu", seed=7,
                     use_cuda_graphs=graphs, **kw)
    eager = generate(target, draft, prompts, limits, backend="fast", kernel_backend="cpu", seed=7, **kw)
    assert [s.tolist() for s in batch.sequences] == [s.tolist() for s in eager.sequences]
    assert [len(s) for s in batch.sequences] == [p.shape[0] + n for p, n in zip(prompts, limits)]
    assert all(s[:p.shape[0]].tolist() == p.tolist() for s, p in zip(batch.sequences, prompts))


@pytest.mark.slow  # the interpreter runs every kernel of the steps; the ops' own tests cover the Triton paths fast
def test_triton_kernels_sample_in_a_captured_step():
    """The engine on the Triton kernels (the selector's Philox draws, verify_sample's sparse path): a ragged batch
    of two, emulated graphs equal to eager with the same seed, every token a vocabulary id, each request its length;
    another seed draws other tokens."""
    target = make_target("qwen3")
    draft = make_dflash2(target, block_size=5)
    prompts = [torch.randint(0, VOCAB, (n,)) for n in (4, 7)]
    kw = dict(backend="fast", kernel_backend="triton", temperature=1.0, top_k=30, block_size=5)
    graphs = generate(target, draft, prompts, [8, 5], seed=5, use_cuda_graphs="emulate", **kw)
    eager = generate(target, draft, prompts, [8, 5], seed=5, **kw)
    assert [s.tolist() for s in graphs.sequences] == [s.tolist() for s in eager.sequences]
    assert [len(s) for s in graphs.sequences] == [12, 12]
    assert all(((s >= 0) & (s < VOCAB)).all() for s in graphs.sequences)
    other = generate(target, draft, prompts, [8, 5], seed=6, **kw)
    assert [s.tolist() for s in other.sequences] != [s.tolist() for s in eager.sequences]

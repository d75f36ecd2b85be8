"""Sampling is lossless: speculative outputs are distributed exactly as the target's samples."""
from __future__ import annotations

import itertools
import math
from collections import Counter

import pytest
import torch

import dflash.reference as reference_module
from dflash import generate
from dflash.sampling import sampling_probs
from helpers.tiny_models import make_draft, make_target

# Every sample here is drawn from fixed seeds (models: the test's seed, tests/conftest.py; draws: seed=i), so
# each statistic is the same on every run. The critical value sits at a false-rejection rate of about
# 1e-6, so a change that only reorders random draws (a correct rule) still passes, while each test's
# wrong-rule control below exceeds it by a wide margin.
Z_1E6 = 4.7534  # one-sided 1 - 1e-6 normal quantile


def chi2_critical(df: int, z: float = Z_1E6) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (slightly above the exact one at
    small df: 32.8 against 30.7 at df=3, z=4.75)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2_rejects(counts: Counter, expected: dict, n: int) -> tuple[bool, float, float]:
    """Pearson chi-square of observed counts against exact probabilities; cells with an
    expected count below 5 are pooled into one."""
    stat, pooled_obs, pooled_exp, cells = 0.0, 0, 0.0, 0
    for cell, p in expected.items():
        e = p * n
        if e < 5:
            pooled_obs += counts.get(cell, 0)
            pooled_exp += e
            continue
        stat += (counts.get(cell, 0) - e) ** 2 / e
        cells += 1
    unexpected = sum(c for cell, c in counts.items() if cell not in expected)
    pooled_obs += unexpected
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / max(pooled_exp, 1e-9)
        cells += 1
    critical = chi2_critical(cells - 1)
    return stat > critical, stat, critical


def wrong_verify_sample(logits, draft_tokens, *, temperature, top_k, top_p, seed, offset, backend):
    """Deliberately wrong: on rejection, resample from p without removing the rejected token."""
    generator = torch.Generator().manual_seed(seed * 1000 + offset)
    probs = sampling_probs(logits[0], temperature, top_p, top_k)
    for j in range(draft_tokens.shape[1]):
        d = int(draft_tokens[0, j])
        if torch.rand((), generator=generator).item() < float(probs[j, d]):
            continue
        return torch.tensor([j]), torch.multinomial(probs[j], 1, generator=generator)
    return torch.tensor([draft_tokens.shape[1]]), torch.multinomial(probs[-1], 1, generator=generator)


def test_sampling_probs_filters():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    p = sampling_probs(logits, 1.0, top_k=2)
    assert (p[0, 2:] == 0).all() and torch.allclose(p[0, :2], torch.softmax(logits[0, :2], -1))
    full = torch.softmax(logits, -1)[0]
    p = sampling_probs(logits, 1.0, top_p=float(full[0]) + 1e-3)  # needs the top two tokens
    assert (p[0, 2:] == 0).all() and p[0, 1] > 0
    p = sampling_probs(logits, 1.0, top_p=float(full[0]) - 1e-3)  # top token alone suffices
    assert p[0, 0] == 1
    torch.testing.assert_close(sampling_probs(logits, 0.5), torch.softmax(logits / 0.5, -1))


def exact_target_distribution(target, ids, steps, temperature, top_p, top_k):
    """Exact probability of every continuation of length ``steps`` under target-only sampling."""
    vocab = target.config.vocab_size
    dist = {}
    with torch.no_grad():
        for seq in itertools.product(range(vocab), repeat=steps):
            full = torch.cat([ids, torch.tensor([seq[:-1]], dtype=torch.long)], dim=1)
            logits = target(full).logits[0, ids.shape[1] - 1:]
            probs = sampling_probs(logits, temperature, top_p, top_k)
            dist[seq] = math.prod(float(probs[i, t]) for i, t in enumerate(seq))
    return dist


def sample_continuations(target, draft, ids, steps, n, temperature, top_p, top_k, backend="reference"):
    counts = Counter()
    for i in range(n):
        out = generate(target, draft, ids, steps, temperature=temperature, top_p=top_p, top_k=top_k, seed=i,
                       backend=backend)
        counts[tuple(out.sequences[0, ids.shape[1]:].tolist())] += 1
    return counts


def continuation_chi2(target, draft, ids, steps, n, temperature, top_p=1.0, top_k=0, backend="reference"):
    """Samples ``n`` continuations of ``steps`` tokens and tests them against the exact target marginals:
    returns (rejects, statistic, critical value)."""
    expected = exact_target_distribution(target, ids, steps, temperature, top_p, top_k)
    counts = sample_continuations(target, draft, ids, steps, n, temperature, top_p, top_k, backend)
    return chi2_rejects(counts, expected, n)


def peaked_target():
    """The tiny 4-token target of the chi-square tests, drawn from the test's seed (the same models on every run,
    so the statistics are reproducible)."""
    target = make_target("qwen3", vocab=4, layers=2, hidden=16)
    with torch.no_grad():
        target.lm_head.weight.mul_(8.0)  # far from uniform, yet every token stays likely
    return target


@pytest.fixture
def sampling_pair():
    target = peaked_target()
    draft = make_draft(target, layers=1, block_size=4, mask_token_id=3)
    ids = torch.tensor([[1, 2, 0]])
    return target, draft, ids


def assert_lossless(pair, temperature, top_p, top_k, backend="reference"):
    """1000 continuations of 3 tokens (the second and third from one verified block) of a (target, draft,
    ids) pair pass the chi-square test against the target's exact marginals."""
    target, draft, ids = pair
    rejects, stat, crit = continuation_chi2(target, draft, ids, 3, 1000, temperature, top_p, top_k, backend)
    assert not rejects, (stat, crit)


def assert_wrong_rule_fails(pair, monkeypatch, name, wrong_rule, n, module=reference_module, backend="reference"):
    """With ``module.<name>`` (the reference runtime's by default) replaced by a deliberately wrong rule, ``n``
    continuations of 3 tokens at temperature 1 on ``backend`` fail the chi-square test (the control that the test
    can fail)."""
    target, draft, ids = pair
    monkeypatch.setattr(module, name, wrong_rule)
    rejects, stat, crit = continuation_chi2(target, draft, ids, 3, n, 1.0, backend=backend)
    assert rejects, f"a wrong {name} passed the losslessness test ({stat} <= {crit})"


@pytest.mark.parametrize("backend,temperature,top_p,top_k", [
    ("reference", 1.0, 1.0, 0), ("reference", 0.8, 0.9, 3), ("fast", 0.8, 0.9, 3)])
def test_speculative_sampling_is_lossless(sampling_pair, backend, temperature, top_p, top_k):
    assert_lossless(sampling_pair, temperature, top_p, top_k, backend)


def test_wrong_rule_fails_end_to_end(sampling_pair, monkeypatch):
    assert_wrong_rule_fails(sampling_pair, monkeypatch, "verify_sample", wrong_verify_sample, 500)


def test_same_seed_same_tokens(sampling_pair):
    target, draft, ids = sampling_pair
    a = generate(target, draft, ids, 12, temperature=1.0, seed=7, backend="reference").sequences
    b = generate(target, draft, ids, 12, temperature=1.0, seed=7, backend="reference").sequences
    assert torch.equal(a, b)

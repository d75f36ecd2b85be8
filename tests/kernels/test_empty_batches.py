"""N = 0 requests / M = 0 rows: every op returns empty results (or writes nothing) without launching."""
import pytest
import torch

from dflash_kernels import draft_attention, inject_context_kv, verify_attention, verify_greedy, verify_sample

BACKENDS = ["torch", "triton"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_verify_empty(backend):
    logits = torch.randn(0, 4, 10)
    draft = torch.zeros(0, 3, dtype=torch.int64)
    for acc, tok in (verify_greedy(logits, draft, backend=backend),
                     verify_sample(logits, draft, temperature=1.0, seed=0, offset=0, backend=backend)):
        assert acc.shape == (0,) and tok.shape == (0,) and acc.dtype == torch.int64


@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_and_inject_empty(backend):
    d = 8
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    out = draft_attention(torch.randn(0, 3, 2, d), torch.randn(0, 3, 1, d), torch.randn(0, 3, 1, d),
                          torch.randn(0, 5, 1, d), torch.randn(0, 5, 1, d), torch.zeros(0, dtype=torch.int64),
                          torch.randn(d), torch.randn(d), inv_freq=inv, backend=backend)
    assert out.shape == (0, 3, 2, d)
    kc = torch.full((2, 5, 1, d), float("nan"))
    vc = kc.clone()
    out = verify_attention(torch.randn(0, 3, 2, d), torch.randn(0, 3, 1, d), torch.randn(0, 3, 1, d), kc, vc,
                           torch.zeros(0, dtype=torch.int64), inv_freq=inv, backend=backend)
    assert out.shape == (0, 3, 2, d) and torch.isnan(kc).all() and torch.isnan(vc).all()
    kc = torch.full((2, 5, 1, d), float("nan"))
    vc = kc.clone()
    inject_context_kv(torch.randn(0, 1, d), torch.randn(0, 1, d), torch.randn(d), torch.zeros(3, dtype=torch.int64),
                      torch.zeros(2, dtype=torch.int64), kc, vc, inv_freq=inv, backend=backend)
    assert torch.isnan(kc).all() and torch.isnan(vc).all()

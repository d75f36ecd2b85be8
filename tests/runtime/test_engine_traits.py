"""The engine picks its steps' paths by what the kernel backend offers (``dflash_kernels.backend_traits``), never
by the backend's name: the same backend given other traits takes the other paths, and greedy decoding still
gives the target's own tokens."""
from __future__ import annotations

import pytest
import torch

import dflash.engine as engine_module
from dflash import generate
from dflash_kernels import BackendTraits, _dispatch, backend_traits, default_backend
from helpers.tiny_models import make_draft, make_target

VOCAB = 6
CPU_TRAITS = BackendTraits(fused_gemm=False, argmax_head=True, host_eager=True)


def test_default_backend_and_the_cpu_traits():
    assert default_backend(torch.device("cuda")) == "auto"
    assert default_backend(torch.device("cpu")) == "cpu"
    assert default_backend(torch.device("meta")) == "torch"  # the traffic accountant: the references
    assert backend_traits("cpu") == CPU_TRAITS
    assert backend_traits("torch") == backend_traits("auto") == BackendTraits()
    with pytest.raises(ValueError, match="backend_traits: backend='gpu' is not one of"):
        backend_traits("gpu")


def _greedy(monkeypatch, traits: BackendTraits):
    """Greedy tokens of a fresh tiny pair on kernel backend "torch" with ``traits``, and the steps' op calls."""
    torch.manual_seed(7)
    target = make_target("qwen3", vocab=VOCAB)
    draft = make_draft(target, layers=2, block_size=4, mask_token_id=VOCAB - 1)
    monkeypatch.setitem(_dispatch._traits, "torch", traits)
    calls = []
    for name in ("fused_context", "verify_greedy", "verify_greedy_tokens"):
        real = getattr(engine_module, name)
        monkeypatch.setattr(engine_module, name, lambda *a, _n=name, _f=real, **k: calls.append(_n) or _f(*a, **k))
    prompts = [torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n)) for n in (3, 9)]
    out = generate(target, draft, prompts, [12, 15], backend="fast", kernel_backend="torch")
    return [seq.tolist() for seq in out.sequences], set(calls)


def test_the_engine_follows_the_traits_not_the_name(monkeypatch):
    """kernel_backend="torch" with the CPU's traits: the draft's context rows by the steps' linear and
    add_rms_norm (no fused_context), the greedy verify on the LM head's argmax tokens (verify_greedy_tokens);
    with torch's own traits, fused_context and verify_greedy. The tokens are the same (the target's greedy
    tokens either way)."""
    own, own_calls = _greedy(monkeypatch, BackendTraits())
    cpu_like, cpu_calls = _greedy(monkeypatch, CPU_TRAITS)
    assert own_calls == {"fused_context", "verify_greedy"}
    assert cpu_calls == {"verify_greedy_tokens"}
    assert own == cpu_like and len(own) == 2

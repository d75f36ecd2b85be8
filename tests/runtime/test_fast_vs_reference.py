"""The engine (backend "fast") equals the reference loop round for round: the same tokens AND the same
acceptance lengths, at and near ``max_length`` (where the reference drafts a shortened block), with
stop tokens, ragged batches and sliding-window drafts.

A 6-token vocabulary makes a random draft's proposals agree with the target often, so acceptance
lengths vary and a proposal that differs at the tail changes them (checked by the control test).
"""
from __future__ import annotations

import pytest
import torch

from dflash import generate
from dflash.engine import DFlashEngine
from helpers.tiny_models import make_draft, make_target

VOCAB = 6


def make_pair(block: int):
    arch = "qwen3" if block % 2 else "llama"
    target = make_target(arch, vocab=VOCAB)
    sliding = block % 3 == 0
    draft = make_draft(target, layers=2, block_size=block, mask_token_id=VOCAB - 1,
                       layer_types=["sliding_attention", "full_attention"] if sliding else None,
                       sliding_window=3 if sliding else None)
    return target, draft


def requests(block: int):
    """Ragged prompts and limits whose last rounds end at every offset from max_length."""
    prompts = [torch.randint(0, VOCAB, (n,)) for n in (3, 10, 17)]
    limits = [block + 1, 2 * block + 3, 3 * block - 1 if block > 1 else 5]
    return prompts, limits


def compare(target, draft, block):
    prompts, limits = requests(block)
    free = generate(target, draft, prompts[1], limits[1], backend="reference")
    stops = [[], [int(free.sequences[0, -2])], []]  # request 1 stops at (or before) its second-to-last token
    fast = generate(target, draft, prompts, limits, stop_token_ids=stops, backend="fast")
    mismatches = []
    for r, (p, m, s) in enumerate(zip(prompts, limits, stops)):
        ref = generate(target, draft, p, m, stop_token_ids=s, backend="reference")
        assert torch.equal(fast.sequences[r], ref.sequences[0]), (block, r)
        if fast.acceptance_lengths[r] != ref.acceptance_lengths:
            mismatches.append((r, fast.acceptance_lengths[r], ref.acceptance_lengths))
    return mismatches


@pytest.mark.parametrize("block", range(1, 17))
def test_tokens_and_acceptance_equal_reference(block):
    target, draft = make_pair(block)
    assert compare(target, draft, block) == []


def test_control_full_block_at_the_tail_changes_acceptance(monkeypatch):
    """The comparison above can fail: an engine that drafts all B rows at the tail (ignoring the
    shortened block) accepts differently from the reference for some pairs built the same way."""
    real = DFlashEngine.draft_step

    def full_block_draft_step(self):
        saved = self.max_lengths.clone()
        self.max_lengths.fill_(self.capacity + self.block_size)  # block_lens = B everywhere
        try:
            real(self)
        finally:
            self.max_lengths.copy_(saved)

    monkeypatch.setattr(DFlashEngine, "draft_step", full_block_draft_step)
    differing = [block for block in range(3, 17) if compare(*make_pair(block), block)]
    assert differing, "no pair distinguishes a full tail block from the reference's shortened one"


@pytest.mark.parametrize("block, tree_budget, bf16_values", [(2, None, False), (5, None, False), (8, None, False),
                                                              (16, None, False), (5, 9, False), (8, 17, False),
                                                              (8, None, True), (5, 9, True)])
def test_cpu_kernel_backend_equals_reference(monkeypatch, block, tree_budget, bf16_values):
    """The engine on the "cpu" kernel backend (what CPU users run when the Triton interpreter is off), with its
    native kernels (head_dim 16: the attention kernels apply), against the reference loop: the same tokens, ragged
    requests, chains and trees; the native attention, norm and SwiGLU kernels are seen to run. ``bf16_values``:
    every weight rounded to a bf16 value (as SmolLM2's are), so the projections take cpu_linear's AMX path and the
    greedy verify its argmax screen (the LM head's argmax without most logits)."""
    from dflash_kernels.cpu import linear as cpu_linear
    from dflash_kernels.cpu import native as cpu_native

    assert cpu_native.unavailable_reason() is None
    if bf16_values and not cpu_linear.amx_active():
        pytest.skip(f"{cpu_linear.amx_unavailable_reason()}")
    calls = {"block_attention": 0, "add_rms_norm": 0, "silu_mul": 0}
    if bf16_values:  # the projections, and the greedy verify's LM head argmax (cpu_linear.linear_argmax's screen)
        calls |= {"amx_linear": 0, "amx_argmax": 0}

    class Counted:  # torch.ops.dflash_cpu with the ops of `calls` counted
        def __init__(self, ops):
            self._ops = ops

        def __getattr__(self, name):
            fn = getattr(self._ops, name)
            if name not in calls:
                return fn

            def counted(*args, **kwargs):
                calls[name] += 1
                return fn(*args, **kwargs)
            return counted
    monkeypatch.setattr(cpu_native, "_ops", Counted(cpu_native._ops))
    if bf16_values:
        monkeypatch.setattr(cpu_linear, "_amx", Counted(cpu_linear._amx))
    target = make_target("qwen3" if block % 2 else "llama", vocab=VOCAB, hidden=64)
    draft = make_draft(target, layers=2, block_size=block, mask_token_id=VOCAB - 1)
    if bf16_values:
        with torch.no_grad():
            for p in [*target.parameters(), *draft.parameters()]:
                p.copy_(p.bfloat16().float())
    prompts, limits = requests(block)
    fast = generate(target, draft, prompts, limits, backend="fast", kernel_backend="cpu", tree_budget=tree_budget)
    for r, (p, m) in enumerate(zip(prompts, limits)):
        ref = generate(target, draft, p, m, backend="reference")
        assert torch.equal(fast.sequences[r], ref.sequences[0]), (block, tree_budget, r)
    assert all(calls.values()), calls

"""Fast runtime (static caches, kernel-backed steps, batches) == the target's own greedy decoding,
and == the reference runtime, on tiny random LLaMA/Qwen3 pairs."""
from __future__ import annotations

import os

import pytest
import torch

import dflash.engine as engine_module
from dflash import generate
from dflash.sampling import SamplingParams
from dflash.engine import DFlashEngine
from helpers.tiny_models import make_draft, make_target


def fast(*args, **kwargs):
    return generate(*args, backend="fast", **kwargs)


def target_greedy(target, ids, max_new, stops=None):
    ids = ids[None]
    kwargs = {"eos_token_id": stops} if stops else {}
    out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False, **kwargs)
    return out[0]


class OracleFast(DFlashEngine):
    """Real draft step, then its proposals replaced by each request's known continuation, corrupted
    at random, so that every acceptance length occurs in a batch."""

    oracle: list[torch.Tensor] = []
    prompt_lens: list[int] = []

    def draft_step(self):
        super().draft_step()
        proposals = self.proposals.clone()
        for r, cont in enumerate(self.oracle):
            base = int(self.positions[r]) + 1 - self.prompt_lens[r]
            for j in range(proposals.shape[1]):
                if 0 <= base + j < len(cont) and torch.rand(()) > 0.25:
                    proposals[r, j] = cont[base + j]
        self.proposals.copy_(proposals)


def run_oracle(monkeypatch, target, draft, prompts, limits, stops, block, **kw):
    OracleFast.oracle = [target_greedy(target, p, m)[len(p):] for p, m in zip(prompts, limits)]
    OracleFast.prompt_lens = [len(p) for p in prompts]
    monkeypatch.setattr(engine_module, "DFlashEngine", OracleFast)
    return fast(target, draft, prompts, limits, stop_token_ids=stops, block_size=block, **kw)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("block,layer_types,window", [
    (1, None, None),
    (2, None, None),
    (4, ["sliding_attention", "full_attention"], 3),
    (7, None, None),
    (16, ["full_attention", "sliding_attention"], 9),
])
def test_batch_greedy_matches_target(monkeypatch, arch, block, layer_types, window):
    target = make_target(arch)
    draft = make_draft(target, layers=2, block_size=block, layer_types=layer_types, sliding_window=window)
    vocab = target.config.vocab_size
    prompts = [torch.randint(0, vocab, (n,)) for n in (1, 17, 6, 40)]
    limits = [1, 9, 24, 30]
    free = [target_greedy(target, p, m)[len(p):] for p, m in zip(prompts, limits)]
    # Request 2 stops at a token its greedy continuation produces; request 3 has no stop token.
    stops = [[vocab - 1], [int(free[1][3])], [int(free[2][10])], []]
    expected = [target_greedy(target, p, m, s or None) for p, m, s in zip(prompts, limits, stops)]
    result = run_oracle(monkeypatch, target, draft, prompts, limits, stops, block)
    for r in range(4):
        assert torch.equal(result.sequences[r], expected[r]), r
        assert sum(result.acceptance_lengths[r]) == len(expected[r]) - len(prompts[r]) - 1
        assert all(1 <= a <= block for a in result.acceptance_lengths[r])
    if block > 2:
        assert max(max(a, default=1) for a in result.acceptance_lengths) > 1


def test_each_request_equals_running_alone():
    target = make_target("qwen3")
    draft = make_draft(target, layers=1, block_size=4)
    prompts = [torch.randint(0, 48, (n,)) for n in (3, 11, 7)]
    batched = fast(target, draft, prompts, 12)
    for p, seq in zip(prompts, batched.sequences):
        alone = generate(target, draft, p, 12, backend="reference")
        assert torch.equal(seq, alone.sequences[0])
        assert torch.equal(generate(target, draft, p, 12, backend="fast").sequences[0], seq)


def test_left_padded_batch_with_attention_mask():
    target = make_target("llama")
    draft = make_draft(target, block_size=4)
    a, b = torch.randint(0, 48, (5,)), torch.randint(0, 48, (8,))
    ids = torch.zeros(2, 8, dtype=torch.long)
    mask = torch.zeros(2, 8, dtype=torch.long)
    ids[0, 3:], mask[0, 3:] = a, 1
    ids[1], mask[1] = b, 1
    out = generate(target, draft, ids, 10, attention_mask=mask, backend="fast")
    assert torch.equal(out.sequences[0], target_greedy(target, a, 10))
    assert torch.equal(out.sequences[1], target_greedy(target, b, 10))


def test_triton_interpreter_path(monkeypatch):
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs the Triton kernels under the CPU interpreter")
    target = make_target("qwen3")
    draft = make_draft(target, layers=2, block_size=4, layer_types=["sliding_attention", "full_attention"],
                       sliding_window=3)
    prompts = [torch.randint(0, 48, (n,)) for n in (4, 9)]
    expected = [target_greedy(target, p, 8) for p in prompts]
    result = run_oracle(monkeypatch, target, draft, prompts, [8, 8], None, 4, kernel_backend="triton")
    for seq, exp in zip(result.sequences, expected):
        assert torch.equal(seq, exp)


def test_draft_step_matches_reference_draft():
    """The kernel-backed draft step proposes what the reference draft proposes."""
    target = make_target("qwen3")
    draft = make_draft(target, layers=2, block_size=8, layer_types=["full_attention", "sliding_attention"],
                       sliding_window=4)
    prompt = torch.randint(0, 48, (13,))
    engine = DFlashEngine(target, draft, batch=1, capacity=64, block_size=8)
    with torch.inference_mode():
        engine.reset([prompt], [20], [[]], SamplingParams(), 0)
        engine.draft_step()
        feats = target(prompt[None], output_hidden_states=True).hidden_states
        ctx = torch.cat([feats[i + 1] for i in draft.config.target_layer_ids], dim=-1)
        block = torch.full((1, 8), draft.config.mask_token_id)
        block[0, 0] = engine.anchor[0]
        hidden = draft(position_ids=torch.arange(21)[None], noise_embedding=target.model.embed_tokens(block),
                       target_hidden=ctx)
        expected = torch.argmax(draft.compute_logits(hidden[:, 1:], target.lm_head), dim=-1)
    assert torch.equal(engine.proposals, expected)


def test_sampling_reproducible_and_valid():
    target = make_target("qwen3", vocab=8)
    draft = make_draft(target, block_size=4, mask_token_id=3)
    ids = torch.randint(0, 8, (6,))
    a = fast(target, draft, ids, 16, temperature=0.9, top_k=5, top_p=0.95, seed=3)
    b = fast(target, draft, ids, 16, temperature=0.9, top_k=5, top_p=0.95, seed=3)
    assert torch.equal(a.sequences, b.sequences)
    assert a.sequences.shape[1] == 22 and sum(a.acceptance_lengths) == 15


def test_memory_is_stable_over_many_calls():
    target = make_target("qwen3")
    draft = make_draft(target, block_size=4)
    ids = torch.randint(0, 48, (5,))

    def rss_mb():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    for _ in range(10):
        fast(target, draft, ids, 8)
    before = rss_mb()
    for _ in range(100):
        fast(target, draft, ids, 8)
    assert rss_mb() - before < 20, "memory grew across generate calls"


def test_fast_bad_input():
    target = make_target("qwen3")
    draft = make_draft(target, block_size=4)
    ids = torch.randint(0, 48, (2, 5))
    with pytest.raises(ValueError, match="max_length"):
        fast(target, draft, ids[0], 40, max_length=32)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        fast(target, draft, ids[0], 600)
    with pytest.raises(ValueError, match="attention_mask"):
        fast(target, draft, ids, 4, attention_mask=torch.ones(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="left padding"):
        fast(target, draft, ids, 4, attention_mask=torch.tensor([[1, 0, 1, 1, 1], [1] * 5]))
    with pytest.raises(ValueError, match="max_new_tokens"):
        fast(target, draft, list(ids), [4, 4, 4])
    with pytest.raises(ValueError, match="vocabulary"):
        fast(target, draft, [ids[0], torch.tensor([1, 99])], 4)
    gpt2_like = make_target("qwen3")
    gpt2_like.config.model_type = "gpt2"
    with pytest.raises(TypeError, match="gpt2"):
        fast(gpt2_like, draft, ids[0], 4)
    # a failed call leaves nothing behind: the next call is correct
    assert torch.equal(fast(target, draft, ids[0], 6).sequences[0], target_greedy(target, ids[0], 6))


def test_engine_reused_and_weights_refreshed():
    target = make_target("qwen3")
    draft = make_draft(target, layers=2, block_size=4)
    ids = torch.randint(0, 48, (5,))
    first = fast(target, draft, ids, 8).sequences
    engine = engine_module.current_engine()
    assert torch.equal(fast(target, draft, ids, 8).sequences, first)
    assert engine_module.current_engine() is engine
    with torch.no_grad():
        draft.layers[1].self_attn.k_proj.weight.mul_(-1.5)
    changed = fast(target, draft, ids, 8).sequences
    assert engine_module.current_engine() is engine
    engine_module.clear_engine_cache()  # a fresh engine sees the changed weights: the reused one must too
    assert torch.equal(fast(target, draft, ids, 8).sequences, changed)
    engine = engine_module.current_engine()
    fast(target, draft, ids, 8, block_size=2)
    assert engine_module.current_engine() is not engine


def test_chunked_prefill_equals_one_pass():
    target = make_target("llama")
    draft = make_draft(target, layers=2, block_size=4)
    prompt = torch.randint(0, 48, (40,))
    engines = [DFlashEngine(target, draft, batch=1, capacity=64, block_size=4, prefill_chunk=c) for c in (7, 512)]
    with torch.inference_mode():
        for e in engines:
            e.reset([prompt], [8], [[]], SamplingParams(), 0)
    chunked, whole = engines
    assert torch.equal(chunked.anchor, whole.anchor)
    for a, b in ((chunked.k_cache, whole.k_cache), (chunked.v_cache, whole.v_cache),
                 (chunked.target.k_cache, whole.target.k_cache), (chunked.target.v_cache, whole.target.v_cache)):
        torch.testing.assert_close(a[:, :, :40], b[:, :, :40], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tree_budget", [None, 5])
def test_draft_in_another_dtype_than_the_target(tree_budget):
    """A bf16 draft on an fp32 target (the draft's dtype sets its caches and feature buffer; the prefill's context
    rows are cast to it too): still the target's greedy output."""
    target = make_target("llama")
    draft = make_draft(target, layers=2, block_size=4).to(torch.bfloat16)
    prompt = torch.randint(0, 48, (9,))
    out = fast(target, draft, prompt, 14, tree_budget=tree_budget)
    assert torch.equal(out.sequences[0], target_greedy(target, prompt, 14))

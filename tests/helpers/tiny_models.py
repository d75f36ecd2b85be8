"""Tiny random targets and drafts for runtime tests (fp32, CPU, offline)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from dflash import DFlashConfig, DFlashDraftModel

VOCAB = 48
HIDDEN = 32


def make_target(arch: str = "qwen3", *, vocab: int = VOCAB, layers: int = 4, hidden: int = HIDDEN):
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  tie_word_embeddings=False)
    if arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=hidden // 4, rope_theta=10000.0, **common))
    elif arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(rope_theta=500.0, **common))
    else:
        raise ValueError(arch)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def make_draft(target, *, layers: int = 1, taps: list[int] | None = None, block_size: int = 8,
               layer_types: list[str] | None = None, sliding_window: int | None = None,
               mask_token_id: int = 5, std: float = 0.2, **overrides) -> DFlashDraftModel:
    tcfg = target.config
    config = DFlashConfig(
        hidden_size=tcfg.hidden_size, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        head_dim=tcfg.hidden_size // 4, intermediate_size=48, num_target_layers=tcfg.num_hidden_layers,
        target_layer_ids=taps, block_size=block_size, mask_token_id=mask_token_id, layer_types=layer_types,
        sliding_window=sliding_window, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-6, **overrides,
    )
    draft = DFlashDraftModel(config)
    draft.reset_parameters(std=std)
    with torch.no_grad():  # non-trivial norm weights so that a wrong norm placement shows up
        for name, p in draft.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return draft.eval()


class OracleDraft(DFlashDraftModel):
    """A real draft whose proposals are replaced by a known continuation, corrupted at random.

    The draft forward still runs (caches, positions, masks are exercised); only its logits are
    replaced, so every acceptance length 0..B-1 occurs and the loop's bookkeeping is tested.
    """

    def attach(self, continuation: torch.Tensor, prompt_len: int, corrupt: float, seed: int = 0):
        self.continuation = continuation  # [n] the target's greedy tokens after the prompt
        self.prompt_len = prompt_len
        self.corrupt = corrupt
        self.rng = torch.Generator().manual_seed(seed)
        return self

    def forward(self, position_ids, *args, **kwargs):
        hidden = super().forward(position_ids, *args, **kwargs)
        q = hidden.shape[1]
        self._block_start = int(position_ids[0, -q])
        return hidden

    def compute_logits(self, hidden, output_head, linear=F.linear):
        logits = super().compute_logits(hidden, output_head, linear)
        vocab = logits.shape[-1]
        fake = torch.randn(logits.shape, generator=self.rng)
        for j in range(logits.shape[1]):
            idx = self._block_start + 1 + j - self.prompt_len  # index into the continuation
            if 0 <= idx < len(self.continuation) and torch.rand((), generator=self.rng) >= self.corrupt:
                fake[0, j, int(self.continuation[idx])] = 100.0
            else:
                fake[0, j, int(torch.randint(vocab, (), generator=self.rng))] = 100.0
        return fake.to(logits.dtype)


def as_oracle(draft: DFlashDraftModel) -> OracleDraft:
    draft.__class__ = OracleDraft
    return draft


@pytest.fixture
def qwen3_target():
    return make_target("qwen3")


@pytest.fixture
def llama_target():
    return make_target("llama")

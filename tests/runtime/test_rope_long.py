"""The draft's RoPE keeps fp32 frequencies and angles in every model dtype: at positions >= 32768 its cos/sin
equal transformers' Qwen3 rotary embedding (fp32 inv_freq and angles, cast to the model dtype at the end)."""
from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from dflash.draft import DraftModel
from helpers.tiny_models import make_draft, make_target

# Far positions, where a bf16 inv_freq (8 significant bits) moves the angle by radians.
POSITIONS = torch.tensor([[32768, 32769, 40961, 65535, 100003, 131071]])


def official_cos_sin(draft: DraftModel, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    cfg = draft.config
    rope = cfg.rope_parameters
    hf = Qwen3Config(head_dim=cfg.head_dim, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
                     rope_parameters=dict(rope), max_position_embeddings=cfg.max_position_embeddings)
    x = torch.zeros(1, POSITIONS.shape[1], cfg.head_dim, dtype=dtype)
    return Qwen3RotaryEmbedding(hf)(x, POSITIONS)


def _draft() -> DraftModel:
    return make_draft(make_target("qwen3"), layers=1, block_size=4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_from_pretrained_in_a_low_precision_dtype_keeps_fp32_frequencies(tmp_path, dtype):
    draft = _draft()
    draft.save_pretrained(tmp_path)
    loaded = DraftModel.from_pretrained(tmp_path, dtype=dtype)
    assert loaded.fc.weight.dtype == dtype
    rotary = loaded.rotary_emb
    cos, sin = rotary(POSITIONS, dtype)
    ref_cos, ref_sin = official_cos_sin(draft, dtype)
    assert cos.dtype == sin.dtype == dtype
    assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)
    assert rotary.inv_freq.dtype == torch.float32
    assert torch.equal(rotary.inv_freq, draft.rotary_emb.inv_freq)


@pytest.mark.parametrize("cast", [lambda m: m.to(torch.bfloat16), lambda m: m.bfloat16(), lambda m: m.half(),
                                  lambda m: m.to("cpu", torch.bfloat16).float()],
                         ids=["to-bf16", "bfloat16", "half", "bf16-and-back"])
def test_module_casts_keep_fp32_frequencies(cast):
    draft = _draft()
    expected = draft.rotary_emb.inv_freq.clone()
    rotary = cast(draft).rotary_emb
    for dtype in (torch.bfloat16, torch.float32):
        cos, sin = rotary(POSITIONS, dtype)
        ref_cos, ref_sin = official_cos_sin(draft, dtype)
        assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)
    assert rotary.inv_freq.dtype == torch.float32 and torch.equal(rotary.inv_freq, expected)

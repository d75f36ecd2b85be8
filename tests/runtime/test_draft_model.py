"""The draft forward equals a straightforward fp64 formulation written here from the z-lab spec:
explicit per-head loops, explicit masks, eager softmax."""
from __future__ import annotations

import math

import pytest
import torch

from dflash import DraftKVCache
from helpers.tiny_models import make_draft, make_target


def rms(x, w, eps):
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * w


def rope(x, pos, inv_freq):
    """x [n, D] at positions pos [n]: NeoX half rotation."""
    half = x.shape[-1] // 2
    ang = pos[:, None].double() * inv_freq[None, :].double()
    cos, sin = ang.cos(), ang.sin()
    x1, x2 = x[:, :half], x[:, half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def naive_draft(draft, noise, target_hidden, positions, allowed):
    """noise [q, H], target_hidden [C, T*H], positions [C+q]; allowed(layer, qi, kj) -> bool over
    key index kj in [0, C+q) for query qi in [0, q)."""
    cfg = draft.config
    sd = {k: v.double() for k, v in draft.state_dict().items()}
    eps = cfg.rms_norm_eps
    D, nh, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    inv_freq = 1.0 / (cfg.rope_parameters["rope_theta"] ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    ctx = rms(target_hidden.double() @ sd["fc.weight"].T, sd["hidden_norm.weight"], eps)
    h = noise.double()
    q_len, C = h.shape[0], ctx.shape[0]
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        x = rms(h, sd[p + "input_layernorm.weight"], eps)
        rows = torch.cat([ctx, x])
        out_heads = []
        for head in range(nh):
            kvh = head // (nh // nkv)
            sl_q = slice(head * D, (head + 1) * D)
            sl_k = slice(kvh * D, (kvh + 1) * D)
            q = rms(x @ sd[p + "self_attn.q_proj.weight"][sl_q].T, sd[p + "self_attn.q_norm.weight"], eps)
            k = rms(rows @ sd[p + "self_attn.k_proj.weight"][sl_k].T, sd[p + "self_attn.k_norm.weight"], eps)
            v = rows @ sd[p + "self_attn.v_proj.weight"][sl_k].T
            q = rope(q, positions[C:], inv_freq)
            k = rope(k, positions, inv_freq)
            scores = q @ k.T / math.sqrt(D)
            for qi in range(q_len):
                for kj in range(C + q_len):
                    if not allowed(i, qi, kj):
                        scores[qi, kj] = float("-inf")
            out_heads.append(torch.softmax(scores, dim=-1) @ v)
        h = h + torch.cat(out_heads, dim=-1) @ sd[p + "self_attn.o_proj.weight"].T
        y = rms(h, sd[p + "post_attention_layernorm.weight"], eps)
        gate = y @ sd[p + "mlp.gate_proj.weight"].T
        h = h + (torch.nn.functional.silu(gate) * (y @ sd[p + "mlp.up_proj.weight"].T)) @ sd[p + "mlp.down_proj.weight"].T
    return rms(h, sd["norm.weight"], eps)


def pypi_allowed(draft, C, q_len):
    def allowed(layer, qi, kj):
        causal = draft.config.layer_is_causal(layer)
        window = draft.config.layer_window(layer)
        qpos = C + qi
        if causal and kj > qpos:
            return False
        if window is not None and (qpos - kj >= window or (not causal and kj - qpos >= window)):
            return False
        return True

    return allowed


@pytest.mark.parametrize("layer_types,window,is_causal", [
    (None, None, None),
    (["sliding_attention", "full_attention"], 5, None),
    (None, None, True),
])
@pytest.mark.parametrize("context_len", [1, 13])
def test_draft_forward_matches_naive(layer_types, window, is_causal, context_len):
    target = make_target("qwen3")
    draft = make_draft(target, layers=2, taps=[0, 2, 3], layer_types=layer_types, sliding_window=window,
                       is_causal=is_causal)
    q_len, H = 7, draft.config.hidden_size
    noise = torch.randn(q_len, H)
    target_hidden = torch.randn(context_len, 3 * H)
    start = 40  # context rows at absolute positions start-C .. start-1, block at start ..
    positions = torch.arange(start - context_len, start + q_len)
    expected = naive_draft(draft, noise, target_hidden, positions, pypi_allowed(draft, context_len, q_len))
    out = draft(position_ids=positions[None], noise_embedding=noise[None], target_hidden=target_hidden[None])
    torch.testing.assert_close(out[0].double(), expected, rtol=1e-4, atol=1e-4)


def test_cache_split_equals_one_call():
    """Context injected over two calls through the cache equals one call with all context rows."""
    target = make_target("llama")
    draft = make_draft(target, layers=2)
    H, T = draft.config.hidden_size, draft.config.num_taps
    ctx = torch.randn(1, 11, T * H)
    noise = torch.randn(1, 4, H)
    full = draft(position_ids=torch.arange(15)[None], noise_embedding=noise, target_hidden=ctx)
    cache = DraftKVCache()
    draft(position_ids=torch.arange(0, 10)[None], noise_embedding=noise, target_hidden=ctx[:, :6],
          past_key_values=cache)
    cache.crop(6)
    split = draft(position_ids=torch.arange(6, 15)[None], noise_embedding=noise, target_hidden=ctx[:, 6:],
                  past_key_values=cache)
    torch.testing.assert_close(split, full, rtol=1e-5, atol=1e-5)
    assert cache.get_seq_length() == 15

"""A lean LLaMA/Qwen3 decoder forward over a Hugging Face model's own modules (no weight copy),
with a static, preallocated KV cache and per-request lengths read from device memory.

Why not HF's forward: a ragged batch whose requests accept different numbers of tokens needs
per-request cache lengths, rollback by simply not advancing a length, static shapes for CUDA-graph
capture, and the tapped layers written straight into a buffer. Everything else (norms, rotary
embedding incl. rope scaling, projections, MLP) is HF's own module code.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from dflash.target import check_target

LEAN_MODEL_TYPES = ("llama", "qwen3")


def check_lean_target(model) -> None:
    check_target(model)
    cfg = model.config
    if cfg.model_type not in LEAN_MODEL_TYPES:
        raise TypeError(
            f"target: backend='fast' supports {LEAN_MODEL_TYPES} targets, got model_type {cfg.model_type!r}; "
            "use backend='reference'"
        )
    if getattr(cfg, "use_sliding_window", False) and getattr(cfg, "sliding_window", None):
        raise TypeError("target: sliding-window targets are not supported by backend='fast'; use backend='reference'")


class LeanTarget:
    """Static-cache forward of a causal LM for ``batch`` requests of at most ``capacity`` tokens."""

    def __init__(self, model, layer_ids: Sequence[int], *, batch: int, capacity: int):
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        check_lean_target(model)
        self.model = model
        self.apply_rope = apply_rotary_pos_emb
        self.layer_ids = list(layer_ids)
        cfg = model.config
        first = model.model.layers[0].self_attn
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = first.head_dim
        weight = model.lm_head.weight
        shape = (len(model.model.layers), batch, capacity, self.num_kv_heads, self.head_dim)
        self.k_cache = torch.zeros(shape, dtype=weight.dtype, device=weight.device)
        self.v_cache = torch.zeros_like(self.k_cache)
        self.capacity = capacity

    def forward(self, input_ids: torch.Tensor, start: torch.Tensor, kv_bound: int,
                rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run ``q`` new tokens per request.

        Args:
            input_ids: [N, q] tokens at positions ``start[n] + 0..q-1``.
            start: [N] int64 on the device: cached tokens per request (= position of the first new token).
            kv_bound: host-side upper bound on ``start + q`` over requests (static per call site, no sync).
            rows: [N] int64 cache rows of the requests (default 0..N-1).
        Returns:
            logits [N, q, V] and the tapped features [N, q, T*H] (None when there are no taps).
        """
        model = self.model
        n, q = input_ids.shape
        device = input_ids.device
        if rows is None:
            rows = torch.arange(n, device=device)
        offsets = torch.arange(q, device=device)
        positions = start[:, None] + offsets  # [N, q]
        keys = torch.arange(kv_bound, device=device)
        mask = (keys[None, None, :] <= positions[:, :, None])[:, None]  # [N, 1, q, kv_bound]
        h = model.model.embed_tokens(input_ids)
        cos, sin = model.model.rotary_emb(h, positions)
        taps: dict[int, torch.Tensor] = {}
        wanted = set(self.layer_ids)
        for li, layer in enumerate(model.model.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            qh = attn.q_proj(x).view(n, q, self.num_heads, self.head_dim)
            kh = attn.k_proj(x).view(n, q, self.num_kv_heads, self.head_dim)
            vh = attn.v_proj(x).view(n, q, self.num_kv_heads, self.head_dim)
            if hasattr(attn, "q_norm"):  # Qwen3: per-head RMSNorm before RoPE
                qh, kh = attn.q_norm(qh), attn.k_norm(kh)
            qh, kh = self.apply_rope(qh.transpose(1, 2), kh.transpose(1, 2), cos, sin)
            self.k_cache[li][rows[:, None], positions] = kh.transpose(1, 2)
            self.v_cache[li][rows[:, None], positions] = vh
            k_all = self.k_cache[li][rows, :kv_bound].transpose(1, 2)
            v_all = self.v_cache[li][rows, :kv_bound].transpose(1, 2)
            out = F.scaled_dot_product_attention(qh, k_all, v_all, attn_mask=mask, scale=attn.scaling,
                                                 enable_gqa=self.num_heads != self.num_kv_heads)
            h = h + attn.o_proj(out.transpose(1, 2).reshape(n, q, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
            if li in wanted:
                taps[li] = h
        logits = model.lm_head(model.model.norm(h))
        features = torch.cat([taps[i] for i in self.layer_ids], dim=-1) if self.layer_ids else None
        return logits, features

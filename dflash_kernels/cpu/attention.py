"""The CPU bodies of ``draft_attention`` and ``verify_attention``: the references' formula (same ops, same SDPA
call, so the same bits) with the per-request Python work cut, and the native block attention where it applies."""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from dflash_kernels._dispatch import register
from dflash_kernels._triton_utils import rms_norm_reference
from dflash_kernels.cpu import native as cpu_native
from dflash_kernels.cpu.rope import rope_tables_cpu
from dflash_kernels.draft_attention import (
    OP, VERIFY_OP, _block_mask, draft_attention_reference, verify_attention_reference,
)


@functools.lru_cache(maxsize=4)
def _block_mask_shared(c: int, live: int, b: int, nb: int, causal: bool, sliding_window, device,
                       dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_block_mask`, built once for the layers of a forward (same lengths; only read by the callers), and
    as SDPA's additive mask in ``dtype`` (0 / -inf): CPU SDPA turns a bool mask into exactly that on every
    call (the same output bits, tested), a third of its time at 8 block rows."""
    mask = _block_mask(c, live, b, nb, causal, sliding_window, device)
    return mask, _additive_mask(mask, dtype)


def _additive_mask(mask: torch.Tensor, dtype) -> torch.Tensor:
    """A bool attention mask as SDPA's additive mask in ``dtype`` (0 where visible, -inf elsewhere): what CPU SDPA
    turns a bool mask into on every call, so passing this instead gives the same output bits."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


# (lens, valid, b, capacity, dtype, a copy of tree_mask, masks) of the last _tree_masks call, replaced whole.
_tree_mask_memo: list = [None]


def _tree_masks(tree_mask, lens, valid, b, capacity, dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per request, the tree's bool mask over [context, valid block rows] (query i sees the context and the block
    keys j whose bit ``j % 64`` of word ``j // 64`` of ``tree_mask[n, i]`` is set) and the same as SDPA's additive
    mask in ``dtype`` (0 / -inf; CPU SDPA converts a bool mask into exactly that on every call). The layers of
    a forward share the tree: the last masks are kept and reused while the lengths and the mask's values (a
    few words, compared whole: an inference tensor has no version counter) are the same."""
    key = (tuple(lens), tuple(valid), b, capacity, dtype)
    last = _tree_mask_memo[0]
    if last is not None and last[0] == key and torch.equal(last[1], tree_mask):
        return last[2]
    bit = torch.arange(b, device=tree_mask.device)
    block = ((tree_mask[:, :, bit // 64] >> (bit % 64)) & 1).bool()      # [N, B, B]
    masks = []
    for r in range(len(lens)):
        c, nb = min(int(lens[r]), capacity), int(valid[r])
        mask = torch.cat([torch.ones(b, c, dtype=torch.bool, device=tree_mask.device), block[r, :, :nb]], 1)
        masks.append((mask, _additive_mask(mask, dtype)))
    _tree_mask_memo[0] = (key, tree_mask.clone(), masks)
    return masks


def _norm_rope_qk(q, k, q_weight, k_weight, cos, sin_signed, eps):
    """``_norm_rope_reference`` of q and k (each with its own norm weight, or none) with their heads side by
    side, so the RoPE is one pass (the same values per element; rotate_half as one roll); q [R, nH, D],
    k [R, kvH, D], tables [R, D] -> [R, nH + kvH, D]."""
    if q_weight is not None:
        q = rms_norm_reference(q, q_weight, eps)
    if k_weight is not None:
        k = rms_norm_reference(k, k_weight, eps)
    x = torch.cat([q, k], 1)
    return x * cos[:, None, :] + x.roll(x.shape[-1] // 2, -1) * sin_signed[:, None, :]


def _attention(q, k, v, k_cache, v_cache, cache_lens, q_norm_weight, k_norm_weight, inv_freq, attention_scaling,
                   eps, scale, sliding_window, causal, cache_batch_idx, block_lens, write_kv, tree_depths=None,
                   tree_mask=None):
    """Both ops on a contiguous cache: the references' formula (same ops, same SDPA
    call, so the same bits), with the per-request Python cut: one RoPE table and one q/k norm + RoPE for all
    requests, the cache rows written by slicing, the block keys read from the cache rows just written (no
    concatenation), and no mask where every key is visible. A tree (``verify_attention``'s ``tree_depths`` and
    ``tree_mask``) takes its positions from the depths and its block mask from the ancestor bits, unpacked once
    for all requests. Reads the lengths on the host. fp32 without a window runs ``cpu_native.block_attention``
    where it applies (the same tables; within the 2x rule, not the same bits)."""
    causal = (sliding_window is not None) if causal is None else causal
    n, b, nh, d = q.shape
    kvh = k.shape[2]
    if n == 0:
        return torch.empty((n, b, nh, d), dtype=q.dtype, device=q.device)
    lens = cache_lens.tolist()
    rows = cache_batch_idx.tolist() if cache_batch_idx is not None else None
    block_rows = block_lens.tolist() if block_lens is not None else None
    cos, sin_signed = rope_tables_cpu(lens, b, inv_freq, attention_scaling, q.dtype, tree_depths)
    if sliding_window is None:
        native = cpu_native.block_attention(q, k, v, k_cache, v_cache, lens, rows, q_norm_weight, k_norm_weight, eps,
                                            d ** -0.5 if scale is None else scale, cos, sin_signed, causal=causal,
                                            write_kv=write_kv, block_lens=block_rows, tree_mask=tree_mask)
        if native is not None:
            return native
    out = torch.empty((n, b, nh, d), dtype=q.dtype, device=q.device)
    cache_rows = rows if rows is not None else range(n)
    valid = block_rows if block_rows is not None else [b] * n
    qk = _norm_rope_qk(q.reshape(n * b, nh, d), k.reshape(n * b, kvh, d), q_norm_weight, k_norm_weight, cos,
                           sin_signed, eps).view(n, b, nh + kvh, d)
    qn, kn = qk[:, :, :nh], qk[:, :, nh:]
    capacity = k_cache.shape[1]
    # Every query sees a key unless a window can hide them all (the reference's masked_fill); with one block
    # row, or neither causality nor a window, no key is hidden at all and SDPA takes no mask.
    unmasked = sliding_window is None and (not causal or b == 1) and tree_mask is None
    if tree_mask is not None:
        tree_masks = _tree_masks(tree_mask, lens, valid, b, capacity, q.dtype)
    scale = d ** -0.5 if scale is None else scale
    for r in range(n):
        c, nb, row = min(int(lens[r]), capacity), int(valid[r]), int(cache_rows[r])
        end = min(c + b, capacity)
        if write_kv and end > c:
            k_cache[row, c:end] = kn[r, :end - c].to(k_cache.dtype)
            v_cache[row, c:end] = v[r, :end - c].to(v_cache.dtype)
        if write_kv and c + nb <= capacity and k_cache.dtype == q.dtype:
            keys, vals = k_cache[row, :c + nb], v_cache[row, :c + nb]
        else:
            keys = torch.cat([k_cache[row, :c].to(q.dtype), kn[r, :nb]], 0)
            vals = torch.cat([v_cache[row, :c].to(q.dtype), v[r, :nb]], 0)
        mask = sdpa_mask = None
        if tree_mask is not None:
            mask, sdpa_mask = tree_masks[r]
        elif not unmasked:
            mask, sdpa_mask = _block_mask_shared(int(lens[r]), c, b, nb, causal, sliding_window, q.device, q.dtype)
        o = F.scaled_dot_product_attention(qn[r].transpose(0, 1)[None], keys.transpose(0, 1)[None],
                                           vals.transpose(0, 1)[None],
                                           attn_mask=None if mask is None else sdpa_mask[None, None], scale=scale,
                                           enable_gqa=kvh != nh)[0].transpose(0, 1)
        if sliding_window is not None:
            o = o.masked_fill(~mask.any(1)[:, None, None], 0)
        out[r] = o
    return out


@register(OP, "cpu")
def draft_attention_cpu(q, k, v, k_cache, v_cache, cache_lens, q_norm_weight, k_norm_weight, inv_freq,
                        attention_scaling, eps, sliding_window, causal, block_table, cache_batch_idx, block_lens,
                        num_splits, max_context_len):
    """``draft_attention`` on CPU tensors: :func:`_attention` on a contiguous cache, the reference on a paged one
    (which has no ``cache_batch_idx``)."""
    if block_table is None:
        return _attention(q, k, v, k_cache, v_cache, cache_lens, q_norm_weight, k_norm_weight, inv_freq,
                          attention_scaling, eps, None, sliding_window, causal, cache_batch_idx, block_lens,
                          write_kv=False)
    return draft_attention_reference(q, k, v, k_cache, v_cache, cache_lens, q_norm_weight, k_norm_weight,
                                     inv_freq=inv_freq, attention_scaling=attention_scaling, eps=eps,
                                     sliding_window=sliding_window, causal=causal, block_table=block_table,
                                     block_lens=block_lens)


@register(VERIFY_OP, "cpu")
def verify_attention_cpu(q, k, v, k_cache, v_cache, cache_lens, q_norm_weight, k_norm_weight, inv_freq,
                         attention_scaling, eps, scale, block_table, cache_batch_idx, num_splits, max_context_len,
                         tree_depths, tree_mask):
    """``verify_attention`` on CPU tensors: :func:`_attention` on a contiguous cache, the reference on a paged
    one (which has no ``cache_batch_idx``)."""
    if block_table is None:
        return _attention(q, k, v, k_cache, v_cache, cache_lens, q_norm_weight, k_norm_weight, inv_freq,
                          attention_scaling, eps, scale, None, True, cache_batch_idx, None, write_kv=True,
                          tree_depths=tree_depths, tree_mask=tree_mask)
    return verify_attention_reference(q, k, v, k_cache, v_cache, cache_lens, q_norm_weight, k_norm_weight,
                                      inv_freq=inv_freq, attention_scaling=attention_scaling, eps=eps, scale=scale,
                                      block_table=block_table, tree_depths=tree_depths, tree_mask=tree_mask)

"""The CPU body of ``inject_context_kv``: the native kernel for fp32 rows into a contiguous cache, else the
reference."""
from __future__ import annotations

import torch

from dflash_kernels._dispatch import register
from dflash_kernels.cpu import native as cpu_native
from dflash_kernels.cpu.rope import rope_tables_cpu
from dflash_kernels.inject_context_kv import OP, inject_context_kv_reference


def _inject_native(k, v, k_norm_weight, cu_ctx_lens, cache_lens, k_cache, v_cache, inv_freq, attention_scaling,
                   eps, block_table, cache_batch_idx) -> bool:
    """``cpu_native.inject_context_kv`` (the rows' RoPE tables from ``rope_tables_cpu``, shared with the draft
    step's attention) for fp32 rows into a contiguous cache; False where it does not apply (the reference then
    runs)."""
    if block_table is not None:
        return False
    cu = cu_ctx_lens.tolist()
    counts = [b - a for a, b in zip(cu, cu[1:])]
    if not counts or min(counts) < 0 or cu[0] != 0:
        return False
    lens = cache_lens.tolist()
    rows = cache_batch_idx.tolist() if cache_batch_idx is not None else None
    cos, sin_signed = rope_tables_cpu(lens, counts, inv_freq, attention_scaling, torch.float32)
    return cpu_native.inject_context_kv(k, v, k_norm_weight, eps, cu, lens, rows, cos, sin_signed, k_cache, v_cache)


@register(OP, "cpu")
def inject_context_kv_cpu(k, v, k_norm_weight, cu_ctx_lens, cache_lens, k_cache, v_cache, inv_freq, attention_scaling,
                          eps, block_table, cache_batch_idx, slot_mapping) -> None:
    """``inject_context_kv`` on CPU tensors: :func:`_inject_native` where it applies, else the reference."""
    if slot_mapping is None and _inject_native(k, v, k_norm_weight, cu_ctx_lens, cache_lens, k_cache, v_cache,
                                               inv_freq, attention_scaling, eps, block_table, cache_batch_idx):
        return
    inject_context_kv_reference(k, v, k_norm_weight, cu_ctx_lens, cache_lens, k_cache, v_cache, inv_freq=inv_freq,
                                attention_scaling=attention_scaling, eps=eps, block_table=block_table,
                                cache_batch_idx=cache_batch_idx, slot_mapping=slot_mapping)

"""draft_attention and verify_attention: the B block rows of each request attend to [cached context ++ the
block's own keys]. One kernel (split-KV with the merge done by the last split of each request and KV head to
finish, constexpr feature flags):

* ``draft_attention``: a DFlash draft layer; the block's K/V stay in registers, nothing is written.
* ``verify_attention``: a target layer of the verify step; causal inside the block, optional q/k norm, and
  the block's normed + rotated K rows and raw V rows are written into the cache at rows ``cache_lens[n] + i``.
  With a draft tree (``tree_depths``, ``tree_mask``) the block rows sit at their depths and see their
  ancestors only.

Cost contract of one call (``bench/traffic.py`` models it; ``active_splits``, ``partial_slots`` and
``pick_max_splits`` are the split rule). Per request, ``live`` = context rows read: ``min(cache_lens[n],
capacity)``, and with a sliding window only the last ``W - 1`` of them; ``S`` = the grid's maximum split count,
``A = active_splits(live, S)``; element sizes ``e`` (q's dtype) and ``c`` (the cache's):

* launches: 1; none when N = 0.
* bytes: the live context K/V rows read once, ``2 * live * kvH * D * c``; q, k, v of the block read once and
  the output written once (q's dtype); verify only: the B new K and V rows written, ``2 * B * kvH * D * c``
  (rows past the capacity are dropped); fp32 partials of ``P = partial_slots(live, S)`` = A - 1 splits (the
  last split to finish merges them with its own state, from registers) written once and read once,
  ``2 * P * B * nH * (D + 2) * 4``, and with A > 1 the request's ``kvH`` pairs of int32 merge counters read
  and written once, ``2 * kvH * 2 * 4``; plus the small vectors (cache_lens, block_lens, norm weights,
  inv_freq, the table entries used; a tree's depths and ancestor mask).
* FLOPs: ``4 * B * nH * D * (live + B)`` (QK^T and PV; the masked part of the block is counted in full).
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from dflash_kernels._dispatch import (
    call_op, checked_by, lean_version_bump, registered, resolve_backend, unobserved_eager,
)
from dflash_kernels._triton_utils import (
    FLOAT_DTYPES, check_cache_index_values, check_cache_pair, check_index_values, check_last_dim_contiguous,
    check_tensor, interpreting, next_pow2, norm_rope_halves,
    page_table, rms_norm_reference, rope_cos_sin, rope_cos_sin_reference, rotate_half,
)

OP = "draft_attention"
VERIFY_OP = "verify_attention"
_BACKENDS = ("triton", "torch")  # and the wings' registered bodies (dflash_kernels.cpu)
_LOG2E = 1.4426950408889634

# The floor of context rows per active split (A = cdiv(live, MIN_CHUNK) capped by the grid, whose split count
# follows the SM count: ``pick_max_splits``). Qwen3-8B (kvH 8) at batch 1 and 2k context runs 8 splits per KV
# head, 64 programs, where a 1024-row floor left 2 (16 programs, 116 of 132 SMs idle). The price is the partials: when A > 1, one split's fp32 partial (acc [B*G, D], max and sum [B*G]) is
# B*G*(D+2)*4 bytes per KV head, written once and read once by the merging split (whose own partial stays in
# registers); the bf16 K/V rows it summarises are chunk*D*2*2 bytes, chunk = live / A. Partials / K/V =
# 2*B*G*(D+2) / (chunk*D): 51 % at chunk = 256 and B*G = 64 (Qwen3-8B verify or draft, B = 16, G = 4, D = 128),
# 12.7 % at chunk 1024, which long contexts reach as the grid caps A. Below 256 rows the partials would cost
# more than the K/V rows they summarise.
MIN_CHUNK = 256
# The most splits a grid has (``pick_max_splits`` caps at it; a larger ``num_splits`` is lowered to it).
MAX_SPLITS = 64
# The SM count the split plan assumes without a GPU (the CPU interpreter, the traffic accountant): an H200's.
H200_SMS = 132
# Split slots whose maxima and sums the merge loads as one tile, and slots whose partial tiles it loads together
# (one unrolled step, independent loads in flight). Larger values spill registers at the Qwen3-8B tile on sm_90.
MERGE_TILE = 8
MERGE_UNROLL = 2
_MERGE_TILE = tl.constexpr(MERGE_TILE)
_MERGE_UNROLL = tl.constexpr(MERGE_UNROLL)


def active_splits(live: int, max_splits: int) -> int:
    """Context splits that do work for a request with ``live`` context rows in a grid of ``max_splits``:
    one per MIN_CHUNK rows, at least 1, at most ``max_splits`` (the kernels' ``_split_plan``)."""
    return min(max(triton.cdiv(live, MIN_CHUNK), 1), max_splits)


def partial_slots(live: int, max_splits: int) -> int:
    """fp32 partial slots a request writes and the merging split reads, per KV head: one per active split but
    the last to finish (it merges from registers), none when a single split is active."""
    return active_splits(live, max_splits) - 1


def pick_max_splits(n: int, kvh: int, bound: int, num_sms: int = H200_SMS) -> int:
    """The grid's split count, host side (no sync): one wave, as many splits as give each (request, KV head,
    split) program an SM of its own on ``num_sms`` SMs (default: an H200's, the plan tests on the CPU follow;
    1 once N*kvH fills them), no more than a context of ``bound`` rows makes active, at most ``MAX_SPLITS``.
    A second wave would not add bandwidth where the SMs are already busy, only partials (Qwen3-8B at batch 8
    and 2k context: 5 splits instead of 2 move 1.065x the draft step's floor bytes, over its 1.05 goal)."""
    return max(1, min(num_sms // max(1, n * kvh), triton.cdiv(bound, MIN_CHUNK), MAX_SPLITS))


def merge_round_trips(active: int, rows: int, d: int) -> int:
    """Dependent L2 round trips on the merging program's path once its own split is done, for ``active`` splits
    and a [rows = B*G, D] tile: the arrival ticket, the maxima/sums tiles, and each D half's partial tiles,
    ``MERGE_UNROLL`` slots a step (1 for tiles wider than 64 x 64); none with one active split."""
    if active <= 1:
        return 0
    block_r, block_half = _tile_dims(rows, d)
    unroll = MERGE_UNROLL if block_r * block_half <= 4096 else 1
    return 1 + triton.cdiv(active, MERGE_TILE) + 2 * triton.cdiv(active, unroll)


def _validate(op, q, k, v, k_cache, v_cache, cache_lens, q_norm_weight, k_norm_weight, inv_freq, sliding_window,
              block_table, cache_batch_idx, num_splits, causal, block_lens):
    check_tensor(op, "q", q, ndim=4, dtypes=FLOAT_DTYPES)
    dev = q.device
    n, b, nh, d = q.shape
    if b < 1 or d < 2 or d % 2:
        raise ValueError(f"{op}: q must be [N, B, nH, D] with B >= 1 and an even head dim D (RoPE); got {tuple(q.shape)}")
    for name, t in (("k", k), ("v", v)):
        check_tensor(op, name, t, ndim=4, dtypes=(q.dtype,), device=dev)
        if t.shape[0] != n or t.shape[1] != b or t.shape[3] != d:
            raise ValueError(f"{op}: {name} must be [N={n}, B={b}, kvH, D={d}] (raw projection of the block rows), "
                             f"got {tuple(t.shape)}")
    kvh = k.shape[2]
    if v.shape[2] != kvh or kvh == 0 or nh % kvh:
        raise ValueError(f"{op}: k/v must have the same number of KV heads dividing nH={nh}; got k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_last_dim_contiguous(op, name, t)
    check_cache_pair(op, k_cache, v_cache, ndim=4, kv_heads=kvh, head_dim=d, device=dev)
    check_tensor(op, "cache_lens", cache_lens, ndim=1, dtypes=(torch.int32, torch.int64), device=dev)
    if cache_lens.shape[0] != n:
        raise ValueError(f"{op}: cache_lens must be [N={n}] (cached context rows per request), got {tuple(cache_lens.shape)}")
    if block_lens is not None:
        check_tensor(op, "block_lens", block_lens, ndim=1, dtypes=(torch.int64,), device=dev)
        if block_lens.shape[0] != n:
            raise ValueError(f"{op}: block_lens must be [N={n}] (valid block rows per request, each in [1, B={b}]) "
                             f"or None (all B rows valid), got {tuple(block_lens.shape)}")
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError(f"{op}: pass both q_norm_weight and k_norm_weight (per-head q/k RMSNorm, e.g. Qwen3) or "
                         f"neither (no q/k norm, e.g. LLaMA)")
    for name, w in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        if w is not None:
            check_tensor(op, name, w, ndim=1, dtypes=FLOAT_DTYPES, device=dev)
            if w.shape[0] != d:
                raise ValueError(f"{op}: {name} must be [D={d}], got {tuple(w.shape)}")
    check_tensor(op, "inv_freq", inv_freq, ndim=1, dtypes=(torch.float32, torch.float64), device=dev)
    if inv_freq.shape[0] != d // 2:
        raise ValueError(f"{op}: inv_freq must be [D/2={d // 2}] fp32 (transformers ROPE_INIT_FUNCTIONS), "
                         f"got {tuple(inv_freq.shape)}")
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise ValueError(f"{op}: sliding_window must be None (full non-causal) or an int >= 1, got {sliding_window!r}")
    if causal is not None and not isinstance(causal, bool):
        raise TypeError(f"{op}: causal must be None (causal iff sliding_window is set) or a bool, got {causal!r}")
    if num_splits is not None and (not isinstance(num_splits, int) or num_splits < 1):
        raise ValueError(f"{op}: num_splits must be None or an int >= 1, got {num_splits!r}")
    page_table(op, n, block_table, cache_batch_idx, dev)
    check_cache_index_values(op, k_cache, cache_lens, block_table, cache_batch_idx)
    check_index_values(op, "block_lens", block_lens, 1, b + 1, f"valid block rows per request, of B={b}")


def _cache_index(cache: torch.Tensor, n: int, t: torch.Tensor, block_table, cache_batch_idx):
    """Index of request ``n``'s logical rows ``t`` in a contiguous or paged cache."""
    if block_table is None:
        return cache_batch_idx[n] if cache_batch_idx is not None else n, t
    page_size = cache.shape[1]
    return block_table[n].to(torch.int64)[t // page_size], t % page_size


def write_cache_rows_reference(k_cache, v_cache, req, t, keep, k_rows, v_rows, block_table, cache_batch_idx,
                               slot_mapping=None) -> None:
    """Write ``k_rows[i]`` / ``v_rows[i]`` (``[R, kvH, D]``) to request ``req[i]``'s logical cache row ``t[i]``
    (int64 ``[R]`` each), or to flat slot ``slot_mapping[i]`` (page ``// page_size``, slot ``% page_size``) when
    given, where ``keep[i]``, in static shapes and without a host read (a CUDA graph can hold it).

    Every row is written somewhere: a row not kept takes the destination and the values of the first kept row
    (the same bits to the same place, so the write order does not matter), or, when no row is kept, writes back
    what its destination already holds. ``t`` of a kept row is below the capacity; any other is clamped into it,
    so every address is valid."""
    page_size = k_cache.shape[1]
    capacity = page_size * (block_table.shape[1] if block_table is not None else 1)
    if req.numel() == 0 or capacity == 0:
        return
    t = t.clamp(0, capacity - 1)
    if slot_mapping is not None:
        flat = slot_mapping.to(torch.int64).clamp(0, k_cache.shape[0] * page_size - 1)
        pages, slots = flat // page_size, flat % page_size
    elif block_table is not None:
        pages, slots = block_table.to(torch.int64)[req, t // page_size], t % page_size
    else:
        pages, slots = (cache_batch_idx.to(torch.int64)[req] if cache_batch_idx is not None else req), t
    src = torch.where(keep, torch.arange(keep.numel(), device=keep.device), keep.to(torch.int8).argmax())
    pages, slots = pages[src], slots[src]
    any_kept = keep.any()
    for cache, rows in ((k_cache, k_rows), (v_cache, v_rows)):
        cache.index_put_((pages, slots), torch.where(any_kept, rows[src].to(cache.dtype), cache[pages, slots]))


def _norm_rope_reference(x, weight, cos, sin, eps):
    """Per-head RMSNorm (skipped when ``weight`` is None), then NeoX RoPE; x [B, heads, D], cos/sin [B, D]."""
    if weight is not None:
        x = rms_norm_reference(x, weight, eps)
    return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]


def _lengths_on_host(cache_lens: torch.Tensor) -> bool:
    """Whether the attention references read the lengths on the host: eagerly on CPU tensors (free there), so that
    the attention runs over exactly each request's keys, the definition's bits. Anywhere else (a device; a
    capture, its emulation, a trace) they attend over the whole cache capacity with the keys past a length
    masked out: static shapes and no host read, so a CUDA graph can hold them; the same result but for the
    rounding of the longer softmax and sums (SDPA over more keys, the extra ones at -inf)."""
    return cache_lens.device.type == "cpu" and unobserved_eager()


def _request_keys(k_cache, r: int, c, nb, b: int, causal: bool, sliding_window, block_table, cache_batch_idx):
    """Request ``r``'s attention layout for block rows at positions ``c + 0..b-1`` with ``nb`` valid block keys:
    (those positions [b], the cache index of its context keys, the slice of block keys it takes, the [b, keys]
    visibility of context keys then block keys). ``c``/``nb`` are host ints (exactly the C context keys and
    ``nb`` block keys) or 0-dim device tensors (all capacity rows and all b block keys, the extra ones hidden).
    The context keys are the rows below ``min(c, capacity)``: a length past the capacity reads up to it."""
    device = k_cache.device
    capacity = k_cache.shape[1] * (block_table.shape[1] if block_table is not None else 1)
    if isinstance(c, int):
        live = min(c, capacity)
        ctx = _cache_index(k_cache, r, torch.arange(live, device=device), block_table, cache_batch_idx)
        return torch.arange(c, c + b, device=device), ctx, slice(0, nb), _block_mask(c, live, b, nb, causal,
                                                                                      sliding_window, device)
    t = torch.arange(capacity, device=device)
    pos = c + torch.arange(b, device=device)
    valid = torch.cat([t < c, torch.arange(b, device=device) < nb])
    mask = _visible(pos[:, None], torch.cat([t, pos])[None, :], causal, sliding_window) & valid[None, :]
    return pos, _cache_index(k_cache, r, t, block_table, cache_batch_idx), slice(None), mask


def _block_mask(c: int, live: int, b: int, nb: int, causal: bool, sliding_window, device) -> torch.Tensor:
    """[b, live + nb] bool: which keys the block rows at positions c..c+b-1 see, of the ``live`` context keys
    (positions 0..live-1) and the ``nb`` block keys (positions c..c+nb-1)."""
    kpos = torch.cat([torch.arange(live, device=device), torch.arange(c, c + nb, device=device)])
    return _visible(c + torch.arange(b, device=device)[:, None], kpos[None, :], causal, sliding_window)


def _visible(qpos: torch.Tensor, kpos: torch.Tensor, causal: bool, sliding_window) -> torch.Tensor:
    """[b, keys] bool: which keys at positions ``kpos`` [1, keys] the queries at positions ``qpos`` [b, 1] see (the
    definition's causal and sliding-window rule; every key without either)."""
    mask = torch.ones(qpos.shape[0], kpos.shape[1], dtype=torch.bool, device=qpos.device)
    if causal:
        mask &= kpos <= qpos
    if sliding_window is not None:
        mask &= (qpos - kpos < sliding_window) & (kpos - qpos < sliding_window)
    return mask


def draft_attention_reference(q, k, v, k_cache, v_cache, cache_lens, q_norm_weight, k_norm_weight, *, inv_freq,
                              attention_scaling: float = 1.0, eps: float = 1e-6, sliding_window: Optional[int] = None,
                              causal: Optional[bool] = None, block_table=None, cache_batch_idx=None,
                              block_lens=None, scale: Optional[float] = None) -> torch.Tensor:
    """Definition (HF Qwen3 numerics in q's dtype, SDPA; cache_lens and block_lens read as
    :func:`_lengths_on_host` says).

    Per request n with C = cache_lens[n] and v = block_lens[n] (B when None): block row i sits at position
    C + i. q/k get per-head RMSNorm (when the weights are given) then RoPE; scores over
    [cache[:min(C, capacity)] (a length past the capacity reads up to it) ++ block keys 0..v-1], scale
    ``scale`` (D**-0.5 when None). Key at position p is visible to the query at position P unless: causal and
    p > P; or a window W is set and P - p >= W (or, non-causal with a window, p - P >= W). ``causal=None``
    means causal iff a window is set (PyPI dflash / vLLM default). Rows i < v are exactly a run on the v-row
    block ``[:, :v]``; rows i >= v are unspecified (here: the same formula, and 0 where no key is visible).
    """
    causal = (sliding_window is not None) if causal is None else causal
    n, b, nh, d = q.shape
    kvh = k.shape[2]
    out = torch.empty_like(q)
    if _lengths_on_host(cache_lens):
        lens = cache_lens.tolist()
        valid = block_lens.tolist() if block_lens is not None else [b] * n
    else:
        lens = cache_lens.to(torch.int64)
        valid = block_lens.to(torch.int64) if block_lens is not None else torch.full_like(lens, b)
    for r in range(n):
        pos, ctx, block, mask = _request_keys(k_cache, r, lens[r], valid[r], b, causal, sliding_window, block_table,
                                              cache_batch_idx)
        cos, sin = rope_cos_sin_reference(pos, inv_freq, attention_scaling, q.dtype)
        qn = _norm_rope_reference(q[r], q_norm_weight, cos, sin, eps)
        kn = _norm_rope_reference(k[r], k_norm_weight, cos, sin, eps)
        keys = torch.cat([k_cache[ctx].to(q.dtype), kn[block]], 0)
        vals = torch.cat([v_cache[ctx].to(q.dtype), v[r, block]], 0)
        # 4-D [1, heads, rows, D] like HF's attention modules: CPU SDPA rounds 3-D inputs differently.
        o = F.scaled_dot_product_attention(qn.transpose(0, 1)[None], keys.transpose(0, 1)[None],
                                           vals.transpose(0, 1)[None], attn_mask=mask[None, None],
                                           scale=d ** -0.5 if scale is None else scale, enable_gqa=kvh != nh)[0]
        # Only rows past block_lens can see no key (a window behind them ends before the valid block).
        out[r] = o.transpose(0, 1).masked_fill(~mask.any(1)[:, None, None], 0)
    return out


def verify_attention_reference(q, k, v, k_cache, v_cache, cache_lens, q_norm_weight=None, k_norm_weight=None, *,
                               inv_freq, attention_scaling: float = 1.0, eps: float = 1e-6,
                               scale: Optional[float] = None, block_table=None, cache_batch_idx=None,
                               tree_depths=None, tree_mask=None) -> torch.Tensor:
    """Definition (static-shape writes): write request n's block K rows (normed + rotated, as the attention uses
    them) and raw V rows to cache rows ``cache_lens[n] + i`` (those below the capacity), then
    ``draft_attention_reference`` with ``causal=True`` (the context [0, min(cache_lens[n], capacity)) plus block
    keys j <= i).

    Tree (``tree_depths`` [N, B] and ``tree_mask`` [N, B, ceil(B/64)] int64, both or neither): block row i is
    at position ``cache_lens[n] + tree_depths[n, i]`` (q and k rotated there) but still written at cache row
    ``cache_lens[n] + i``; query i sees the context and the block keys j whose bit ``j % 64`` of word
    ``j // 64`` of ``tree_mask[n, i]`` is set (its ancestors and itself: ``tree_ancestor_mask``)."""
    n, b, kvh, d = k.shape
    capacity = k_cache.shape[1] * (block_table.shape[1] if block_table is not None else 1)
    c = cache_lens.to(torch.int64)[:, None]
    t = (c + torch.arange(b, device=q.device)).view(-1)                      # [N*B] cache rows of the block
    pos = t if tree_depths is None else (c + tree_depths).view(-1)
    cos, sin = rope_cos_sin_reference(pos, inv_freq, attention_scaling, q.dtype)
    kn = _norm_rope_reference(k.reshape(n * b, kvh, d), k_norm_weight, cos, sin, eps)
    req = torch.arange(n, device=q.device)[:, None].expand(n, b).reshape(-1)
    write_cache_rows_reference(k_cache, v_cache, req, t, t < capacity, kn, v.reshape(n * b, kvh, d), block_table,
                               cache_batch_idx)
    if tree_depths is not None:
        return _tree_attention_reference(q, k, v, k_cache, v_cache, cache_lens, q_norm_weight, k_norm_weight,
                                         inv_freq, attention_scaling, eps, scale, block_table, cache_batch_idx,
                                         tree_depths, tree_mask)
    return draft_attention_reference(q, k, v, k_cache, v_cache, cache_lens, q_norm_weight, k_norm_weight,
                                     inv_freq=inv_freq, attention_scaling=attention_scaling, eps=eps, causal=True,
                                     block_table=block_table, cache_batch_idx=cache_batch_idx, scale=scale)


def _tree_attention_reference(q, k, v, k_cache, v_cache, cache_lens, q_norm_weight, k_norm_weight, inv_freq,
                              attention_scaling, eps, scale, block_table, cache_batch_idx, tree_depths, tree_mask):
    """Tree attention of ``verify_attention_reference`` (HF numerics in q's dtype, SDPA): block row i at
    position ``cache_lens[n] + tree_depths[n, i]`` over the context rows and its ancestor block rows."""
    n, b, nh, d = q.shape
    kvh = k.shape[2]
    out = torch.empty_like(q)
    bit = torch.arange(b, device=q.device)
    lens = cache_lens.tolist() if _lengths_on_host(cache_lens) else cache_lens.to(torch.int64)
    for r in range(n):
        c = lens[r]
        cos, sin = rope_cos_sin_reference(c + tree_depths[r], inv_freq, attention_scaling, q.dtype)
        qn = _norm_rope_reference(q[r], q_norm_weight, cos, sin, eps)
        kn = _norm_rope_reference(k[r], k_norm_weight, cos, sin, eps)
        # The context: its first c rows (host c), or every row of the capacity with those past c hidden.
        _, ctx, _, visible = _request_keys(k_cache, r, c, 0, 1, False, None, block_table, cache_batch_idx)
        context = visible[:, :ctx[1].shape[0]]
        keys = torch.cat([k_cache[ctx].to(q.dtype), kn], 0)
        vals = torch.cat([v_cache[ctx].to(q.dtype), v[r]], 0)
        words = tree_mask[r][:, bit // 64]                                       # [B, B]: word of key j, row i
        block = ((words >> (bit % 64)[None, :]) & 1).bool()
        mask = torch.cat([context.expand(b, -1), block], 1)
        o = F.scaled_dot_product_attention(qn.transpose(0, 1)[None], keys.transpose(0, 1)[None],
                                           vals.transpose(0, 1)[None], attn_mask=mask[None, None],
                                           scale=d ** -0.5 if scale is None else scale, enable_gqa=kvh != nh)[0]
        out[r] = o.transpose(0, 1)
    return out


@triton.jit
def _split_plan(ctx_len, CAP, window, NSPLIT, SLIDING: tl.constexpr, MIN_CHUNK: tl.constexpr):
    """Context rows [lo, end) of a request and its active split count (the rule of ``active_splits``)."""
    # Never read past the cache capacity (or the block table), whatever cache_lens says.
    end = tl.minimum(ctx_len, CAP)
    lo = end * 0
    if SLIDING:
        # The earliest context key any block query can see is the one query 0 sees.
        lo = tl.minimum(tl.maximum(ctx_len - window + 1, 0), end)
    active = tl.minimum(tl.maximum(tl.cdiv(end - lo, MIN_CHUNK), 1), NSPLIT)
    return lo, end, active


@triton.jit
def _cache_rows(table_ptr, n, stride_tn, t, t_ok, page_size, HAS_TABLE: tl.constexpr):
    """(page, slot) of request n's logical cache rows t (a contiguous cache without a table: page = n)."""
    if HAS_TABLE:
        page = tl.load(table_ptr + n * stride_tn + t // page_size, mask=t_ok, other=0).to(tl.int64)
    else:
        page = t * 0 + n
    return page, t % page_size


@triton.jit
def _online_softmax(s, m_i, l_i):
    """Fold a tile of scores (log2 units, -inf where hidden) into the running max and sum: returns the tile's
    probabilities, the factor that rescales the accumulator, and the new max and sum."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def _attn_split_kernel(
    q_ptr, k_ptr, v_ptr, kc_ptr, vc_ptr, lens_ptr, blens_ptr, table_ptr, qw_ptr, kw_ptr, inv_freq_ptr, po_ptr, pm_ptr,
    pl_ptr, sem_ptr, out_ptr, depth_ptr, tmask_ptr,
    B, G, NH, HALF, page_size, CAP, window, attention_scaling, eps, qk_scale, NSPLIT,
    stride_qn, stride_qb, stride_qh, stride_kn, stride_kb, stride_kh, stride_vn, stride_vb, stride_vh,
    stride_kcp, stride_kcs, stride_kch, stride_vcp, stride_vcs, stride_vch, stride_tn, stride_dn, stride_mn, stride_mi,
    HAS_TABLE: tl.constexpr, SLIDING: tl.constexpr, CAUSAL: tl.constexpr, HAS_BLOCK_LENS: tl.constexpr,
    HAS_QK_NORM: tl.constexpr, WRITE_KV: tl.constexpr, TREE: tl.constexpr, MIN_CHUNK: tl.constexpr,
    LOWP_DOT: tl.constexpr,
    DOT_PREC: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    split = tl.program_id(2)
    ctx_len = tl.load(lens_ptr + n).to(tl.int64)
    lo, ctx_end, active = _split_plan(ctx_len, CAP, window, NSPLIT, SLIDING, MIN_CHUNK)
    if split >= active:
        return
    # GQA packing: the B x G query rows of KV head h form one tile (row r = block row r // G, head h*G + r % G).
    r = tl.arange(0, BLOCK_R)
    r_ok = r < B * G
    qi = r // G
    head = h * G + r % G
    dh = tl.arange(0, BLOCK_HALF)
    dh_ok = dh < HALF
    qmask = r_ok[:, None] & dh_ok[None, :]
    q_base = q_ptr + n * stride_qn + qi.to(tl.int64)[:, None] * stride_qb + head.to(tl.int64)[:, None] * stride_qh
    q_lo = tl.load(q_base + dh[None, :], mask=qmask, other=0.0).to(tl.float32)
    q_hi = tl.load(q_base + HALF + dh[None, :], mask=qmask, other=0.0).to(tl.float32)
    if TREE:
        # A tree node sits at its depth past the context (its cache row, written below, is its node index).
        qpos = ctx_len + tl.load(depth_ptr + n * stride_dn + qi, mask=r_ok, other=0)
    else:
        qpos = ctx_len + qi
    cos, sin = rope_cos_sin(qpos, inv_freq_ptr, dh, dh_ok, attention_scaling)
    q_lo, q_hi = norm_rope_halves(q_lo, q_hi, qw_ptr, dh, dh_ok, HALF, cos, sin, eps, HAS_QK_NORM)
    # LOWP_DOT: the dots take 16-bit operands (q, K, V and P in the cache's dtype) with fp32 accumulation:
    # the K/V tiles stay 16-bit (half the shared memory) and the MMA runs at the bf16 rate, not tf32.
    DOT_T = kc_ptr.dtype.element_ty if LOWP_DOT else tl.float32
    q_lo = (q_lo * qk_scale).to(DOT_T)
    q_hi = (q_hi * qk_scale).to(DOT_T)

    m_i = tl.full((BLOCK_R,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_R,), tl.float32)
    acc_lo = tl.zeros((BLOCK_R, BLOCK_HALF), tl.float32)
    acc_hi = tl.zeros((BLOCK_R, BLOCK_HALF), tl.float32)
    # Not rounded to BLOCK_N: with active capped at NSPLIT that could leave the last splits empty.
    chunk = tl.cdiv(ctx_end - lo, active)
    start = lo + split * chunk
    end = tl.minimum(start + chunk, ctx_end)
    for t0 in range(start, end, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        t_ok = t < end
        page, slot = _cache_rows(table_ptr, n, stride_tn, t, t_ok, page_size, HAS_TABLE)
        kmask = t_ok[:, None] & dh_ok[None, :]
        k_base = kc_ptr + (page * stride_kcp + slot * stride_kcs + h * stride_kch)[:, None]
        k_lo = tl.load(k_base + dh[None, :], mask=kmask, other=0.0).to(DOT_T)
        k_hi = tl.load(k_base + HALF + dh[None, :], mask=kmask, other=0.0).to(DOT_T)
        s = tl.dot(q_lo, tl.trans(k_lo), input_precision=DOT_PREC)
        s = tl.dot(q_hi, tl.trans(k_hi), s, input_precision=DOT_PREC)
        valid = r_ok[:, None] & t_ok[None, :]
        if SLIDING:
            valid = valid & ((qpos[:, None] - t[None, :]) < window)
        p, alpha, m_i, l_i = _online_softmax(tl.where(valid, s, float("-inf")), m_i, l_i)
        v_base = vc_ptr + (page * stride_vcp + slot * stride_vcs + h * stride_vch)[:, None]
        v_lo = tl.load(v_base + dh[None, :], mask=kmask, other=0.0).to(DOT_T)
        v_hi = tl.load(v_base + HALF + dh[None, :], mask=kmask, other=0.0).to(DOT_T)
        p = p.to(DOT_T)
        acc_lo = tl.dot(p, v_lo, acc_lo * alpha[:, None], input_precision=DOT_PREC)
        acc_hi = tl.dot(p, v_hi, acc_hi * alpha[:, None], input_precision=DOT_PREC)
    if split == active - 1:
        # The last active split also takes the block's own keys, in the same softmax state: k_norm + RoPE here,
        # from registers (WRITE_KV stores them for later steps; the context reads of this launch stop at
        # cache_lens, so there is no race). Keys at rows >= block_lens[n] are neither loaded nor seen.
        j = tl.arange(0, BLOCK_B)
        j_ok = j < B
        if HAS_BLOCK_LENS:
            j_ok = j_ok & (j < tl.load(blens_ptr + n))
        kmask = j_ok[:, None] & dh_ok[None, :]
        k_base = k_ptr + n * stride_kn + j.to(tl.int64)[:, None] * stride_kb + h * stride_kh
        k_lo = tl.load(k_base + dh[None, :], mask=kmask, other=0.0).to(tl.float32)
        k_hi = tl.load(k_base + HALF + dh[None, :], mask=kmask, other=0.0).to(tl.float32)
        if TREE:
            kpos = ctx_len + tl.load(depth_ptr + n * stride_dn + j, mask=j_ok, other=0)
        else:
            kpos = ctx_len + j
        kcos, ksin = rope_cos_sin(kpos, inv_freq_ptr, dh, dh_ok, attention_scaling)
        k_lo, k_hi = norm_rope_halves(k_lo, k_hi, kw_ptr, dh, dh_ok, HALF, kcos, ksin, eps, HAS_QK_NORM)
        v_base = v_ptr + n * stride_vn + j.to(tl.int64)[:, None] * stride_vb + h * stride_vh
        v_lo = tl.load(v_base + dh[None, :], mask=kmask, other=0.0)
        v_hi = tl.load(v_base + HALF + dh[None, :], mask=kmask, other=0.0)
        if WRITE_KV:
            # Rows past the capacity are dropped, never wrapped. V is stored as loaded (bit-exact).
            t = ctx_len + j
            w_ok = j_ok & (t < CAP)
            page, slot = _cache_rows(table_ptr, n, stride_tn, t, w_ok, page_size, HAS_TABLE)
            wmask = w_ok[:, None] & dh_ok[None, :]
            k_dst = kc_ptr + (page * stride_kcp + slot * stride_kcs + h * stride_kch)[:, None]
            v_dst = vc_ptr + (page * stride_vcp + slot * stride_vcs + h * stride_vch)[:, None]
            tl.store(k_dst + dh[None, :], k_lo.to(kc_ptr.dtype.element_ty), mask=wmask)
            tl.store(k_dst + HALF + dh[None, :], k_hi.to(kc_ptr.dtype.element_ty), mask=wmask)
            tl.store(v_dst + dh[None, :], v_lo, mask=wmask)
            tl.store(v_dst + HALF + dh[None, :], v_hi, mask=wmask)
        s = tl.dot(q_lo, tl.trans(k_lo.to(DOT_T)), input_precision=DOT_PREC)
        s = tl.dot(q_hi, tl.trans(k_hi.to(DOT_T)), s, input_precision=DOT_PREC)
        valid = r_ok[:, None] & j_ok[None, :]
        diff = qi[:, None] - j[None, :]
        if TREE:
            # Ancestor bitmask: query row i sees block key j iff bit j % 64 of word j // 64 of row i is set.
            word = tl.load(tmask_ptr + n * stride_mn + qi.to(tl.int64)[:, None] * stride_mi + (j // 64)[None, :],
                           mask=valid, other=0)
            valid = valid & (((word >> (j % 64).to(tl.int64)[None, :]) & 1) != 0)
        if CAUSAL:
            valid = valid & (diff >= 0)
        if SLIDING:
            valid = valid & (diff < window) & (diff > -window)
        p, alpha, m_i, l_i = _online_softmax(tl.where(valid, s, float("-inf")), m_i, l_i)
        p = p.to(DOT_T)
        acc_lo = tl.dot(p, v_lo.to(DOT_T), acc_lo * alpha[:, None], input_precision=DOT_PREC)
        acc_hi = tl.dot(p, v_hi.to(DOT_T), acc_hi * alpha[:, None], input_precision=DOT_PREC)
    # Rows are (block row, head) in the natural [N, B, nH, D] order of the output and the partials.
    row = (qi * NH + head).to(tl.int64)
    out_base = out_ptr + (n * B * NH + row)[:, None] * (2 * HALF)
    if active == 1:
        # The only split holds the whole softmax: normalise and store the output.
        # Rows that see no key (past block_lens) have l = 0 and acc = 0: their output is 0.
        inv_l = 1.0 / tl.where(l_i > 0, l_i, 1.0)
        tl.store(out_base + dh[None, :], (acc_lo * inv_l[:, None]).to(out_ptr.dtype.element_ty), mask=qmask)
        tl.store(out_base + HALF + dh[None, :], (acc_hi * inv_l[:, None]).to(out_ptr.dtype.element_ty), mask=qmask)
    else:
        # Split-KV merge without a merge launch: the last of the request's A active splits (for this KV head)
        # to finish merges; the A - 1 others write their unnormalised partials (acc, running max m, sum l) to
        # their slot of [N, S, B, nH, D] and signal. counter[0] hands out arrival tickets, counter[1] counts
        # the partials written (Triton's atomics are acq_rel at GPU scope); the launch's own counters, zeroed
        # before it (``_merge_counters``). The last one never writes its own partial. No deadlock: every split
        # that took a ticket is running and does not wait on anyone.
        counter = sem_ptr + (n * tl.num_programs(1) + h) * 2
        ps = (n * NSPLIT + split) * B * NH + row
        ticket = tl.atomic_add(counter, 1)
        if ticket < active - 1:
            po_base = po_ptr + ps[:, None] * (2 * HALF)
            tl.store(po_base + dh[None, :], acc_lo, mask=qmask)
            tl.store(po_base + HALF + dh[None, :], acc_hi, mask=qmask)
            tl.store(pm_ptr + ps, m_i, mask=r_ok)
            tl.store(pl_ptr + ps, l_i, mask=r_ok)
            tl.debug_barrier()  # every thread's stores precede the release below
            tl.atomic_add(counter + 1, 1)
        else:
            while tl.atomic_add(counter + 1, 0) < active - 1:
                pass
            tl.debug_barrier()  # no thread reads a partial before the acquire above saw them all
            # Combined in slot order 0..A-1 whichever split arrives last (its own slot from registers, which
            # hold exactly what it would have stored): the result does not depend on the arrival order. The
            # slots' maxima and sums come _MERGE_TILE slots to a load ([slots, rows] tiles, .cg: written by other
            # SMs, read from L2; one load each up to _MERGE_TILE active splits), folded into the global max and
            # the weighted sum; then each D half in one pass over the slots, _MERGE_UNROLL slots' tiles at a time.
            first = n * NSPLIT * B * NH  # request n's slot 0, in rows
            m, l_sum = _merged_max_sum(pm_ptr, pl_ptr, first, B * NH, row, m_i, l_i, split, active, r_ok)
            m_safe = tl.where(m == float("-inf"), 0.0, m)
            inv_l = 1.0 / tl.where(l_sum > 0, l_sum, 1.0)
            out_lo = _merged_half(po_ptr, pm_ptr, first, B * NH, 2 * HALF, row, dh, acc_lo, m_i, m_safe, split,
                                  active, r_ok, qmask)
            tl.store(out_base + dh[None, :], (out_lo * inv_l[:, None]).to(out_ptr.dtype.element_ty), mask=qmask)
            out_hi = _merged_half(po_ptr + HALF, pm_ptr, first, B * NH, 2 * HALF, row, dh, acc_hi, m_i, m_safe,
                                  split, active, r_ok, qmask)
            tl.store(out_base + HALF + dh[None, :], (out_hi * inv_l[:, None]).to(out_ptr.dtype.element_ty), mask=qmask)


@triton.jit
def _merged_max_sum(pm_ptr, pl_ptr, first, slot_rows, rows, m_i, l_i, split, active, r_ok):
    """(max over the active slots of m_s, sum of l_s * exp2(m_s - that max)) per row: the other slots' from
    memory, _MERGE_TILE slots to a load, slot ``split``'s from ``m_i``/``l_i``; groups folded in slot order
    (online rescaling), so the result does not depend on which split merges. A row no slot saw: (-inf, 0)."""
    m = tl.full(m_i.shape, float("-inf"), tl.float32)
    l_sum = tl.zeros(m_i.shape, tl.float32)
    for s0 in range(0, active, _MERGE_TILE):
        slots = s0 + tl.arange(0, _MERGE_TILE)
        own = (slots == split)[:, None]
        at = (first + slots * slot_rows)[:, None] + rows[None, :]
        theirs = ((slots < active) & (slots != split))[:, None] & r_ok[None, :]
        m_g = tl.where(own, m_i[None, :], tl.load(pm_ptr + at, mask=theirs, other=float("-inf"), cache_modifier=".cg"))
        l_g = tl.where(own, l_i[None, :], tl.load(pl_ptr + at, mask=theirs, other=0.0, cache_modifier=".cg"))
        m_new = tl.maximum(m, tl.max(m_g, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        # slots past A weigh exp2(-inf) = 0
        l_sum = l_sum * tl.exp2(m - m_safe) + tl.sum(l_g * tl.exp2(m_g - m_safe[None, :]), axis=0)
        m = m_new
    return m, l_sum


@triton.jit
def _merged_half(po_ptr, pm_ptr, first, slot_rows, row_len, rows, cols, own_acc, m_i, m_safe, split, active, r_ok,
                 qmask):
    """Sum over the active split slots 0..A-1, in slot order, of acc_s[rows, cols] * exp2(m_s - m_safe): the
    other slots' partials from memory (slot s of request n starts at row ``first + s * slot_rows``; .cg: written
    by other SMs, read from L2), slot ``split`` from ``own_acc``. _MERGE_UNROLL slots a step, their loads
    independent; the slots past A add exact zeros."""
    total = tl.zeros(own_acc.shape, tl.float32)
    # Tiles wider than Qwen3-8B's 64 x 64 (trees of 32 nodes: 128 rows) take one slot a step: no room for two
    # (``merge_round_trips`` counts the steps).
    UNROLL: tl.constexpr = _MERGE_UNROLL if own_acc.shape[0] * own_acc.shape[1] <= 4096 else 1
    for s0 in range(0, active, UNROLL):
        for u in tl.static_range(UNROLL):
            slot = s0 + u
            other = (slot < active) & (slot != split)
            at = first + slot * slot_rows
            o_s = tl.load(po_ptr + at * row_len + (rows[:, None] * row_len + cols[None, :]), mask=qmask & other,
                          other=0.0, cache_modifier=".cg")
            m_s = tl.load(pm_ptr + at + rows, mask=r_ok & other, other=float("-inf"), cache_modifier=".cg")
            w = tl.exp2(tl.where(slot == split, m_i, m_s) - m_safe)
            total += tl.where(slot == split, own_acc, o_s) * w[:, None]
    return total


@functools.lru_cache(maxsize=8)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _tile_dims(rows: int, d: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_HALF) of the split kernel for ``rows`` = B*G query rows per KV head and head dim D."""
    return max(16, next_pow2(rows)), max(16, next_pow2(d // 2))


def _split_tile(b: int, g: int, d: int, lowp_dot: bool) -> tuple[dict, dict]:
    """The split kernel's tile constexprs and launch options (num_warps, maxnreg) on a GPU for B block rows,
    G = nH/kvH, head dim D, 16-bit dot operands or not."""
    block_r, block_half = _tile_dims(b * g, d)
    wide = block_r * block_half >= 4096
    # The wide tiles (Qwen3-8B: 64 rows x D 128) take 8 warps; 32 context rows per step keep the score tile and
    # the K/V staging within 128 registers, 2 CTAs/SM (README resource table). At 64 x 64 with 16-bit operands
    # ptxas is held to those 128: left alone it takes up to 142 on the sliding-window variants (the in-kernel
    # merge's code), which fit in 120 without a spill.
    tile = dict(BLOCK_R=block_r, BLOCK_N=32 if wide or d > 128 else 64, BLOCK_B=max(16, next_pow2(b)),
                BLOCK_HALF=block_half)
    launch = dict(num_warps=8 if wide else 4)
    if lowp_dot and block_r * block_half == 4096:
        launch["maxnreg"] = 128
    return tile, launch


def _partials(n: int, splits: int, b: int, nh: int, d: int, device: torch.device):
    """fp32 (acc [N, S, B, nH, D], max, sum [N, S, B, nH]) of every split slot; a request writes
    ``partial_slots`` of them."""
    po = torch.empty((n, splits, b, nh, d), dtype=torch.float32, device=device)
    pm = torch.empty((n, splits, b, nh), dtype=torch.float32, device=device)
    return po, pm, torch.empty_like(pm)


def _merge_counters(pairs: int, device: torch.device) -> torch.Tensor:
    """int32 [pairs, 2] merge counters of one launch with a grid of more than one split (arrival tickets,
    partials written), zeroed by a memset on the launch's stream (a node of its own in a captured graph): no
    two launches share counters, whatever stream or graph runs them, and a launch cut short leaves nothing
    behind for the next."""
    return torch.zeros((pairs, 2), dtype=torch.int32, device=device)


def _attention_triton(q, k, v, k_cache, v_cache, cache_lens, q_norm_weight, k_norm_weight, inv_freq, attention_scaling,
                      eps, scale, sliding_window, causal, block_table, cache_batch_idx, block_lens, num_splits,
                      max_context_len, write_kv, tree_depths=None, tree_mask=None):
    n, b, nh, d = q.shape
    kvh = k.shape[2]
    g = nh // kvh
    out = torch.empty((n, b, nh, d), dtype=q.dtype, device=q.device)
    if n == 0:
        return out
    table, paged = page_table(OP, n, block_table, cache_batch_idx, q.device)
    page_size = k_cache.shape[1]
    capacity = block_table.shape[1] * page_size if paged else page_size
    bound = capacity if max_context_len is None else min(capacity, max(1, int(max_context_len)))
    half = d // 2
    if num_splits is None:
        # The interpreter plans for an H200 (pick_max_splits' default): the tests see the GPU's split counts.
        num_splits = pick_max_splits(n, kvh, bound) if interpreting() else pick_max_splits(
            n, kvh, bound, _sm_count(q.device.index if q.device.index is not None else torch.cuda.current_device()))
    num_splits = min(num_splits, MAX_SPLITS)
    po, pm, pl = _partials(n, num_splits, b, nh, d, q.device)
    dot_prec = "ieee" if q.dtype == torch.float32 or k_cache.dtype == torch.float32 else "tf32"
    # The interpreter keeps fp32 operands (it hands 16-bit values around as raw integers).
    lowp_dot = q.dtype == k_cache.dtype != torch.float32 and not interpreting()
    has_norm = q_norm_weight is not None
    causal = (sliding_window is not None) if causal is None else causal
    tree = tree_depths is not None
    tile, launch = _split_tile(b, g, d, lowp_dot)
    if interpreting():
        tile["BLOCK_N"] = 64  # fewer interpreted loop steps
    _attn_split_kernel[(n, kvh, num_splits)](
        q_ptr=q, k_ptr=k, v_ptr=v, kc_ptr=k_cache, vc_ptr=v_cache, lens_ptr=cache_lens,
        blens_ptr=block_lens if block_lens is not None else cache_lens,
        table_ptr=table if table is not None else cache_lens,
        qw_ptr=q_norm_weight if has_norm else inv_freq, kw_ptr=k_norm_weight if has_norm else inv_freq,
        inv_freq_ptr=inv_freq.to(torch.float32), po_ptr=po, pm_ptr=pm, pl_ptr=pl,
        sem_ptr=_merge_counters(n * kvh, q.device) if num_splits > 1 else cache_lens, out_ptr=out,
        depth_ptr=tree_depths if tree else cache_lens, tmask_ptr=tree_mask if tree else cache_lens,
        B=b, G=g, NH=nh, HALF=half, page_size=page_size, CAP=capacity, window=sliding_window or 0,
        attention_scaling=float(attention_scaling), eps=float(eps),
        qk_scale=(d ** -0.5 if scale is None else float(scale)) * _LOG2E, NSPLIT=num_splits,
        stride_qn=q.stride(0), stride_qb=q.stride(1), stride_qh=q.stride(2),
        stride_kn=k.stride(0), stride_kb=k.stride(1), stride_kh=k.stride(2),
        stride_vn=v.stride(0), stride_vb=v.stride(1), stride_vh=v.stride(2),
        stride_kcp=k_cache.stride(0), stride_kcs=k_cache.stride(1), stride_kch=k_cache.stride(2),
        stride_vcp=v_cache.stride(0), stride_vcs=v_cache.stride(1), stride_vch=v_cache.stride(2),
        stride_tn=table.stride(0) if table is not None else 0,
        stride_dn=tree_depths.stride(0) if tree else 0, stride_mn=tree_mask.stride(0) if tree else 0,
        stride_mi=tree_mask.stride(1) if tree else 0,
        HAS_TABLE=table is not None, SLIDING=sliding_window is not None, CAUSAL=causal and not tree,
        HAS_BLOCK_LENS=block_lens is not None, HAS_QK_NORM=has_norm, WRITE_KV=write_kv, TREE=tree,
        MIN_CHUNK=MIN_CHUNK,
        LOWP_DOT=lowp_dot, DOT_PREC=dot_prec, **launch, **tile,
    )
    return out


def draft_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    cache_lens: torch.Tensor, q_norm_weight: Optional[torch.Tensor],
                    k_norm_weight: Optional[torch.Tensor], *, inv_freq: torch.Tensor, attention_scaling: float = 1.0,
                    eps: float = 1e-6, sliding_window: Optional[int] = None, causal: Optional[bool] = None,
                    block_table: Optional[torch.Tensor] = None,
                    cache_batch_idx: Optional[torch.Tensor] = None, block_lens: Optional[torch.Tensor] = None,
                    num_splits: Optional[int] = None, max_context_len: Optional[int] = None,
                    backend: str = "auto") -> torch.Tensor:
    """Attention of one draft layer: B block queries per request over [cached context ++ block keys].

    Fuses the per-head ``q_norm``/``k_norm`` RMSNorm and NeoX RoPE of the block rows (at positions
    ``cache_lens[n] + i``), GQA packing (B x nH/kvH rows per KV head), split-KV over the context merged by
    the last split to finish, fp32 softmax statistics, scale D**-0.5. One launch (after a memset of its own
    merge counters when the grid has splits), no host sync: calls may run concurrently on different streams. The block's K/V are
    only used in-register: nothing is written to the cache.

    Args:
        q: ``[N, B, nH, D]`` raw ``q_proj`` output of the block rows (before q_norm/RoPE); fp32/bf16/fp16,
            last dim contiguous (a ``[N*B, nH*D]`` projection viewed as 4-D works). D even.
        k, v: ``[N, B, kvH, D]`` raw ``k_proj`` / ``v_proj`` of the block rows, q's dtype.
        k_cache, v_cache: this layer's context cache, holding keys already normed + rotated (as written by
            ``inject_context_kv``); row t of a request is absolute position t. Either contiguous
            ``[N_cap, max_len, kvH, D]`` (request n uses batch row ``cache_batch_idx[n]``, default n) or paged
            ``[num_pages, page_size, kvH, D]`` with ``block_table``. Slices ``cache[l]`` of the 5-D caches work.
        cache_lens: ``[N]`` int32/int64 on the device: cached context rows per request (>= 0). Reads
            stop at the cache capacity (max_len, or max_pages * page_size) even if cache_lens is larger.
        q_norm_weight, k_norm_weight: ``[D]`` the layer's ``q_norm.weight`` / ``k_norm.weight``, or both None
            (no per-head q/k norm).
        inv_freq: ``[D/2]`` fp32 and ``attention_scaling``: from
            ``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS[rope_type](config, device)``.
        eps: RMSNorm epsilon.
        sliding_window: None = full non-causal attention (standard DFlash layers); int W = causal inside
            the block and a window of W positions (self included) over context and block.
        causal: None = causal iff ``sliding_window`` is set (PyPI dflash / vLLM per-layer default); True/False
            overrides (e.g. ``dflash_config.causal``): causal masks block keys after the query, and a
            non-causal window also hides block keys W or more positions after it.
        block_table: ``[N, max_pages]`` int32/int64 page ids of a paged cache (logical row t lives in
            page ``block_table[n, t // page_size]`` at slot ``t % page_size``); every entry a page of the cache.
        cache_batch_idx: ``[N]`` int32/int64 batch rows of the cache, contiguous cache only.
        block_lens: ``[N]`` int64 on the device, or None (all B rows valid): request n's block keys/values
            at rows ``j >= block_lens[n]`` are masked out for every query (and not read). Values must be in
            ``[1, B]``. Output rows ``i < block_lens[n]`` equal a run on the block ``[:, :block_lens[n]]``;
            rows ``i >= block_lens[n]`` are unspecified (finite for finite inputs) and should be ignored. For a
            shortened tail block ``[anchor, MASK x (v-1)]`` with static shapes. The index values
            (``cache_lens``, ``cache_batch_idx``, ``block_table``, ``block_lens``) are checked on CPU tensors
            (ValueError); on a GPU only the kernels read them (no host sync).
        num_splits: the maximum context splits per (request, KV head) (the grid, at most ``MAX_SPLITS``: a larger
            value is lowered to it); default ``pick_max_splits`` from the SM count and the capacity. Each request uses
            ``active_splits(live rows, num_splits)`` of them, computed in-kernel.
        max_context_len: optional host-side upper bound of ``cache_lens`` to size the grid (no sync).
        backend: ``"auto" | "triton" | "cpu" | "torch"`` (``"cpu"``: CPU tensors, the reference's formula with
            less per-call work; a paged cache runs the reference).

    Returns:
        A new ``[N, B, nH, D]`` tensor in q's dtype.
    """
    chosen = resolve_backend(OP, backend, q.device, available=_BACKENDS)
    return call_op(_draft_attention_op, q, k, v, k_cache, v_cache, cache_lens, q_norm_weight, k_norm_weight,
                   inv_freq, float(attention_scaling), float(eps), sliding_window, causal,
                   block_table, cache_batch_idx, block_lens, num_splits, max_context_len,
                   chosen, device=q.device)


def _check_draft(q, k, v, k_cache, v_cache, cache_lens, q_norm_weight, k_norm_weight, inv_freq, attention_scaling,
                 eps, sliding_window, causal, block_table, cache_batch_idx, block_lens, num_splits, max_context_len,
                 backend):
    _validate(OP, q, k, v, k_cache, v_cache, cache_lens, q_norm_weight, k_norm_weight, inv_freq, sliding_window,
              block_table, cache_batch_idx, num_splits, causal, block_lens)


@torch.library.custom_op("dflash::draft_attention", mutates_args=())
@checked_by(_check_draft)
def _draft_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, cache_lens: torch.Tensor, q_norm_weight: Optional[torch.Tensor],
                        k_norm_weight: Optional[torch.Tensor], inv_freq: torch.Tensor, attention_scaling: float,
                        eps: float, sliding_window: Optional[int], causal: Optional[bool],
                        block_table: Optional[torch.Tensor], cache_batch_idx: Optional[torch.Tensor],
                        block_lens: Optional[torch.Tensor], num_splits: Optional[int],
                        max_context_len: Optional[int], backend: str) -> torch.Tensor:
    """``torch.ops.dflash.draft_attention``: :func:`draft_attention` after validation."""
    chosen = resolve_backend(OP, backend, q.device, available=_BACKENDS)
    body = registered(OP, chosen)
    if body is not None:
        return body(q, k, v, k_cache, v_cache, cache_lens, q_norm_weight, k_norm_weight, inv_freq, attention_scaling,
                    eps, sliding_window, causal, block_table, cache_batch_idx, block_lens, num_splits,
                    max_context_len)
    if chosen == "torch":
        return draft_attention_reference(q, k, v, k_cache, v_cache, cache_lens, q_norm_weight, k_norm_weight,
                                         inv_freq=inv_freq, attention_scaling=attention_scaling, eps=eps,
                                         sliding_window=sliding_window, causal=causal, block_table=block_table,
                                         cache_batch_idx=cache_batch_idx, block_lens=block_lens)
    return _attention_triton(q, k, v, k_cache, v_cache, cache_lens, q_norm_weight, k_norm_weight, inv_freq,
                             attention_scaling, eps, None, sliding_window, causal, block_table, cache_batch_idx,
                             block_lens, num_splits, max_context_len, write_kv=False)


@_draft_attention_op.register_fake
def _draft_attention_fake(q, k, v, k_cache, v_cache, cache_lens, q_norm_weight, k_norm_weight, inv_freq,
                          attention_scaling, eps, sliding_window, causal, block_table, cache_batch_idx, block_lens,
                          num_splits, max_context_len, backend):
    return q.new_empty(q.shape)


def verify_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     cache_lens: torch.Tensor, q_norm_weight: Optional[torch.Tensor] = None,
                     k_norm_weight: Optional[torch.Tensor] = None, *, inv_freq: torch.Tensor,
                     attention_scaling: float = 1.0, eps: float = 1e-6, scale: Optional[float] = None,
                     block_table: Optional[torch.Tensor] = None, cache_batch_idx: Optional[torch.Tensor] = None,
                     num_splits: Optional[int] = None, max_context_len: Optional[int] = None,
                     tree_depths: Optional[torch.Tensor] = None, tree_mask: Optional[torch.Tensor] = None,
                     backend: str = "auto", validate: bool = True) -> torch.Tensor:
    """Attention of one target layer in the verify step, and the block's K/V appended to the cache.

    Request n's B new rows sit at positions ``cache_lens[n] + i``. q/k get the optional per-head RMSNorm,
    then NeoX RoPE; query i sees the cached rows ``[0, cache_lens[n])`` and block keys ``j <= i``, at scale
    ``scale`` (D**-0.5 when None; pass HF's ``attn.scaling``). The block's normed + rotated K rows and raw V
    rows are written to cache rows ``cache_lens[n] + i`` (only those below the capacity). Same kernels as
    :func:`draft_attention` (one launch, no host sync); the block keys come from registers and the
    context reads stop at ``cache_lens``, so the rows being written are never read by the same call.

    Args:
        q: ``[N, B, nH, D]`` raw ``q_proj`` of the block rows; fp32/bf16/fp16, last dim contiguous; D even.
        k, v: ``[N, B, kvH, D]`` raw ``k_proj`` / ``v_proj`` of the block rows, q's dtype.
        k_cache, v_cache: this layer's cache in q's dtype, keys stored normed + rotated: contiguous
            ``[N_cap, max_len, kvH, D]`` (request n uses batch row ``cache_batch_idx[n]``, default n) or paged
            ``[num_pages, page_size, kvH, D]`` with ``block_table``. Written in place; the rows written by
            different requests must be distinct.
        cache_lens: ``[N]`` int32/int64 on the device: cached rows per request (0 allowed). Not modified:
            advance it yourself by the accepted count (rows past it are simply overwritten next time).
        q_norm_weight, k_norm_weight: ``[D]`` (Qwen3 ``q_norm``/``k_norm``), or both None (LLaMA).
        inv_freq, attention_scaling: from transformers' ``ROPE_INIT_FUNCTIONS``; eps: RMSNorm epsilon.
        scale: softmax scale; None = D**-0.5.
        block_table, cache_batch_idx: as in :func:`draft_attention`.
        num_splits, max_context_len: as in :func:`draft_attention` (``max_context_len`` bounds
            ``cache_lens``, the context read, not ``cache_lens + B``).
        tree_depths, tree_mask: a draft tree instead of the chain (both or neither): ``[N, B]`` int64 node
            depths (``dflash_kernels.build_tree``) and ``[N, B, ceil(B/64)]`` int64 ancestor bitmask
            (``dflash_kernels.tree_ancestor_mask``; built once per round, passed to every layer). Block row i
            then sits at position ``cache_lens[n] + tree_depths[n, i]`` (still written at cache row
            ``cache_lens[n] + i``) and sees the context plus the block rows of its ancestors and itself.
        backend: ``"auto" | "triton" | "cpu" | "torch"`` (``"cpu"``: CPU tensors, the reference's formula with
            less per-call work; a paged cache or a tree runs the reference).
        validate: check the arguments first (default; ``torch.ops.dflash.verify_attention`` always does).
            ``False`` takes the internal unchecked path (``_dispatch.call_op(checked=True)``), for a caller that
            already checked the same shapes, dtypes, devices and index values (the lean target: every layer after
            the first of a forward).

    Returns:
        A new ``[N, B, nH, D]`` tensor in q's dtype.
    """
    _check_scale(scale)  # before float(scale) turns True or "0.1" into a number
    chosen = resolve_backend(VERIFY_OP, backend, q.device, available=_BACKENDS)
    return call_op(_verify_attention_op, q, k, v, k_cache, v_cache, cache_lens, q_norm_weight, k_norm_weight,
                   inv_freq, float(attention_scaling), float(eps),
                   None if scale is None else float(scale), block_table, cache_batch_idx,
                   num_splits, max_context_len, tree_depths, tree_mask, chosen, device=q.device,
                   checked=not validate)


def _check_verify(q, k, v, k_cache, v_cache, cache_lens, q_norm_weight, k_norm_weight, inv_freq, attention_scaling,
                  eps, scale, block_table, cache_batch_idx, num_splits, max_context_len, tree_depths, tree_mask,
                  backend):
    _validate(VERIFY_OP, q, k, v, k_cache, v_cache, cache_lens, q_norm_weight, k_norm_weight, inv_freq, None,
              block_table, cache_batch_idx, num_splits, None, None)
    if k_cache.dtype != q.dtype:
        raise TypeError(f"{VERIFY_OP}: k_cache/v_cache dtype {k_cache.dtype} must equal q's dtype {q.dtype} "
                        f"(the block's K/V rows are stored as computed)")
    _check_scale(scale)
    _validate_tree(q, tree_depths, tree_mask)


def _check_scale(scale):
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0):
        raise ValueError(f"{VERIFY_OP}: scale must be None (D**-0.5) or a float > 0 (e.g. attn.scaling), "
                         f"got {scale!r}")


def _validate_tree(q, tree_depths, tree_mask):
    if (tree_depths is None) != (tree_mask is None):
        raise ValueError(f"{VERIFY_OP}: pass both tree_depths and tree_mask (a draft tree: build_tree's depths and "
                         f"tree_ancestor_mask(tree_parents)) or neither (the causal chain)")
    if tree_depths is None:
        return
    n, b = q.shape[:2]
    words = (b + 63) // 64
    for name, t, shape in (("tree_depths", tree_depths, (n, b)), ("tree_mask", tree_mask, (n, b, words))):
        check_tensor(VERIFY_OP, name, t, ndim=len(shape), dtypes=(torch.int64,), device=q.device)
        check_last_dim_contiguous(VERIFY_OP, name, t)
        if tuple(t.shape) != shape:
            raise ValueError(f"{VERIFY_OP}: {name} must be {list(shape)} for q of shape {tuple(q.shape)} (B = {b} "
                             f"tree nodes), got {tuple(t.shape)}")


@torch.library.custom_op("dflash::verify_attention", mutates_args=("k_cache", "v_cache"))
@checked_by(_check_verify)
def _verify_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, cache_lens: torch.Tensor, q_norm_weight: Optional[torch.Tensor],
                         k_norm_weight: Optional[torch.Tensor], inv_freq: torch.Tensor, attention_scaling: float,
                         eps: float, scale: Optional[float], block_table: Optional[torch.Tensor],
                         cache_batch_idx: Optional[torch.Tensor], num_splits: Optional[int],
                         max_context_len: Optional[int], tree_depths: Optional[torch.Tensor],
                         tree_mask: Optional[torch.Tensor], backend: str) -> torch.Tensor:
    """``torch.ops.dflash.verify_attention``: :func:`verify_attention` after validation (writes k_cache, v_cache)."""
    chosen = resolve_backend(VERIFY_OP, backend, q.device, available=_BACKENDS)
    body = registered(VERIFY_OP, chosen)
    if body is not None:
        return body(q, k, v, k_cache, v_cache, cache_lens, q_norm_weight, k_norm_weight, inv_freq, attention_scaling,
                    eps, scale, block_table, cache_batch_idx, num_splits, max_context_len, tree_depths, tree_mask)
    if chosen == "torch":
        return verify_attention_reference(q, k, v, k_cache, v_cache, cache_lens, q_norm_weight, k_norm_weight,
                                          inv_freq=inv_freq, attention_scaling=attention_scaling, eps=eps,
                                          scale=scale, block_table=block_table, cache_batch_idx=cache_batch_idx,
                                          tree_depths=tree_depths, tree_mask=tree_mask)
    return _attention_triton(q, k, v, k_cache, v_cache, cache_lens, q_norm_weight, k_norm_weight, inv_freq,
                             attention_scaling, eps, scale, None, True, block_table, cache_batch_idx, None,
                             num_splits, max_context_len, write_kv=True, tree_depths=tree_depths, tree_mask=tree_mask)


@_verify_attention_op.register_fake
def _verify_attention_fake(q, k, v, k_cache, v_cache, cache_lens, q_norm_weight, k_norm_weight, inv_freq,
                           attention_scaling, eps, scale, block_table, cache_batch_idx, num_splits, max_context_len,
                           tree_depths, tree_mask, backend):
    return q.new_empty(q.shape)


lean_version_bump(_verify_attention_op)

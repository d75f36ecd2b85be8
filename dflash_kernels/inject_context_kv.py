"""inject_context_kv: new context rows -> K/V of every draft layer (k_norm + RoPE on K) -> context KV cache."""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from dflash_kernels._dispatch import resolve_backend
from dflash_kernels._triton_utils import (
    FLOAT_DTYPES, check_cache_pair, check_last_dim_contiguous, check_tensor, interpreting, next_pow2, norm_rope_halves,
    page_table, rms_norm_reference, rope_cos_sin, rope_cos_sin_reference, rotate_half,
)

OP = "inject_context_kv"
_BACKENDS = ("triton", "torch")


def _validate(ctx, k_weight, v_weight, k_norm_weight, positions, cu_ctx_lens, cache_lens, k_cache, v_cache, inv_freq,
              block_table, cache_batch_idx):
    check_tensor(OP, "ctx", ctx, ndim=2, dtypes=FLOAT_DTYPES)
    dev = ctx.device
    m, h = ctx.shape
    check_last_dim_contiguous(OP, "ctx", ctx)
    for name, w in (("k_weight", k_weight), ("v_weight", v_weight)):
        check_tensor(OP, name, w, ndim=3, dtypes=FLOAT_DTYPES, device=dev)
        if w.shape[2] != h:
            raise ValueError(f"{OP}: {name} must be [L, kvH*D, H={h}] (stacked per-layer nn.Linear weights), "
                             f"got {tuple(w.shape)}")
    if k_weight.shape != v_weight.shape:
        raise ValueError(f"{OP}: k_weight {tuple(k_weight.shape)} and v_weight {tuple(v_weight.shape)} must match")
    n_layers = k_weight.shape[0]
    check_tensor(OP, "k_cache", k_cache, ndim=5, dtypes=FLOAT_DTYPES, device=dev)
    check_cache_pair(OP, k_cache, v_cache, ndim=5, kv_heads=k_cache.shape[3], head_dim=k_cache.shape[4], device=dev)
    kvh, d = k_cache.shape[3], k_cache.shape[4]
    if k_cache.shape[0] != n_layers:
        raise ValueError(f"{OP}: k_cache/v_cache must be [L={n_layers}, ...] like k_weight, got {tuple(k_cache.shape)}")
    if d < 2 or d % 2:
        raise ValueError(f"{OP}: head dim D={d} must be even (RoPE)")
    if k_weight.shape[1] != kvh * d:
        raise ValueError(f"{OP}: k_weight rows ({k_weight.shape[1]}) must equal kvH*D = {kvh}*{d} from the cache shape")
    check_tensor(OP, "k_norm_weight", k_norm_weight, ndim=2, dtypes=FLOAT_DTYPES, device=dev)
    if tuple(k_norm_weight.shape) != (n_layers, d):
        raise ValueError(f"{OP}: k_norm_weight must be [L={n_layers}, D={d}] (stacked k_norm.weight), "
                         f"got {tuple(k_norm_weight.shape)}")
    check_tensor(OP, "positions", positions, ndim=1, dtypes=(torch.int64, torch.int32), device=dev)
    if positions.shape[0] != m:
        raise ValueError(f"{OP}: positions must be [M={m}] (one absolute position per context row), got {tuple(positions.shape)}")
    check_tensor(OP, "cu_ctx_lens", cu_ctx_lens, ndim=1, dtypes=(torch.int64, torch.int32), device=dev)
    n_req = cu_ctx_lens.shape[0] - 1
    if n_req < 0:
        raise ValueError(f"{OP}: cu_ctx_lens must be [N_req+1] row offsets starting at 0, got an empty tensor")
    check_tensor(OP, "cache_lens", cache_lens, ndim=1, dtypes=(torch.int64, torch.int32), device=dev)
    if cache_lens.shape[0] != n_req:
        raise ValueError(f"{OP}: cache_lens must be [N_req={n_req}] (= len(cu_ctx_lens) - 1), got {tuple(cache_lens.shape)}")
    check_tensor(OP, "inv_freq", inv_freq, ndim=1, dtypes=(torch.float32, torch.float64), device=dev)
    if inv_freq.shape[0] != d // 2:
        raise ValueError(f"{OP}: inv_freq must be [D/2={d // 2}], got {tuple(inv_freq.shape)}")
    page_table(OP, n_req, block_table, cache_batch_idx, dev)


def inject_context_kv_reference(ctx, k_weight, v_weight, k_norm_weight, positions, cu_ctx_lens, cache_lens, k_cache,
                                v_cache, *, inv_freq, attention_scaling: float = 1.0, eps: float = 1e-6,
                                block_table=None, cache_batch_idx=None) -> None:
    """Definition (HF Qwen3 numerics in ctx's dtype; host-side indexing).

    For every layer l: K = RoPE(k_norm_l(ctx @ k_weight[l].T per head), positions), V = ctx @ v_weight[l].T;
    request n's rows cu[n]..cu[n+1]-1 go to cache rows cache_lens[n] + (0, 1, ...).
    """
    m, _ = ctx.shape
    n_layers, _, _ = k_weight.shape
    kvh, d = k_cache.shape[3], k_cache.shape[4]
    cos, sin = rope_cos_sin_reference(positions, inv_freq, attention_scaling, ctx.dtype)
    cu = cu_ctx_lens.tolist()
    lens = cache_lens.tolist()
    for layer in range(n_layers):
        kk = (ctx @ k_weight[layer].to(ctx.dtype).t()).view(m, kvh, d)
        vv = (ctx @ v_weight[layer].to(ctx.dtype).t()).view(m, kvh, d)
        kk = rms_norm_reference(kk, k_norm_weight[layer], eps)
        kk = kk * cos[:, None, :] + rotate_half(kk) * sin[:, None, :]
        for n in range(len(lens)):
            rows = slice(cu[n], cu[n + 1])
            t = torch.arange(lens[n], lens[n] + cu[n + 1] - cu[n], device=ctx.device)
            if block_table is None:
                b = int(cache_batch_idx[n]) if cache_batch_idx is not None else n
                k_cache[layer, b, t] = kk[rows].to(k_cache.dtype)
                v_cache[layer, b, t] = vv[rows].to(v_cache.dtype)
            else:
                ps = k_cache.shape[2]
                pages = block_table[n].to(torch.int64)[t // ps]
                k_cache[layer, pages, t % ps] = kk[rows].to(k_cache.dtype)
                v_cache[layer, pages, t % ps] = vv[rows].to(v_cache.dtype)


@triton.jit
def _inject_kernel(
    ctx_ptr, kw_ptr, vw_ptr, knw_ptr, pos_ptr, cu_ptr, lens_ptr, table_ptr, inv_freq_ptr, kc_ptr, vc_ptr,
    M, H, N_REQ, KVH, HALF, page_size, CAP, attention_scaling, eps,
    stride_cm, stride_wl, stride_wr, stride_wk, stride_vwl, stride_vwr, stride_vwk, stride_nl,
    stride_kcl, stride_kcp, stride_kcs, stride_kch, stride_vcl, stride_vcp, stride_vcs, stride_vch, stride_tn,
    HAS_TABLE: tl.constexpr, DOT_PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_HALF: tl.constexpr, BLOCK_REQ: tl.constexpr,
):
    pid_m = tl.program_id(0)
    lh = tl.program_id(1)
    layer = (lh // KVH).to(tl.int64)
    h = lh % KVH
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    rows64 = rows.to(tl.int64)
    dh = tl.arange(0, BLOCK_HALF)
    dh_ok = dh < HALF
    d_lo = (h * 2 * HALF + dh).to(tl.int64)
    d_hi = d_lo + HALF
    acc_k_lo = tl.zeros((BLOCK_M, BLOCK_HALF), tl.float32)
    acc_k_hi = tl.zeros((BLOCK_M, BLOCK_HALF), tl.float32)
    acc_v_lo = tl.zeros((BLOCK_M, BLOCK_HALF), tl.float32)
    acc_v_hi = tl.zeros((BLOCK_M, BLOCK_HALF), tl.float32)
    kw_base = kw_ptr + layer * stride_wl
    vw_base = vw_ptr + layer * stride_vwl
    for k0 in range(0, H, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < H
        x = tl.load(ctx_ptr + rows64[:, None] * stride_cm + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0).to(tl.float32)
        wmask = dh_ok[:, None] & k_ok[None, :]
        w = tl.load(kw_base + d_lo[:, None] * stride_wr + ks[None, :] * stride_wk, mask=wmask, other=0.0)
        acc_k_lo = tl.dot(x, tl.trans(w.to(tl.float32)), acc_k_lo, input_precision=DOT_PREC)
        w = tl.load(kw_base + d_hi[:, None] * stride_wr + ks[None, :] * stride_wk, mask=wmask, other=0.0)
        acc_k_hi = tl.dot(x, tl.trans(w.to(tl.float32)), acc_k_hi, input_precision=DOT_PREC)
        w = tl.load(vw_base + d_lo[:, None] * stride_vwr + ks[None, :] * stride_vwk, mask=wmask, other=0.0)
        acc_v_lo = tl.dot(x, tl.trans(w.to(tl.float32)), acc_v_lo, input_precision=DOT_PREC)
        w = tl.load(vw_base + d_hi[:, None] * stride_vwr + ks[None, :] * stride_vwk, mask=wmask, other=0.0)
        acc_v_hi = tl.dot(x, tl.trans(w.to(tl.float32)), acc_v_hi, input_precision=DOT_PREC)
    pos = tl.load(pos_ptr + rows64, mask=row_ok, other=0).to(tl.int64)
    cos, sin = rope_cos_sin(pos, inv_freq_ptr, dh, dh_ok, attention_scaling)
    k_lo, k_hi = norm_rope_halves(acc_k_lo, acc_k_hi, knw_ptr + layer * stride_nl, dh, dh_ok, HALF, cos, sin, eps,
                                  True)
    # Request of each row = number of request ends (cu[1:]) at or before it; no host-side row map needed.
    rq = tl.arange(0, BLOCK_REQ)
    cu_next = tl.load(cu_ptr + 1 + rq, mask=rq < N_REQ, other=2147483647).to(tl.int64)
    req = tl.sum((cu_next[None, :] <= rows64[:, None]).to(tl.int32), axis=1)
    req = tl.minimum(req, N_REQ - 1).to(tl.int64)
    first = tl.load(cu_ptr + req, mask=row_ok, other=0).to(tl.int64)
    t = tl.load(lens_ptr + req, mask=row_ok, other=0).to(tl.int64) + (rows64 - first)
    # Rows past the cache capacity are dropped rather than wrapped or read past the block table.
    row_ok = row_ok & (t < CAP)
    if HAS_TABLE:
        page = tl.load(table_ptr + req * stride_tn + t // page_size, mask=row_ok, other=0).to(tl.int64)
    else:
        page = req
    slot = t % page_size
    smask = row_ok[:, None] & dh_ok[None, :]
    k_dst = kc_ptr + (layer * stride_kcl + page * stride_kcp + slot * stride_kcs + h * stride_kch)[:, None]
    v_dst = vc_ptr + (layer * stride_vcl + page * stride_vcp + slot * stride_vcs + h * stride_vch)[:, None]
    tl.store(k_dst + dh[None, :], k_lo.to(kc_ptr.dtype.element_ty), mask=smask)
    tl.store(k_dst + HALF + dh[None, :], k_hi.to(kc_ptr.dtype.element_ty), mask=smask)
    tl.store(v_dst + dh[None, :], acc_v_lo.to(vc_ptr.dtype.element_ty), mask=smask)
    tl.store(v_dst + HALF + dh[None, :], acc_v_hi.to(vc_ptr.dtype.element_ty), mask=smask)


def _inject_triton(ctx, k_weight, v_weight, k_norm_weight, positions, cu_ctx_lens, cache_lens, k_cache, v_cache,
                   inv_freq, attention_scaling, eps, block_table, cache_batch_idx):
    m, h = ctx.shape
    n_req = cu_ctx_lens.shape[0] - 1
    if m == 0 or n_req == 0:
        return
    n_layers, kvh, d = k_weight.shape[0], k_cache.shape[3], k_cache.shape[4]
    table, _ = page_table(OP, n_req, block_table, cache_batch_idx, ctx.device)
    half = d // 2
    if interpreting():
        block_m, block_k = min(64, max(16, next_pow2(m))), min(256, max(16, next_pow2(h)))
    else:
        block_m, block_k = (16 if m <= 16 else 64), 64
    dot_prec = "ieee" if ctx.dtype == torch.float32 or k_weight.dtype == torch.float32 else "tf32"
    _inject_kernel[(triton.cdiv(m, block_m), n_layers * kvh)](
        ctx_ptr=ctx, kw_ptr=k_weight, vw_ptr=v_weight, knw_ptr=k_norm_weight, pos_ptr=positions, cu_ptr=cu_ctx_lens,
        lens_ptr=cache_lens, table_ptr=table if table is not None else cache_lens,
        inv_freq_ptr=inv_freq.to(torch.float32), kc_ptr=k_cache, vc_ptr=v_cache,
        M=m, H=h, N_REQ=n_req, KVH=kvh, HALF=half, page_size=k_cache.shape[2],
        CAP=table.shape[1] * k_cache.shape[2] if table is not None else k_cache.shape[2],
        attention_scaling=float(attention_scaling), eps=float(eps), stride_cm=ctx.stride(0),
        stride_wl=k_weight.stride(0), stride_wr=k_weight.stride(1), stride_wk=k_weight.stride(2),
        stride_vwl=v_weight.stride(0), stride_vwr=v_weight.stride(1), stride_vwk=v_weight.stride(2),
        stride_nl=k_norm_weight.stride(0),
        stride_kcl=k_cache.stride(0), stride_kcp=k_cache.stride(1), stride_kcs=k_cache.stride(2),
        stride_kch=k_cache.stride(3),
        stride_vcl=v_cache.stride(0), stride_vcp=v_cache.stride(1), stride_vcs=v_cache.stride(2),
        stride_vch=v_cache.stride(3), stride_tn=table.stride(0) if table is not None else 0,
        HAS_TABLE=table is not None, DOT_PREC=dot_prec, BLOCK_M=block_m, BLOCK_K=block_k,
        BLOCK_HALF=max(16, next_pow2(half)), BLOCK_REQ=next_pow2(n_req),
    )


def inject_context_kv(ctx: torch.Tensor, k_weight: torch.Tensor, v_weight: torch.Tensor, k_norm_weight: torch.Tensor,
                      positions: torch.Tensor, cu_ctx_lens: torch.Tensor, cache_lens: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, *, inv_freq: torch.Tensor,
                      attention_scaling: float = 1.0, eps: float = 1e-6, block_table: Optional[torch.Tensor] = None,
                      cache_batch_idx: Optional[torch.Tensor] = None, backend: str = "auto") -> None:
    """Write the K/V of new context rows for all draft layers into the context KV cache (in place).

    Context K/V depend only on the fused context (``fused_context`` output), not on earlier draft layers,
    so one launch computes every layer: K = RoPE(k_norm(ctx @ Wk_l^T)), V = ctx @ Wv_l^T (no bias), with
    fp32 accumulation, fp32 norm statistics and NeoX rotate_half RoPE at ``positions``. No host sync.

    Args:
        ctx: ``[M, H]`` new context rows of all requests, request by request (fp32/bf16/fp16).
        k_weight, v_weight: ``[L, kvH*D, H]`` stacked ``k_proj.weight`` / ``v_proj.weight`` of the L layers.
        k_norm_weight: ``[L, D]`` stacked ``k_norm.weight``.
        positions: ``[M]`` int64 absolute positions of the rows (RoPE).
        cu_ctx_lens: ``[N_req+1]`` int32/int64 row offsets: request n owns rows ``cu[n]:cu[n+1]``.
        cache_lens: ``[N_req]`` int32/int64: request n's rows go to cache rows ``cache_lens[n] + 0, 1, ...``.
            Not modified (advance it yourself by ``cu[n+1]-cu[n]``).
        k_cache, v_cache: contiguous ``[L, N_cap, max_len, kvH, D]`` (request n -> batch row
            ``cache_batch_idx[n]``, default n) or paged ``[L, num_pages, page_size, kvH, D]`` with
            ``block_table`` ``[N_req, max_pages]`` (page ids shared by all layers). Any float dtype.
            Only the M rows x L layers x kvH heads are written; rows past the capacity (max_len, or
            max_pages * page_size) are dropped.
        inv_freq: ``[D/2]`` fp32, ``attention_scaling``: from transformers' ``ROPE_INIT_FUNCTIONS``.
        eps: RMSNorm epsilon of k_norm.
        backend: ``"auto" | "triton" | "torch"``.
    """
    _validate(ctx, k_weight, v_weight, k_norm_weight, positions, cu_ctx_lens, cache_lens, k_cache, v_cache, inv_freq,
              block_table, cache_batch_idx)
    chosen = resolve_backend(OP, backend, ctx.device, available=_BACKENDS)
    torch.ops.dflash.inject_context_kv(ctx, k_weight, v_weight, k_norm_weight, positions, cu_ctx_lens, cache_lens,
                                       k_cache, v_cache, inv_freq, float(attention_scaling), float(eps), block_table,
                                       cache_batch_idx, chosen)


@torch.library.custom_op("dflash::inject_context_kv", mutates_args=("k_cache", "v_cache"))
def _inject_context_kv_op(ctx: torch.Tensor, k_weight: torch.Tensor, v_weight: torch.Tensor,
                          k_norm_weight: torch.Tensor, positions: torch.Tensor, cu_ctx_lens: torch.Tensor,
                          cache_lens: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          inv_freq: torch.Tensor, attention_scaling: float, eps: float,
                          block_table: Optional[torch.Tensor], cache_batch_idx: Optional[torch.Tensor],
                          backend: str) -> None:
    """``torch.ops.dflash.inject_context_kv``: :func:`inject_context_kv` after validation (writes k_cache, v_cache)."""
    chosen = resolve_backend(OP, backend, ctx.device, available=_BACKENDS)
    if chosen == "torch":
        inject_context_kv_reference(ctx, k_weight, v_weight, k_norm_weight, positions, cu_ctx_lens, cache_lens,
                                    k_cache, v_cache, inv_freq=inv_freq, attention_scaling=attention_scaling, eps=eps,
                                    block_table=block_table, cache_batch_idx=cache_batch_idx)
        return
    _inject_triton(ctx, k_weight, v_weight, k_norm_weight, positions, cu_ctx_lens, cache_lens, k_cache, v_cache,
                   inv_freq, attention_scaling, eps, block_table, cache_batch_idx)


@_inject_context_kv_op.register_fake
def _inject_context_kv_fake(ctx, k_weight, v_weight, k_norm_weight, positions, cu_ctx_lens, cache_lens, k_cache,
                            v_cache, inv_freq, attention_scaling, eps, block_table, cache_batch_idx, backend):
    return None

"""inject_context_kv: one draft layer's projected context rows -> k_norm + RoPE on K -> the layer's context KV cache."""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from dflash_kernels._dispatch import call_op, checked_by, registered, resolve_backend
from dflash_kernels._triton_utils import (
    FLOAT_DTYPES, check_cache_index_values, check_cache_pair, check_index_values, check_last_dim_contiguous,
    check_tensor, next_pow2, norm_rope_halves, page_table, rms_norm_reference, rope_cos_sin, rope_cos_sin_reference,
    rotate_half,
)
from dflash_kernels.draft_attention import write_cache_rows_reference

OP = "inject_context_kv"
_BACKENDS = ("triton", "torch")  # and the wings' registered bodies (dflash_kernels.cpu)


def _validate(k, v, k_norm_weight, cu_ctx_lens, cache_lens, k_cache, v_cache, inv_freq, block_table, cache_batch_idx,
              slot_mapping):
    check_tensor(OP, "k", k, ndim=3, dtypes=FLOAT_DTYPES)
    dev = k.device
    m, kvh, d = k.shape
    check_last_dim_contiguous(OP, "k", k)
    check_tensor(OP, "v", v, ndim=3, dtypes=(k.dtype,), device=dev)
    check_last_dim_contiguous(OP, "v", v)
    if v.shape != k.shape:
        raise ValueError(f"{OP}: v must have k's shape [M, kvH, D] = {tuple(k.shape)}, got {tuple(v.shape)}")
    if d < 2 or d % 2:
        raise ValueError(f"{OP}: head dim D={d} must be even (RoPE)")
    check_cache_pair(OP, k_cache, v_cache, ndim=4, kv_heads=kvh, head_dim=d, device=dev,
                     any_strides=slot_mapping is not None)
    check_tensor(OP, "k_norm_weight", k_norm_weight, ndim=1, dtypes=FLOAT_DTYPES, device=dev)
    if k_norm_weight.shape[0] != d:
        raise ValueError(f"{OP}: k_norm_weight must be [D={d}] (the layer's k_norm.weight), "
                         f"got {tuple(k_norm_weight.shape)}")
    check_tensor(OP, "cu_ctx_lens", cu_ctx_lens, ndim=1, dtypes=(torch.int64, torch.int32), device=dev)
    n_req = cu_ctx_lens.shape[0] - 1
    if n_req < 0:
        raise ValueError(f"{OP}: cu_ctx_lens must be [N_req+1] row offsets starting at 0, got an empty tensor")
    check_tensor(OP, "cache_lens", cache_lens, ndim=1, dtypes=(torch.int64, torch.int32), device=dev)
    if cache_lens.shape[0] != n_req:
        raise ValueError(f"{OP}: cache_lens must be [N_req={n_req}] (= len(cu_ctx_lens) - 1), "
                         f"got {tuple(cache_lens.shape)}")
    check_tensor(OP, "inv_freq", inv_freq, ndim=1, dtypes=(torch.float32, torch.float64), device=dev)
    if inv_freq.shape[0] != d // 2:
        raise ValueError(f"{OP}: inv_freq must be [D/2={d // 2}], got {tuple(inv_freq.shape)}")
    page_table(OP, n_req, block_table, cache_batch_idx, dev)
    check_cache_index_values(OP, k_cache, cache_lens, block_table, cache_batch_idx)
    if slot_mapping is not None:
        if block_table is not None or cache_batch_idx is not None:
            raise ValueError(f"{OP}: slot_mapping addresses the cache by itself; pass neither block_table nor "
                             "cache_batch_idx with it")
        check_tensor(OP, "slot_mapping", slot_mapping, ndim=1, dtypes=(torch.int64, torch.int32), device=dev)
        if slot_mapping.shape[0] != m:
            raise ValueError(f"{OP}: slot_mapping must be [M={m}] (one cache slot per row of k), "
                             f"got {tuple(slot_mapping.shape)}")
        slots = k_cache.shape[0] * k_cache.shape[1]
        check_index_values(OP, "slot_mapping", slot_mapping, -1, slots,
                           f"slots of a cache of {k_cache.shape[0]} pages x {k_cache.shape[1]} rows, or -1 to skip")
    if dev.type == "cpu":  # the offsets address k's and v's rows (see check_index_values)
        cu = cu_ctx_lens.tolist()
        if cu[0] != 0 or any(a > b for a, b in zip(cu, cu[1:])) or cu[-1] > m:
            raise ValueError(f"{OP}: cu_ctx_lens must start at 0, never decrease and end at most at M={m} (k's rows), "
                             f"got {cu}")


def inject_context_kv_reference(k, v, k_norm_weight, cu_ctx_lens, cache_lens, k_cache, v_cache, *, inv_freq,
                                attention_scaling: float = 1.0, eps: float = 1e-6, block_table=None,
                                cache_batch_idx=None, slot_mapping=None) -> None:
    """Definition (HF Qwen3 numerics in k's dtype; static shapes, no host read).

    Request n's rows cu[n]..cu[n+1]-1 sit at positions t = cache_lens[n] + (0, 1, ...): the cache gets
    K = RoPE(k_norm(k_row), t) and V = v_row at row t (rows at or past the capacity are dropped, and so
    are rows at or past cu[N]); with ``slot_mapping``, row i goes to flat slot ``slot_mapping[i]`` instead
    (-1: dropped)."""
    m, n_req = k.shape[0], cache_lens.shape[0]
    if m == 0 or n_req == 0:
        return
    page_size = k_cache.shape[1]
    capacity = block_table.shape[1] * page_size if block_table is not None else page_size
    cu, lens = cu_ctx_lens.to(torch.int64), cache_lens.to(torch.int64)
    rows = torch.arange(m, device=k.device)
    req = torch.searchsorted(cu[1:], rows, right=True).clamp_max(n_req - 1)  # request owning each row
    t = lens[req] + (rows - cu[req])
    cos, sin = rope_cos_sin_reference(t, inv_freq, attention_scaling, k.dtype)
    kk = rms_norm_reference(k.contiguous(), k_norm_weight, eps)
    kk = kk * cos[:, None, :] + rotate_half(kk) * sin[:, None, :]
    placed = t < capacity if slot_mapping is None else slot_mapping >= 0
    write_cache_rows_reference(k_cache, v_cache, req, t, (rows < cu[-1]) & placed, kk, v, block_table,
                               cache_batch_idx, slot_mapping)


@triton.jit
def _inject_kernel(
    k_ptr, v_ptr, knw_ptr, cu_ptr, lens_ptr, table_ptr, inv_freq_ptr, kc_ptr, vc_ptr,
    M, N_REQ, HALF, page_size, CAP, attention_scaling, eps,
    stride_km, stride_kh, stride_vm, stride_vh,
    stride_kcp, stride_kcs, stride_kch, stride_vcp, stride_vcs, stride_vch, stride_tn,
    HAS_TABLE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_REQ: tl.constexpr,
):
    pid_m = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    # k's rows at or past cu[N_REQ] (allowed: cu[N_REQ] <= M) belong to no request and are never written.
    row_ok = (rows < M) & (rows < tl.load(cu_ptr + N_REQ))
    rows64 = rows.to(tl.int64)
    dh = tl.arange(0, BLOCK_HALF)
    dh_ok = dh < HALF
    # Request of each row = number of request ends (cu[1:]) at or before it; no host-side row map needed.
    rq = tl.arange(0, BLOCK_REQ)
    cu_next = tl.load(cu_ptr + 1 + rq, mask=rq < N_REQ, other=2147483647).to(tl.int64)
    req = tl.sum((cu_next[None, :] <= rows64[:, None]).to(tl.int32), axis=1)
    req = tl.minimum(req, N_REQ - 1).to(tl.int64)
    first = tl.load(cu_ptr + req, mask=row_ok, other=0).to(tl.int64)
    # The rows of a request are consecutive positions from its cache length: position = cache row.
    t = tl.load(lens_ptr + req, mask=row_ok, other=0).to(tl.int64) + (rows64 - first)
    # Rows past the cache capacity are dropped rather than wrapped or read past the block table.
    row_ok = row_ok & (t < CAP)
    lmask = row_ok[:, None] & dh_ok[None, :]
    # Both halves of D in registers: the rotate_half partner of dim i is dim i +- HALF.
    k_src = k_ptr + (rows64 * stride_km + h * stride_kh)[:, None] + dh[None, :]
    v_src = v_ptr + (rows64 * stride_vm + h * stride_vh)[:, None] + dh[None, :]
    k_lo = tl.load(k_src, mask=lmask, other=0.0).to(tl.float32)
    k_hi = tl.load(k_src + HALF, mask=lmask, other=0.0).to(tl.float32)
    v_lo = tl.load(v_src, mask=lmask, other=0.0).to(tl.float32)
    v_hi = tl.load(v_src + HALF, mask=lmask, other=0.0).to(tl.float32)
    cos, sin = rope_cos_sin(t, inv_freq_ptr, dh, dh_ok, attention_scaling)
    k_lo, k_hi = norm_rope_halves(k_lo, k_hi, knw_ptr, dh, dh_ok, HALF, cos, sin, eps, True)
    if HAS_TABLE:
        page = tl.load(table_ptr + req * stride_tn + t // page_size, mask=row_ok, other=0).to(tl.int64)
    else:
        page = req
    slot = t % page_size
    k_dst = kc_ptr + (page * stride_kcp + slot * stride_kcs + h * stride_kch)[:, None] + dh[None, :]
    v_dst = vc_ptr + (page * stride_vcp + slot * stride_vcs + h * stride_vch)[:, None] + dh[None, :]
    tl.store(k_dst, k_lo.to(kc_ptr.dtype.element_ty), mask=lmask)
    tl.store(k_dst + HALF, k_hi.to(kc_ptr.dtype.element_ty), mask=lmask)
    tl.store(v_dst, v_lo.to(vc_ptr.dtype.element_ty), mask=lmask)
    tl.store(v_dst + HALF, v_hi.to(vc_ptr.dtype.element_ty), mask=lmask)


def _inject_triton(k, v, k_norm_weight, cu_ctx_lens, cache_lens, k_cache, v_cache, inv_freq, attention_scaling, eps,
                   block_table, cache_batch_idx):
    m, kvh, d = k.shape
    n_req = cu_ctx_lens.shape[0] - 1
    if m == 0 or n_req == 0:
        return
    table, _ = page_table(OP, n_req, block_table, cache_batch_idx, k.device)
    half = d // 2
    block_m = min(16, max(2, next_pow2(m)))
    _inject_kernel[(triton.cdiv(m, block_m), kvh)](
        k_ptr=k, v_ptr=v, knw_ptr=k_norm_weight, cu_ptr=cu_ctx_lens, lens_ptr=cache_lens,
        table_ptr=table if table is not None else cache_lens, inv_freq_ptr=inv_freq.to(torch.float32),
        kc_ptr=k_cache, vc_ptr=v_cache, M=m, N_REQ=n_req, HALF=half, page_size=k_cache.shape[1],
        CAP=table.shape[1] * k_cache.shape[1] if table is not None else k_cache.shape[1],
        attention_scaling=float(attention_scaling), eps=float(eps),
        stride_km=k.stride(0), stride_kh=k.stride(1), stride_vm=v.stride(0), stride_vh=v.stride(1),
        stride_kcp=k_cache.stride(0), stride_kcs=k_cache.stride(1), stride_kch=k_cache.stride(2),
        stride_vcp=v_cache.stride(0), stride_vcs=v_cache.stride(1), stride_vch=v_cache.stride(2),
        stride_tn=table.stride(0) if table is not None else 0,
        HAS_TABLE=table is not None, BLOCK_M=block_m, BLOCK_HALF=max(16, next_pow2(half)),
        BLOCK_REQ=next_pow2(n_req),
    )


def inject_context_kv(k: torch.Tensor, v: torch.Tensor, k_norm_weight: torch.Tensor, cu_ctx_lens: torch.Tensor,
                      cache_lens: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *,
                      inv_freq: torch.Tensor, attention_scaling: float = 1.0, eps: float = 1e-6,
                      block_table: Optional[torch.Tensor] = None, cache_batch_idx: Optional[torch.Tensor] = None,
                      slot_mapping: Optional[torch.Tensor] = None, backend: str = "auto") -> None:
    """Write one draft layer's K/V of new context rows into its context KV cache (in place).

    The rows' ``k_proj`` / ``v_proj`` outputs come in already projected (the engine computes them in the
    layer's merged QKV GEMM, stacked under the block rows, so the K/V weights are read once per step);
    this applies ``k_norm`` (fp32 statistics) and NeoX rotate_half RoPE to K and stores K and V. Request
    n's rows are consecutive positions ``cache_lens[n] + 0, 1, ...`` (RoPE position = cache row, unless
    ``slot_mapping`` places the rows). One launch, no host sync.

    Args:
        k, v: ``[M, kvH, D]`` raw projections of the new context rows of all requests, request by request
            (fp32/bf16/fp16, last dim contiguous; rows and heads may be strided, e.g. column views of a
            merged QKV output viewed as ``[M, kvH, D]``). D even.
        k_norm_weight: ``[D]``, the layer's ``k_norm.weight``.
        cu_ctx_lens: ``[N_req+1]`` int32/int64 row offsets: request n owns rows ``cu[n]:cu[n+1]``.
        cache_lens: ``[N_req]`` int32/int64: request n's rows go to cache rows (= positions)
            ``cache_lens[n] + 0, 1, ...``. Not modified (advance it yourself by ``cu[n+1]-cu[n]``).
        k_cache, v_cache: **one layer**: contiguous ``[N_cap, max_len, kvH, D]`` (request n -> batch row
            ``cache_batch_idx[n]``, default n) or paged ``[num_pages, page_size, kvH, D]`` with
            ``block_table`` ``[N_req, max_pages]``. Any float dtype. Only the M rows x kvH heads are written;
            rows past the capacity (max_len, or max_pages * page_size) are dropped.
        slot_mapping: ``[M]`` int32/int64, vLLM's addressing of a paged cache ``[num_pages, page_size, kvH, D]``:
            row i goes to page ``slot_mapping[i] // page_size``, row ``slot_mapping[i] % page_size``; -1 (vLLM's
            padding) skips the row. The caches may then have any strides (vLLM's CPU cache keeps K transposed
            inside each page); positions still come from ``cache_lens``. Backends "torch" and "cpu" (the
            reference); "triton" refuses it.
        inv_freq: ``[D/2]`` fp32, ``attention_scaling``: from transformers' ``ROPE_INIT_FUNCTIONS``.
        eps: RMSNorm epsilon of k_norm.
        backend: ``"auto" | "triton" | "cpu" | "torch"`` (``"cpu"``: CPU tensors; fp32 into a contiguous
            cache in C, else the reference).
    """
    chosen = resolve_backend(OP, backend, k.device, available=_BACKENDS)
    if slot_mapping is not None and chosen == "triton":
        raise ValueError(f"{OP}: slot_mapping is supported by backend 'torch' or 'cpu', not 'triton'; pass one of them")
    call_op(_inject_context_kv_op, k, v, k_norm_weight, cu_ctx_lens, cache_lens, k_cache, v_cache, inv_freq,
            float(attention_scaling), float(eps), block_table, cache_batch_idx, slot_mapping, chosen, device=k.device)


def _check(k, v, k_norm_weight, cu_ctx_lens, cache_lens, k_cache, v_cache, inv_freq, attention_scaling, eps,
           block_table, cache_batch_idx, slot_mapping, backend):
    _validate(k, v, k_norm_weight, cu_ctx_lens, cache_lens, k_cache, v_cache, inv_freq, block_table, cache_batch_idx,
              slot_mapping)


@torch.library.custom_op("dflash::inject_context_kv", mutates_args=("k_cache", "v_cache"))
@checked_by(_check)
def _inject_context_kv_op(k: torch.Tensor, v: torch.Tensor, k_norm_weight: torch.Tensor, cu_ctx_lens: torch.Tensor,
                          cache_lens: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          inv_freq: torch.Tensor, attention_scaling: float, eps: float,
                          block_table: Optional[torch.Tensor], cache_batch_idx: Optional[torch.Tensor],
                          slot_mapping: Optional[torch.Tensor], backend: str) -> None:
    """``torch.ops.dflash.inject_context_kv``: :func:`inject_context_kv` after validation (writes k_cache, v_cache)."""
    chosen = resolve_backend(OP, backend, k.device, available=_BACKENDS)
    body = registered(OP, chosen)
    if body is not None:
        body(k, v, k_norm_weight, cu_ctx_lens, cache_lens, k_cache, v_cache, inv_freq, attention_scaling, eps,
             block_table, cache_batch_idx, slot_mapping)
        return
    if chosen == "torch":
        inject_context_kv_reference(k, v, k_norm_weight, cu_ctx_lens, cache_lens, k_cache, v_cache, inv_freq=inv_freq,
                                    attention_scaling=attention_scaling, eps=eps, block_table=block_table,
                                    cache_batch_idx=cache_batch_idx, slot_mapping=slot_mapping)
        return
    _inject_triton(k, v, k_norm_weight, cu_ctx_lens, cache_lens, k_cache, v_cache, inv_freq, attention_scaling, eps,
                   block_table, cache_batch_idx)


@_inject_context_kv_op.register_fake
def _inject_context_kv_fake(k, v, k_norm_weight, cu_ctx_lens, cache_lens, k_cache, v_cache, inv_freq,
                            attention_scaling, eps, block_table, cache_batch_idx, slot_mapping, backend):
    return None

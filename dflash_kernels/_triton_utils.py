"""Small helpers shared by the Triton ops: validation messages, launch heuristics, jit helpers."""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def next_pow2(x: int) -> int:
    return triton.next_power_of_2(max(1, int(x)))


def check_tensor(op: str, name: str, t, *, ndim=None, dtypes=None, device=None) -> None:
    """Raise TypeError/ValueError naming ``name`` before any work is done."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if t.dim() not in allowed:
            raise ValueError(f"{op}: {name} must have {' or '.join(map(str, allowed))} dims, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{op}: {name} has dtype {t.dtype}; use one of {tuple(dtypes)} (e.g. {name}.to({dtypes[0]}))")
    if device is not None and t.device != device:
        raise ValueError(f"{op}: {name} is on {t.device} but the other inputs are on {device}; move it with .to({str(device)!r})")


def check_shape(op: str, name: str, t: torch.Tensor, expected: tuple, what: str = "") -> None:
    if tuple(t.shape) != tuple(expected):
        hint = f" ({what})" if what else ""
        raise ValueError(f"{op}: {name} must have shape {tuple(expected)}{hint}, got {tuple(t.shape)}")


def check_last_dim_contiguous(op: str, name: str, t: torch.Tensor) -> None:
    if t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{op}: {name} must be contiguous in its last dim (stride 1); pass {name}.contiguous()")


def check_index_values(op: str, name: str, t, low: int, high: int | None = None, what: str = "") -> None:
    """Raise ValueError unless every value of the integer tensor ``t`` (None: nothing to check) lies in
    ``[low, high)`` (``high`` None: no upper bound). Reads the values only when ``t`` is on the CPU, where that is
    free and where the C kernels, the references (host indexing: a negative index would pick a row from the
    end) and the Triton interpreter use them as addresses; on a GPU the kernels read them (no host sync)."""
    if t is None or t.device.type != "cpu" or t.numel() == 0:
        return
    if t.numel() <= 256:  # a list's min and max: ~1 us, against ~5 us for torch.aminmax
        values = t.reshape(-1).tolist()
        lo, hi = min(values), max(values)
    else:
        lo, hi = (int(x) for x in torch.aminmax(t))
    if lo < low or (high is not None and hi >= high):
        bound = f"[{low}, {high})" if high is not None else f">= {low}"
        hint = f" ({what})" if what else ""
        raise ValueError(f"{op}: {name} values must be {bound}{hint}; got values from {lo} to {hi}")


def check_cache_index_values(op: str, k_cache: torch.Tensor, cache_lens, block_table, cache_batch_idx) -> None:
    """The index values of a cache's addressing (:func:`check_index_values`): lengths non-negative, batch rows and
    pages inside the cache (``k_cache.shape[0]`` of them)."""
    check_index_values(op, "cache_lens", cache_lens, 0, what="cached rows per request")
    rows = k_cache.shape[0]
    check_index_values(op, "cache_batch_idx", cache_batch_idx, 0, rows, f"batch rows of a cache of {rows}")
    check_index_values(op, "block_table", block_table, 0, rows, f"page ids of a cache of {rows} pages")


def as_index_tensor(op: str, name: str, value, device: torch.device) -> torch.Tensor:
    """An int -> a new ``[1]`` int64 tensor on ``device``; a 1-element int32/int64 tensor -> itself as ``[1]``
    (a view, never a copy, so that a CUDA-graph replay reads the value it holds then)."""
    if isinstance(value, bool):
        raise TypeError(f"{op}: {name} must be an int or a 1-element integer tensor, got bool")
    if isinstance(value, int):
        return torch.tensor([value], dtype=torch.int64, device=device)
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{op}: {name} tensor must hold exactly one int32/int64 element, got shape "
                             f"{tuple(value.shape)} dtype {value.dtype}")
        if value.device != device:
            raise ValueError(f"{op}: {name} is on {value.device}; put it on {device}")
        return value.reshape(1)
    raise TypeError(f"{op}: {name} must be an int or a 1-element integer tensor, got {type(value).__name__}")


@triton.jit
def rope_cos_sin(pos, inv_freq_ptr, offs_half, mask_half, attention_scaling):
    """cos/sin [R, HALF] for fp32-converted positions ``pos`` [R] (HF: freqs computed in fp32)."""
    inv_freq = tl.load(inv_freq_ptr + offs_half, mask=mask_half, other=0.0).to(tl.float32)
    freqs = pos.to(tl.float32)[:, None] * inv_freq[None, :]
    return tl.cos(freqs) * attention_scaling, tl.sin(freqs) * attention_scaling


def rope_cos_sin_reference(positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float,
                           dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """HF Llama/Qwen3 rotary tables: freqs in fp32, cos/sin (fp64 when ``dtype`` is fp64) cast to ``dtype``."""
    freqs = positions.to(torch.float32)[..., None] * inv_freq.to(torch.float32)
    emb = torch.cat((freqs, freqs), dim=-1)
    if dtype == torch.float64:
        emb = emb.double()
    return (emb.cos() * attention_scaling).to(dtype), (emb.sin() * attention_scaling).to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3RMSNorm: fp32 statistics (fp64 for fp64 input), cast back, then times the weight."""
    xf = x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight.to(x.dtype) * xf.to(x.dtype)


@triton.jit
def norm_rope_halves(x_lo, x_hi, w_ptr, offs_half, mask_half, HALF, cos, sin, eps, APPLY_NORM: tl.constexpr):
    """Per-head RMSNorm over D = 2*HALF (weight halves from ``w_ptr``), then NeoX rotate_half RoPE.

    x_lo/x_hi: [R, BLOCK_HALF] fp32 holding dims [0, HALF) and [HALF, D); padded lanes must be zero.
    """
    if APPLY_NORM:
        ss = tl.sum(x_lo * x_lo, axis=1) + tl.sum(x_hi * x_hi, axis=1)
        rstd = tl.rsqrt(ss / (2 * HALF) + eps)
        w_lo = tl.load(w_ptr + offs_half, mask=mask_half, other=0.0).to(tl.float32)
        w_hi = tl.load(w_ptr + HALF + offs_half, mask=mask_half, other=0.0).to(tl.float32)
        x_lo = x_lo * rstd[:, None] * w_lo[None, :]
        x_hi = x_hi * rstd[:, None] * w_hi[None, :]
    return x_lo * cos - x_hi * sin, x_hi * cos + x_lo * sin


def check_cache_pair(op: str, k_cache, v_cache, *, ndim: int, kv_heads: int, head_dim: int, device,
                     any_strides: bool = False) -> None:
    """Shapes, dtypes and device of a K/V cache pair; the last dim contiguous unless ``any_strides`` (caches that
    only host-indexed paths write)."""
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(op, name, c, ndim=ndim, dtypes=FLOAT_DTYPES, device=device)
        if not any_strides:
            check_last_dim_contiguous(op, name, c)
        if c.shape[-2] != kv_heads or c.shape[-1] != head_dim:
            raise ValueError(f"{op}: {name} must end in [..., kvH={kv_heads}, D={head_dim}], got {tuple(c.shape)}")
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"{op}: k_cache {tuple(k_cache.shape)}/{k_cache.dtype} and v_cache "
                         f"{tuple(v_cache.shape)}/{v_cache.dtype} must have the same shape and dtype")


def page_table(op: str, n_req: int, block_table, cache_batch_idx, device):
    """(table [N, P] or None, paged?) — a contiguous cache is a paged one with page_size = max_len and
    table[n, 0] = cache_batch_idx[n], so the kernels have one addressing scheme."""
    if block_table is not None and cache_batch_idx is not None:
        raise ValueError(f"{op}: pass block_table (paged cache) or cache_batch_idx (contiguous cache), not both")
    if block_table is not None:
        check_tensor(op, "block_table", block_table, ndim=2, dtypes=(torch.int32, torch.int64), device=device)
        if block_table.shape[0] != n_req:
            raise ValueError(f"{op}: block_table must be [N_req={n_req}, max_pages], got {tuple(block_table.shape)}")
        return block_table, True
    if cache_batch_idx is not None:
        check_tensor(op, "cache_batch_idx", cache_batch_idx, ndim=1, dtypes=(torch.int32, torch.int64), device=device)
        if cache_batch_idx.shape[0] != n_req:
            raise ValueError(f"{op}: cache_batch_idx must be [N_req={n_req}], got {tuple(cache_batch_idx.shape)}")
        return cache_batch_idx.view(n_req, 1), False
    return None, False


@triton.jit
def round_to(x, DTYPE: tl.constexpr):
    """fp32 ``x`` rounded to DTYPE (nearest even), returned as fp32 so that the store is exact.

    The CPU interpreter truncates fp32 -> bf16 casts, so bf16 rounds by integer ops here; the GPU gives
    the same bits (NaN passes through unchanged)."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        return tl.where(x == x, bits.to(tl.float32, bitcast=True), x)
    else:
        return x.to(DTYPE).to(tl.float32)

"""qkv_proj: a draft layer's merged QKV projection over its block rows and its context rows, in one GEMM.

The draft step stacks the block's normed rows (rows ``:q_rows``) over the context rows (rows ``q_rows:``) and
projects both with the merged ``[q; k; v]`` weight ``[N, K]`` (``merged_weight``), so that the K/V weight is read
once per step. Nothing reads the Q columns (``:q_cols``) of the context rows (only their K/V go to the context
cache): this GEMM neither computes nor writes the column tiles that hold only those, and leaves them as they were
in ``out``. DFlash2's attention-side ``prepare`` convolution of the block rows can run in the x-tile load
(``conv_dynamic`` / ``conv_base``, :func:`dflash_kernels.dynamic_conv.gemm_x_tile`): each block-row tile is
convolved and rounded to the dtype once, the value ``grouped_dynamic_conv`` would have stored, so the convolved
rows are never written and read back.

Numerics: ``F.linear`` in the input dtype: fp32 accumulation, rounded once to the dtype; 16-bit inputs go into
the dots as 16-bit operands on the GPU, fp32 inputs use IEEE fp32 dots, the interpreter converts every load to fp32.

Tiles: a program owns ``BLOCK_N`` output columns and ``BLOCK_M`` rows, up to ``MAX_BLOCK_M`` = 256 rows on the GPU
(batch 8 x block 16 x 2 = 256 rows: one row tile, the weight read once). A column tile holding only Q columns
runs the row tiles that hold block rows only.

Launches and bytes per call on the GPU path (e = element size; :func:`qkv_proj_cost` is this rule in code): 1
launch (none when there are no rows or no columns); reads x ``[M, K]`` once (again by every column tile, from L2)
and the weight once per row tile: Q-only column tiles ``ceil(q_rows / BLOCK_M)`` times, the others
``ceil(M / BLOCK_M)`` times; writes the block rows' ``N`` columns and the context rows' ``N - q_cols``; with a
convolution, also reads its dynamic kernels and base once.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from dflash_kernels._dispatch import call_op, checked_by, resolve_backend
from dflash_kernels._triton_utils import (
    FLOAT_DTYPES, check_last_dim_contiguous, check_tensor, interpreting, next_pow2, round_to,
)
from dflash_kernels.dynamic_conv import check_fused_conv, gemm_x_tile, grouped_dynamic_conv_reference, overlap

OP = "qkv_proj"
MAX_BLOCK_M = 256
_BACKENDS = ("triton", "torch")


def qkv_proj_reference(x: torch.Tensor, weight: torch.Tensor, q_rows: int, conv_dynamic: Optional[torch.Tensor] = None,
                       conv_base: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Definition: ``F.linear(x, weight)`` ``[M, N]`` in x's dtype, every column of every row (the op writes all
    but the context rows' Q columns of it). With ``conv_dynamic`` / ``conv_base`` ``[n, B, ...]``, the block rows
    ``x[:q_rows]`` (``q_rows = n * B``) are first replaced by their grouped dynamic convolution
    (:func:`dflash_kernels.dynamic_conv.grouped_dynamic_conv_reference`, DFlash2's ``prepare``)."""
    if conv_dynamic is not None:
        block = x[:q_rows].reshape(*conv_dynamic.shape[:2], x.shape[-1])
        convolved = grouped_dynamic_conv_reference(block, conv_dynamic, conv_base)
        x = torch.cat([convolved.reshape(q_rows, x.shape[-1]), x[q_rows:]])
    return F.linear(x, weight.to(x.dtype))


def _tile(m: int, fp32: bool) -> tuple[dict, dict]:
    """(BLOCK_M/N/K, launch options) on the GPU for ``m`` rows: one row tile up to ``MAX_BLOCK_M`` rows (the weight
    read once); 32 columns a program (192 programs at Qwen3-8B's N = 6144, enough weight bytes in flight on 132
    SMs) up to 16 rows, 64 at 16-bit m <= 128 (x, re-read by every column program from L2, at most as many bytes
    as the weight), 32 above 128 rows (the [256, 32] fp32 accumulator). fp32 operands (IEEE dots on FMA units)
    take smaller column and K tiles. Above 64 rows, two pipeline stages (and above 128 rows K tiles of 32, 16 in
    fp32) keep the convolving load's shared memory under an H200 SM's 227 KB, at 0 spills
    (tests/kernels/aot_compile_sm90.py).
    Guesses to be measured on the GPU (bench/kernels.py)."""
    block_m = min(MAX_BLOCK_M, max(16, next_pow2(m)))
    if block_m == 16:
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64 if fp32 else 128), dict(num_warps=4)
    if block_m <= 128:
        return (dict(BLOCK_M=block_m, BLOCK_N=32 if fp32 else 64, BLOCK_K=32 if fp32 else 64),
                dict(num_warps=4) if block_m <= 64 else dict(num_warps=8, num_stages=2))
    return (dict(BLOCK_M=block_m, BLOCK_N=16 if fp32 else 32, BLOCK_K=16 if fp32 else 32),
            dict(num_warps=8, num_stages=2))


def qkv_proj_cost(m: int, q_rows: int, k: int, n: int, q_cols: int, elem: int,
                  conv_bytes: int | None = None) -> tuple[int, int, int]:
    """(launches, HBM bytes, weight reads of the K/V columns) of one call on the GPU path with the GPU tiles
    (:func:`_tile`): x ``[m, k]``, weight ``[n, k]``, elements of ``elem`` bytes. ``conv_bytes``: None, or the
    bytes of a convolution's dynamic kernels and base (read once)."""
    if m == 0 or n == 0:
        return 0, 0, 0
    tile, _ = _tile(m, elem == 4)
    block_m, block_n = tile["BLOCK_M"], tile["BLOCK_N"]
    q_only = q_cols // block_n * block_n  # columns in tiles of Q columns only
    reads = -(-m // block_m)
    weight = (q_only * -(-q_rows // block_m) + (n - q_only) * reads) * k * elem
    written = (q_rows * n + (m - q_rows) * (n - q_cols)) * elem
    return 1, m * k * elem + weight + written + (conv_bytes or 0), reads


@triton.jit
def _qkv_proj_kernel(out_ptr, x_ptr, w_ptr, d_ptr, base_ptr, M, K, N, Q_COLS, Q_ROWS, B, G, stride_xm, stride_wn,
                     stride_om, stride_dn, stride_dt, stride_do,
                     LOWP_DOT: tl.constexpr, DOT_PREC: tl.constexpr, TAPS: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """TAPS > 0: rows below Q_ROWS are the block rows ``n * B + t`` (``stride_xm`` apart, requests ``B`` rows
    apart), convolved in the x-tile load."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # A tile of Q columns only needs the block rows: past them its row tiles load nothing and store nothing.
    m_end = tl.where((pid_n + 1) * BLOCK_N <= Q_COLS, Q_ROWS, M)
    k_end = tl.where(pid_m * BLOCK_M < m_end, K, 0)
    row_ok = rows < m_end
    col_ok = cols < N
    dtype = out_ptr.dtype.element_ty
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = gemm_x_tile(x_ptr, d_ptr, base_ptr, rows, ks, row_ok[:, None] & k_ok[None, :], Q_ROWS, K, B, G,
                        B * stride_xm, stride_xm, stride_dn, stride_dt, stride_do, dtype, TAPS, LOWP_DOT, True)
        w = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if not LOWP_DOT:  # fp32 operands (fp32 inputs; the interpreter, whose 16-bit loads are raw integers)
            w = w.to(tl.float32)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PREC)
    used = row_ok[:, None] & col_ok[None, :] & ((rows < Q_ROWS)[:, None] | (cols >= Q_COLS)[None, :])
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols.to(tl.int64)[None, :],
             round_to(acc, dtype).to(dtype), mask=used)


def _qkv_proj_triton(x, weight, out, q_cols: int, q_rows: int, conv_dynamic=None, conv_base=None) -> None:
    m, k = x.shape
    n = weight.shape[0]
    if m == 0 or n == 0:
        return
    fp32 = x.dtype == torch.float32
    if interpreting():  # small tiles: several row and column tiles even at the tests' shapes
        tile, launch = dict(BLOCK_M=max(16, min(32, next_pow2(m))), BLOCK_N=max(16, min(64, next_pow2(n))),
                            BLOCK_K=max(16, min(128, next_pow2(k)))), dict(num_warps=1)
    else:
        tile, launch = _tile(m, fp32)
    if conv_dynamic is None:
        conv = dict(d_ptr=x, base_ptr=x, B=1, G=1, stride_dn=0, stride_dt=0, stride_do=0, TAPS=0)
    else:
        conv = dict(d_ptr=conv_dynamic, base_ptr=conv_base, B=conv_dynamic.shape[1], G=k // conv_dynamic.shape[-1],
                    stride_dn=conv_dynamic.stride(0), stride_dt=conv_dynamic.stride(1),
                    stride_do=conv_dynamic.stride(2), TAPS=conv_base.shape[0])
    grid = (triton.cdiv(m, tile["BLOCK_M"]), triton.cdiv(n, tile["BLOCK_N"]))
    _qkv_proj_kernel[grid](
        out_ptr=out, x_ptr=x, w_ptr=weight, M=m, K=k, N=n, Q_COLS=q_cols, Q_ROWS=q_rows, stride_xm=x.stride(0),
        stride_wn=weight.stride(0), stride_om=out.stride(0), LOWP_DOT=not fp32 and not interpreting(),
        DOT_PREC="ieee" if fp32 else "tf32", **launch, **tile, **conv,
    )


def _check(x, weight, out, q_cols, q_rows, conv_dynamic, conv_base, backend):
    check_tensor(OP, "x", x, ndim=2, dtypes=FLOAT_DTYPES)
    check_last_dim_contiguous(OP, "x", x)
    m, k = x.shape
    check_tensor(OP, "weight", weight, ndim=2, dtypes=(x.dtype,), device=x.device)
    if weight.shape[1] != k:
        raise ValueError(f"{OP}: weight must be [N, K={k}] (q_proj, k_proj, v_proj rows, nn.Linear layout), got "
                         f"{tuple(weight.shape)}")
    check_last_dim_contiguous(OP, "weight", weight)
    n = weight.shape[0]
    if not 0 <= q_cols <= n:
        raise ValueError(f"{OP}: q_cols must be in [0, N={n}] (the Q columns of the weight's output), got {q_cols}")
    if not 0 <= q_rows <= m:
        raise ValueError(f"{OP}: q_rows must be in [0, M={m}] (the block rows, whose Q columns are written), got "
                         f"{q_rows}")
    if conv_dynamic is not None:
        if not isinstance(conv_dynamic, torch.Tensor) or conv_dynamic.dim() != 4 or \
                conv_dynamic.shape[0] * conv_dynamic.shape[1] != q_rows:
            raise ValueError(f"{OP}: conv_dynamic must be [n, B, K, H/G] with n * B = q_rows = {q_rows} (the block "
                             f"rows it convolves), got {getattr(conv_dynamic, 'shape', type(conv_dynamic))}")
        block = x[:q_rows].view(*conv_dynamic.shape[:2], k)
    else:
        block = x
    check_fused_conv(OP, block, conv_dynamic, conv_base, "the GEMM")
    check_tensor(OP, "out", out, dtypes=(x.dtype,), device=x.device)
    if tuple(out.shape) != (m, n) or not out.is_contiguous():
        raise ValueError(f"{OP}: out must be a contiguous tensor of shape {(m, n)} ([M, N]), got "
                         f"{tuple(out.shape)}{'' if out.is_contiguous() else ' (not contiguous)'}")
    if overlap(out, x):
        raise ValueError(f"{OP}: out overlaps x; write into another buffer")


def qkv_proj(x: torch.Tensor, weight: torch.Tensor, *, q_cols: int, q_rows: int, out: Optional[torch.Tensor] = None,
             conv_dynamic: Optional[torch.Tensor] = None, conv_base: Optional[torch.Tensor] = None,
             backend: str = "auto") -> torch.Tensor:
    """A draft layer's merged QKV projection of its block rows and context rows: ``x @ weight^T`` but the context
    rows' Q columns.

    Args:
        x: ``[M, K]`` fp32/bf16/fp16, last dim contiguous (rows may be strided): the block rows ``:q_rows`` over
            the context rows.
        weight: ``[N, K]`` in x's dtype, last dim contiguous: ``[q_proj; k_proj; v_proj]`` rows, no bias.
        q_cols: the Q columns ``:q_cols`` of the output, which only the block rows need.
        q_rows: the block rows, ``0 <= q_rows <= M``.
        out: None, or a contiguous ``[M, N]`` tensor in x's dtype sharing no memory with x.
        conv_dynamic, conv_base: None, or a grouped dynamic causal convolution of the block rows (``x[:q_rows]``
            viewed ``[n, B, K]``) applied before the GEMM, as :func:`dflash_kernels.grouped_dynamic_conv` takes
            them (``[n, B, Kt, K/G]`` in x's dtype with ``n * B = q_rows``, ``[Kt, K]``): DFlash2's attention-side
            ``prepare``, in the GEMM's x-tile load. Rounded to the dtype once before the GEMM, as that op stores it.
        backend: ``"auto" | "triton" | "torch"``.

    Returns:
        ``out``, or a new ``[M, N]`` tensor, holding :func:`qkv_proj_reference` (fp32 accumulation, rounded once)
        in every element but ``[q_rows:, :q_cols]``, which keeps what ``out`` held (uninitialised in a new one).
    """
    chosen = resolve_backend(OP, backend, x.device, available=_BACKENDS)
    if out is None:
        forms = all(isinstance(t, torch.Tensor) and t.dim() == 2 for t in (x, weight))
        out = x.new_empty((x.shape[0], weight.shape[0]) if forms else (0,))  # the op's checks name a wrong form
    call_op(_qkv_proj_op, x, weight, out, q_cols, q_rows, conv_dynamic, conv_base, chosen, device=x.device)
    return out


@torch.library.custom_op("dflash::qkv_proj", mutates_args=("out",))
@checked_by(_check)
def _qkv_proj_op(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, q_cols: int, q_rows: int,
                 conv_dynamic: Optional[torch.Tensor], conv_base: Optional[torch.Tensor], backend: str) -> None:
    """``torch.ops.dflash.qkv_proj``: :func:`qkv_proj` after validation (writes out but ``[q_rows:, :q_cols]``)."""
    chosen = resolve_backend(OP, backend, x.device, available=_BACKENDS)
    if chosen == "torch":
        projected = qkv_proj_reference(x, weight, q_rows, conv_dynamic, conv_base)
        out[:q_rows].copy_(projected[:q_rows])
        out[q_rows:, q_cols:].copy_(projected[q_rows:, q_cols:])
        return
    _qkv_proj_triton(x, weight, out, q_cols, q_rows, conv_dynamic, conv_base)


@_qkv_proj_op.register_fake
def _qkv_proj_fake(x, weight, out, q_cols, q_rows, conv_dynamic, conv_base, backend):
    return None

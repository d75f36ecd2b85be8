"""gate_up_silu: the SwiGLU half of a gated MLP, ``silu(x @ W_gate^T) * (x @ W_up^T)``, in one GEMM.

The weight is the merged ``[gate; up]`` projection ``[2I, K]`` (rows ``:I`` the gate, ``I:`` the up
projection, as ``merged_weight`` stacks ``gate_proj`` and ``up_proj``). Unfused, a decode step runs the
GEMM into an ``[M, 2I]`` buffer and ``silu_mul`` reads it back and writes ``[M, I]``: 5*M*I elements of
activations moved between two launches. Here a program owns the same n columns of gate AND of up, streams
K once for both, and applies silu·mul in the epilogue: one launch, one ``[M, I]`` store.

Numerics follow HF in the input dtype (``F.silu(gate_proj(x)) * up_proj(x)``): fp32 accumulation, gate and
up rounded to the dtype (where the GEMM's output would be), ``silu`` in fp32 rounded, the product rounded
(``_triton_utils.round_to``, the rounding ``silu_mul`` uses). On the GPU, 16-bit inputs go into the dots as
16-bit operands (fp32 accumulation, what cuBLAS does); fp32 inputs use IEEE fp32 dots; the interpreter
converts every load to fp32.

Rows: the fused kernel is for the skinny M of decode steps, M <= ``MAX_FUSED_ROWS`` (128 = one M tile,
so each weight byte is read once per launch). Up to there the GEMM is memory-bound on an H200 (2*M FLOPs
per 2-byte weight element: M FLOP/byte, below the ~184 FLOP/byte ridge of 790 TFLOP/s over 4.3 TB/s), so
a weight-streaming kernel can run at the bandwidth; beyond it the GEMM turns compute-bound, where cuBLAS's
tuned tensor-core pipeline is the safer choice, so larger M (prefill chunks) runs ``F.linear`` (cuBLAS)
+ the ``silu_mul`` kernel. Whether this kernel matches cuBLAS at M <= 128 is measured by
``bench/kernels.py`` on a GPU, not claimed here.

DFlash2's ``prepare`` convolution can run in the x-tile load (``conv_dynamic`` / ``conv_base``, x ``[N, B, K]``):
each x tile is convolved over the block rows (:func:`dflash_kernels.dynamic_conv.conv_taps`, the K-1 earlier rows
from cache) and rounded to the dtype once, the value ``grouped_dynamic_conv`` would have stored, so the convolved
rows are never written and read back.

Launches and bytes per call (e = element size; :func:`gate_up_silu_cost` is this rule in code):
  M <= MAX_FUSED_ROWS  1 launch; reads x [M, K] and the weight [2I, K], writes [M, I]; with a convolution, also
                       reads its dynamic kernels and base once.
  M >  MAX_FUSED_ROWS  2 launches (GEMM, silu_mul); also writes and reads back the [M, 2I] GEMM output; with a
                       convolution, 3 (``grouped_dynamic_conv`` first, its [M, K] rows written and read back).
  M == 0               no launch.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from dflash_kernels._dispatch import call_op, checked_by, resolve_backend
from dflash_kernels._triton_utils import (
    FLOAT_DTYPES, check_last_dim_contiguous, check_tensor, interpreting, next_pow2, round_to,
)
from dflash_kernels.dynamic_conv import (
    _grouped_dynamic_conv_triton, check_fused_conv, gemm_x_tile, grouped_dynamic_conv_reference, overlap,
)
from dflash_kernels.layer_ops import _silu_mul_triton, silu_mul_reference

OP = "gate_up_silu"
MAX_FUSED_ROWS = 128
_BACKENDS = ("triton", "torch")


def gate_up_silu_reference(x: torch.Tensor, weight: torch.Tensor, conv_dynamic: Optional[torch.Tensor] = None,
                           conv_base: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Definition (HF ``act_fn(gate_proj(x)) * up_proj(x)``): the merged projection ``F.linear(x, weight)`` in
    x's dtype (rounded there, as HF's two projections are), then ``silu(gate) * up`` (``silu_mul``'s rule). With
    ``conv_dynamic`` / ``conv_base``, x is first replaced by its grouped dynamic convolution
    (:func:`dflash_kernels.dynamic_conv.grouped_dynamic_conv_reference`, DFlash2's ``prepare``)."""
    if conv_dynamic is not None:
        x = grouped_dynamic_conv_reference(x, conv_dynamic, conv_base)
    return silu_mul_reference(F.linear(x, weight.to(x.dtype)))


def gate_up_silu_cost(m: int, k: int, i: int, elem: int, conv_bytes: int | None = None) -> tuple[int, int]:
    """(launches, HBM bytes) of one call on the GPU path: x ``[m, k]``, weight ``[2i, k]``, elements of ``elem``
    bytes; each operand moved once per launch (the traffic accountant's model). ``conv_bytes``: None, or the
    bytes of a convolution's dynamic kernels and base (read once)."""
    if m == 0:
        return 0, 0
    fused = (m * k + 2 * i * k + m * i) * elem + (conv_bytes or 0)
    if m <= MAX_FUSED_ROWS:
        return 1, fused
    unfused = fused + 2 * (2 * m * i) * elem  # the [m, 2i] GEMM output written, then read by silu_mul
    if conv_bytes is None:
        return 2, unfused
    return 3, unfused + 2 * m * k * elem  # grouped_dynamic_conv's rows written, then read by the GEMM


@triton.jit
def _gate_up_silu_kernel(out_ptr, x_ptr, w_ptr, d_ptr, base_ptr, M, K, I, B, G, stride_xm, stride_xn, stride_wn,
                         stride_om, stride_dn, stride_dt, stride_do,
                         LOWP_DOT: tl.constexpr, DOT_PREC: tl.constexpr, TAPS: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """TAPS > 0: x is [N, B, K] (requests ``stride_xn``, rows ``stride_xm`` apart) and each x tile is its
    convolution (``conv_taps``), rounded to the dtype once; TAPS = 0: rows ``stride_xm`` apart."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < I
    dtype = out_ptr.dtype.element_ty
    # Columns c of gate and of up are weight rows c and I + c: both accumulate from the same x tile.
    gate_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wn
    up_rows = w_ptr + (cols.to(tl.int64) + I)[:, None] * stride_wn
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x_mask = row_ok[:, None] & k_ok[None, :]
        x = gemm_x_tile(x_ptr, d_ptr, base_ptr, rows, ks, x_mask, M, K, B, G, stride_xn, stride_xm, stride_dn,
                        stride_dt, stride_do, dtype, TAPS, LOWP_DOT, False)
        w_mask = col_ok[:, None] & k_ok[None, :]
        wg = tl.load(gate_rows + ks[None, :], mask=w_mask, other=0.0)
        wu = tl.load(up_rows + ks[None, :], mask=w_mask, other=0.0)
        if not LOWP_DOT:  # fp32 operands (fp32 inputs; the interpreter, whose 16-bit loads are raw integers)
            wg = wg.to(tl.float32)
            wu = wu.to(tl.float32)
        acc_gate = tl.dot(x, tl.trans(wg), acc_gate, input_precision=DOT_PREC)
        acc_up = tl.dot(x, tl.trans(wu), acc_up, input_precision=DOT_PREC)
    # HF rounds the projections to the dtype, then silu (fp32 inside, rounded), then the product.
    gate = round_to(acc_gate, dtype)
    up = round_to(acc_up, dtype)
    act = round_to(gate / (1.0 + tl.exp(-gate)), dtype)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols.to(tl.int64)[None, :],
             round_to(act * up, dtype).to(dtype), mask=row_ok[:, None] & col_ok[None, :])


def _tile(m: int, k: int, i: int, fp32: bool) -> tuple[dict, int]:
    """(BLOCK_M/N/K, num_warps) for ``m`` rows. GPU: one M tile covers all rows (the weight is read once);
    at m <= 16, 32 columns per program (384 programs at I = 12288: ~3 per SM on 132 SMs, enough weight bytes
    in flight); at larger 16-bit m, 64 columns, so that x, re-read by every column program (from L2), costs at
    most as many bytes as the weight. fp32 operands (IEEE dots on FMA units, not tensor cores) hold more
    registers: smaller K and column tiles keep them at 0 spills (tests/kernels/aot_compile_sm90.py). Guesses to
    be measured on the GPU (bench/kernels.py). The interpreter takes the largest tiles (fewer programs)."""
    if interpreting():
        return dict(BLOCK_M=max(16, min(128, next_pow2(m))), BLOCK_N=max(16, min(128, next_pow2(i))),
                    BLOCK_K=max(16, min(128, next_pow2(k)))), 1
    if m <= 16:
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64 if fp32 else 128), 4
    if m <= 64:
        return dict(BLOCK_M=64, BLOCK_N=32 if fp32 else 64, BLOCK_K=32 if fp32 else 64), 4
    return dict(BLOCK_M=128, BLOCK_N=32 if fp32 else 64, BLOCK_K=32 if fp32 else 64), 8


def _gate_up_silu_triton(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor,
                         conv_dynamic: Optional[torch.Tensor] = None, conv_base: Optional[torch.Tensor] = None) -> None:
    k = x.shape[-1]
    i = weight.shape[0] // 2
    m = math.prod(x.shape[:-1])
    if m == 0 or i == 0:
        return
    out2 = out.view(m, i)
    if m > MAX_FUSED_ROWS:  # compute-bound: (the convolution,) cuBLAS GEMM, then the silu_mul kernel
        if conv_dynamic is not None:
            convolved = x.new_empty(x.shape)
            _grouped_dynamic_conv_triton(x, conv_dynamic, conv_base, convolved)
            x = convolved
        _silu_mul_triton(F.linear(x.reshape(m, k), weight), out=out2)
        return
    if conv_dynamic is None:
        x = x.reshape(m, k)
        conv = dict(d_ptr=x, base_ptr=x, B=1, G=1, stride_xm=x.stride(0), stride_xn=0, stride_dn=0, stride_dt=0,
                    stride_do=0, TAPS=0)
    else:  # [N, B, K] rows (validated), convolved in the x-tile load
        conv = dict(d_ptr=conv_dynamic, base_ptr=conv_base, B=x.shape[1], G=k // conv_dynamic.shape[-1],
                    stride_xm=x.stride(1), stride_xn=x.stride(0), stride_dn=conv_dynamic.stride(0),
                    stride_dt=conv_dynamic.stride(1), stride_do=conv_dynamic.stride(2), TAPS=conv_base.shape[0])
    fp32 = x.dtype == torch.float32
    tile, num_warps = _tile(m, k, i, fp32)
    lowp_dot = not fp32 and not interpreting()
    grid = (triton.cdiv(m, tile["BLOCK_M"]), triton.cdiv(i, tile["BLOCK_N"]))
    _gate_up_silu_kernel[grid](
        out_ptr=out2, x_ptr=x, w_ptr=weight, M=m, K=k, I=i, stride_wn=weight.stride(0), stride_om=out2.stride(0),
        LOWP_DOT=lowp_dot, DOT_PREC="ieee" if fp32 else "tf32", num_warps=num_warps, **tile, **conv,
    )


def _validate(x, weight, out, conv_dynamic=None, conv_base=None):
    check_fused_conv(OP, x, conv_dynamic, conv_base, "the GEMM")
    check_tensor(OP, "x", x, dtypes=FLOAT_DTYPES)
    if x.dim() < 1:
        raise ValueError(f"{OP}: x must be [..., K] with at least one dim, got a 0-d tensor")
    check_last_dim_contiguous(OP, "x", x)
    k = x.shape[-1]
    check_tensor(OP, "weight", weight, ndim=2, dtypes=(x.dtype,), device=x.device)
    if weight.shape[1] != k or weight.shape[0] % 2:
        raise ValueError(f"{OP}: weight must be [2I, K={k}] (the gate rows, then the up rows, nn.Linear layout), "
                         f"got {tuple(weight.shape)}")
    check_last_dim_contiguous(OP, "weight", weight)
    shape = (*x.shape[:-1], weight.shape[0] // 2)
    if out is not None:
        check_tensor(OP, "out", out, dtypes=(x.dtype,), device=x.device)
        if tuple(out.shape) != shape or not out.is_contiguous():
            raise ValueError(f"{OP}: out must be a contiguous tensor of shape {shape} ([..., I]), got "
                             f"{tuple(out.shape)}{'' if out.is_contiguous() else ' (not contiguous)'}")
        if conv_dynamic is not None and overlap(out, x):
            raise ValueError(f"{OP}: out overlaps x, which the convolution reads across rows; write into another "
                             "buffer")
    return shape


def gate_up_silu(x: torch.Tensor, weight: torch.Tensor, *, out: Optional[torch.Tensor] = None,
                 conv_dynamic: Optional[torch.Tensor] = None, conv_base: Optional[torch.Tensor] = None,
                 backend: str = "auto") -> torch.Tensor:
    """SwiGLU of a gated MLP from its merged gate/up weight: ``silu(x @ W_gate^T) * (x @ W_up^T)``.

    Args:
        x: ``[..., K]`` fp32/bf16/fp16, last dim contiguous (rows may be strided; rows that cannot be viewed
            as one ``[M, K]`` matrix are copied first). May be empty.
        weight: ``[2I, K]`` in x's dtype, last dim contiguous: rows ``:I`` = ``gate_proj.weight``, rows ``I:`` =
            ``up_proj.weight`` (``merged_weight([gate_proj, up_proj], ...)``). No bias.
        out: None, or a contiguous ``[..., I]`` tensor in x's dtype to write into.
        conv_dynamic, conv_base: None, or a grouped dynamic causal convolution of x (``[N, B, K]``) applied before
            the GEMM, as :func:`dflash_kernels.grouped_dynamic_conv` takes them (``[N, B, Kt, K/G]`` in x's
            dtype, ``[Kt, K]``): DFlash2's ``prepare`` before the MLP, in the GEMM's x-tile load (the convolved
            rows are never written). Rounded to the dtype once before the GEMM, as that op stores it.
        backend: ``"auto" | "triton" | "torch"``.

    Returns:
        ``out``, or a new contiguous ``[..., I]`` tensor in x's dtype. HF numerics in the dtype (see the module
        docstring). Triton path: one launch for M <= ``MAX_FUSED_ROWS`` rows, else cuBLAS + ``silu_mul`` (two).
    """
    shape = _validate(x, weight, out, conv_dynamic, conv_base)
    chosen = resolve_backend(OP, backend, x.device, available=_BACKENDS)
    if out is None:
        out = x.new_empty(shape)
    call_op(_gate_up_silu_op, x, weight, out, conv_dynamic, conv_base, chosen, device=x.device,
            checked=True)  # validated above
    return out


def _check(x, weight, out, conv_dynamic, conv_base, backend):
    _validate(x, weight, out, conv_dynamic, conv_base)


@torch.library.custom_op("dflash::gate_up_silu", mutates_args=("out",))
@checked_by(_check)
def _gate_up_silu_op(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, conv_dynamic: Optional[torch.Tensor],
                     conv_base: Optional[torch.Tensor], backend: str) -> None:
    """``torch.ops.dflash.gate_up_silu``: :func:`gate_up_silu` after validation (writes out)."""
    chosen = resolve_backend(OP, backend, x.device, available=_BACKENDS)
    if chosen == "torch":
        out.copy_(gate_up_silu_reference(x, weight, conv_dynamic, conv_base))
        return
    _gate_up_silu_triton(x, weight, out, conv_dynamic, conv_base)


@_gate_up_silu_op.register_fake
def _gate_up_silu_fake(x, weight, out, conv_dynamic, conv_base, backend):
    return None

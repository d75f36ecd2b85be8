"""Row-wise ops of a decoder layer: ``add_rms_norm`` (residual add + RMSNorm) and ``silu_mul`` (SwiGLU).

Both follow HF Qwen3/Llama numerics in the input dtype, rounding where HF rounds: statistics and
``silu`` in fp32, the normalised value (or ``silu(gate)``) rounded to the dtype before the multiply,
the product rounded again.

Launches and bytes per call (e = element size of x / gate_up, e_w of weight), as a traffic
accountant should count them (x / gate_up rows that cannot be viewed as one [rows, last dim] matrix
cost one more launch, the copy, and its traffic):
  add_rms_norm  1 launch (none when x is empty); reads x, weight and, with ``residual``, the residual;
                writes out and, with ``residual``, the residual:
                N*H*e*(2 + 2*has_residual) + H*e_w, N = number of rows of x.
  silu_mul      1 launch (none when empty); reads the [N, 2I] gate_up and writes the [N, I] output:
                3*N*I*e.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from dflash_kernels._dispatch import call_op, checked_by, lean_version_bump, registered, resolve_backend
from dflash_kernels._triton_utils import (
    FLOAT_DTYPES, check_last_dim_contiguous, check_tensor, interpreting, next_pow2, rms_norm_reference,
)

_BACKENDS = ("triton", "torch")  # and the wings' registered bodies (dflash_kernels.cpu)


@triton.jit
def _round_to(x, DTYPE: tl.constexpr):
    """fp32 ``x`` rounded to DTYPE (nearest even), returned as fp32 so that the store is exact.

    The CPU interpreter truncates fp32 -> bf16 casts, so bf16 rounds by integer ops here; the GPU gives
    the same bits (NaN passes through unchanged)."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        return tl.where(x == x, bits.to(tl.float32, bitcast=True), x)
    else:
        return x.to(DTYPE).to(tl.float32)


# ---------------------------------------------------------------------------------------------- add_rms_norm

ADD_RMS_NORM = "add_rms_norm"


def add_rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *,
                           residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Definition (HF): ``residual += x`` in the dtype (in place), then ``RMSNorm(residual) * weight``;
    without ``residual``, ``RMSNorm(x) * weight``."""
    if residual is not None:
        x = residual.add_(x)
    return rms_norm_reference(x, weight, eps)


@triton.jit
def _add_rms_norm_kernel(out_ptr, x_ptr, res_ptr, w_ptr, H, stride_x, eps,
                         HAS_RESIDUAL: tl.constexpr, BLOCK_H: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    m = offs < H
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + offs, mask=m, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * H + offs, mask=m, other=0.0).to(tl.float32)
        x = _round_to(x + r, dtype)
        tl.store(res_ptr + row * H + offs, x.to(dtype), mask=m)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / H + eps)
    w = _round_to(tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32), dtype)
    y = w * _round_to(x * rstd, dtype)
    tl.store(out_ptr + row * H + offs, _round_to(y, dtype).to(dtype), mask=m)


def _add_rms_norm_triton(x, weight, eps, residual, out) -> None:
    h = x.shape[-1]
    if out.numel() == 0:
        return
    x2 = x.reshape(-1, h)
    block_h = next_pow2(h)
    _add_rms_norm_kernel[(x2.shape[0],)](
        out_ptr=out, x_ptr=x2, res_ptr=x2 if residual is None else residual, w_ptr=weight, H=h,
        stride_x=x2.stride(0), eps=float(eps), HAS_RESIDUAL=residual is not None, BLOCK_H=block_h,
        num_warps=1 if interpreting() else min(16, max(1, block_h // 512)),
    )


def _validate_add_rms_norm(x, weight, eps, residual, out):
    op = ADD_RMS_NORM
    check_tensor(op, "x", x, dtypes=FLOAT_DTYPES)
    if x.dim() < 1:
        raise ValueError(f"{op}: x must be [..., H] with at least one dim, got a 0-d tensor")
    check_last_dim_contiguous(op, "x", x)
    h = x.shape[-1]
    check_tensor(op, "weight", weight, ndim=1, dtypes=FLOAT_DTYPES, device=x.device)
    if weight.shape[0] != h:
        raise ValueError(f"{op}: weight must be [H] = [{h}] (H = x.shape[-1]), got {tuple(weight.shape)}")
    check_last_dim_contiguous(op, "weight", weight)
    if residual is not None:
        check_tensor(op, "residual", residual, dtypes=(x.dtype,), device=x.device)
        if residual.shape != x.shape:
            raise ValueError(f"{op}: residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
        if not residual.is_contiguous():
            raise ValueError(f"{op}: residual is updated in place and must be contiguous; keep the residual "
                             "stream in a contiguous tensor")
    if out is not None:
        check_tensor(op, "out", out, dtypes=(x.dtype,), device=x.device)
        if out.shape != x.shape or not out.is_contiguous():
            raise ValueError(f"{op}: out must be a contiguous tensor of x's shape {tuple(x.shape)}, got "
                             f"{tuple(out.shape)}{'' if out.is_contiguous() else ' (not contiguous)'}")
    if not isinstance(eps, (float, int)) or eps < 0:
        raise ValueError(f"{op}: eps must be a non-negative float, got {eps!r}")


def add_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *,
                 residual: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None,
                 backend: str = "auto", validate: bool = True) -> torch.Tensor:
    """Residual add and RMSNorm of a decoder layer (HF ``hidden = residual + hidden; norm(hidden)``).

    Args:
        x: ``[..., H]`` fp32/bf16/fp16, last dim contiguous (rows may be strided; a row layout that
            cannot be viewed as ``[rows, H]`` is copied first). May be empty.
        weight: ``[H]`` the norm weight, any float dtype (cast to x's dtype, as HF's bf16 weight is).
        eps: RMSNorm epsilon.
        residual: None, or the contiguous residual stream (x's shape and dtype); it is updated in place
            to ``residual + x`` rounded to the dtype, and that sum is what gets normalised.
        out: None, or a contiguous tensor of x's shape and dtype to write the result into (e.g. rows of a
            buffer that a following GEMM reads together with other rows).
        backend: ``"auto" | "triton" | "cpu" | "torch"`` (``"cpu"``: CPU tensors, torch's fused RMSNorm).
        validate: check the arguments first (default; ``torch.ops.dflash.add_rms_norm`` always does).
            ``False`` takes the internal unchecked path (``_dispatch.call_op(checked=True)``), for a caller that
            already checked the same shapes, dtypes and devices (the lean target: every layer after the first of a
            forward).

    Returns:
        ``out``, or a new contiguous tensor of x's shape and dtype: ``RMSNorm(residual + x or x) * weight`` with
        fp32 statistics, the normalised value rounded to the dtype before the weight multiply (HF order). One launch.
    """
    chosen = resolve_backend(ADD_RMS_NORM, backend, x.device, available=_BACKENDS)
    if out is None:
        out = x.new_empty(x.shape)
    call_op(_add_rms_norm_op, x, weight, eps, residual, out, chosen, device=x.device, checked=not validate)
    return out


def _check_add_rms_norm(x, weight, eps, residual, out, backend):
    _validate_add_rms_norm(x, weight, eps, residual, out)


@torch.library.custom_op("dflash::add_rms_norm", mutates_args=("residual", "out"))
@checked_by(_check_add_rms_norm)
def _add_rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: Optional[torch.Tensor],
                     out: torch.Tensor, backend: str) -> None:
    """``torch.ops.dflash.add_rms_norm``: :func:`add_rms_norm` after validation (writes residual and out)."""
    chosen = resolve_backend(ADD_RMS_NORM, backend, x.device, available=_BACKENDS)
    body = registered(ADD_RMS_NORM, chosen)
    if body is not None:
        body(x, weight, eps, residual, out)
        return
    if chosen == "torch":
        out.copy_(add_rms_norm_reference(x, weight, eps, residual=residual))
        return
    _add_rms_norm_triton(x, weight, eps, residual, out)


@_add_rms_norm_op.register_fake
def _add_rms_norm_fake(x, weight, eps, residual, out, backend):
    return None


lean_version_bump(_add_rms_norm_op)


# -------------------------------------------------------------------------------------------------- silu_mul

SILU_MUL = "silu_mul"


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """Definition (HF ``act_fn(gate_proj(x)) * up_proj(x)``): gate = the first half of the last dim,
    up = the second half, ``silu(gate) * up`` in the dtype."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@triton.jit
def _silu_mul_kernel(out_ptr, gu_ptr, I, stride_gu, BLOCK_I: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    m = cols < I
    dtype = out_ptr.dtype.element_ty
    g = tl.load(gu_ptr + row * stride_gu + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride_gu + I + cols, mask=m, other=0.0).to(tl.float32)
    act = _round_to(g / (1.0 + tl.exp(-g)), dtype)
    tl.store(out_ptr + row * I + cols, _round_to(act * u, dtype).to(dtype), mask=m)


def _silu_mul_triton(gate_up, out=None) -> torch.Tensor:
    """``out`` (None: a new tensor): contiguous, gate_up's shape with the last dim halved."""
    i = gate_up.shape[-1] // 2
    if out is None:
        out = gate_up.new_empty((*gate_up.shape[:-1], i))
    if out.numel() == 0:
        return out
    gu = gate_up.reshape(-1, 2 * i)
    block_i = min(next_pow2(i), 4096 if interpreting() else 1024)
    _silu_mul_kernel[(gu.shape[0], triton.cdiv(i, block_i))](
        out_ptr=out, gu_ptr=gu, I=i, stride_gu=gu.stride(0), BLOCK_I=block_i, num_warps=4,
    )
    return out


def silu_mul(gate_up: torch.Tensor, *, backend: str = "auto", validate: bool = True) -> torch.Tensor:
    """SwiGLU activation of a merged ``[gate; up]`` projection: ``silu(gate) * up``.

    Args:
        gate_up: ``[..., 2I]`` fp32/bf16/fp16, last dim contiguous (rows may be strided): columns ``:I`` are
            the gate projection, ``I:`` the up projection (``x @ cat([W_gate, W_up]).T``). May be empty.
        backend: ``"auto" | "triton" | "cpu" | "torch"`` (``"cpu"``: the native kernel on fp32 rows, else the
            reference).
        validate: check the argument first (default); ``False`` as in :func:`add_rms_norm`.

    Returns:
        A new ``[..., I]`` tensor in gate_up's dtype; ``silu`` in fp32 rounded to the dtype, then times up
        and rounded (HF order). One launch.
    """
    chosen = resolve_backend(SILU_MUL, backend, gate_up.device, available=_BACKENDS)
    return call_op(_silu_mul_op, gate_up, chosen, device=gate_up.device, checked=not validate)


def _check_silu_mul(gate_up, backend):
    check_tensor(SILU_MUL, "gate_up", gate_up, dtypes=FLOAT_DTYPES)
    if gate_up.dim() < 1 or gate_up.shape[-1] % 2:
        raise ValueError(f"{SILU_MUL}: gate_up must be [..., 2I] (gate and up halves of one projection), "
                         f"got shape {tuple(gate_up.shape)}")
    check_last_dim_contiguous(SILU_MUL, "gate_up", gate_up)


@torch.library.custom_op("dflash::silu_mul", mutates_args=())
@checked_by(_check_silu_mul)
def _silu_mul_op(gate_up: torch.Tensor, backend: str) -> torch.Tensor:
    """``torch.ops.dflash.silu_mul``: :func:`silu_mul` after validation."""
    chosen = resolve_backend(SILU_MUL, backend, gate_up.device, available=_BACKENDS)
    body = registered(SILU_MUL, chosen)
    if body is not None:
        return body(gate_up)
    if chosen == "torch":
        return silu_mul_reference(gate_up).contiguous()
    return _silu_mul_triton(gate_up)


@_silu_mul_op.register_fake
def _silu_mul_fake(gate_up, backend):
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))

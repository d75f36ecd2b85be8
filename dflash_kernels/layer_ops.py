"""Row-wise ops of a decoder layer: ``add_rms_norm`` (residual add + RMSNorm) and ``silu_mul`` (SwiGLU).

Both follow HF Qwen3/Llama numerics in the input dtype, rounding where HF rounds: statistics and
``silu`` in fp32, the normalised value (or ``silu(gate)``) rounded to the dtype before the multiply,
the product rounded again.

Launches and bytes per call (e = element size of x / gate_up, e_w of weight), as a traffic
accountant should count them (x / gate_up rows that cannot be viewed as one [rows, last dim] matrix
cost one more launch, the copy, and its traffic):
  add_rms_norm  1 launch (none when x is empty); reads x, weight and, with ``residual``, the residual;
                writes out and, with ``residual``, the residual:
                N*H*e*(2 + 2*has_residual) + H*e_w, N = number of rows of x. With a convolution (DFlash2's
                ``finish`` in front of the add) also its dynamic kernels and base, once:
                + N*K*(H/G)*e + K*H*e_b (the K-1 earlier rows of a tap come from cache).
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
    FLOAT_DTYPES, check_last_dim_contiguous, check_tensor, interpreting, next_pow2, rms_norm_reference, round_to,
)
from dflash_kernels.dynamic_conv import check_fused_conv, conv_taps, grouped_dynamic_conv_reference, overlap

_BACKENDS = ("triton", "torch")  # and the wings' registered bodies (dflash_kernels.cpu)


# ---------------------------------------------------------------------------------------------- add_rms_norm

ADD_RMS_NORM = "add_rms_norm"


def add_rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *,
                           residual: Optional[torch.Tensor] = None, conv_dynamic: Optional[torch.Tensor] = None,
                           conv_base: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Definition (HF): ``residual += x`` in the dtype (in place), then ``RMSNorm(residual) * weight``;
    without ``residual``, ``RMSNorm(x) * weight``. With ``conv_dynamic`` / ``conv_base``, x is first replaced by
    its grouped dynamic convolution (:func:`dflash_kernels.dynamic_conv.grouped_dynamic_conv_reference`)."""
    if conv_dynamic is not None:
        x = grouped_dynamic_conv_reference(x, conv_dynamic, conv_base)
    if residual is not None:
        x = residual.add_(x)
    return rms_norm_reference(x, weight, eps)


@triton.jit
def _add_rms_norm_kernel(out_ptr, x_ptr, res_ptr, w_ptr, d_ptr, base_ptr, H, B, G, stride_x, stride_xn,
                         stride_dn, stride_dt, stride_do, OUT_B, stride_on, stride_ot, eps,
                         HAS_RESIDUAL: tl.constexpr, TAPS: tl.constexpr, BLOCK_H: tl.constexpr):
    """One row. TAPS > 0: x is [N, B, H] (rows ``stride_xn`` / ``stride_x`` apart) and the row's value is its
    convolution, rounded to the dtype once (as ``grouped_dynamic_conv`` stores it); TAPS = 0: rows ``stride_x``
    apart. Row ``n * OUT_B + t`` goes to ``out + n * stride_on + t * stride_ot``."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    m = offs < H
    dtype = out_ptr.dtype.element_ty
    if TAPS > 0:
        x = round_to(conv_taps(x_ptr, d_ptr, base_ptr, row // B, row % B, offs, m, H, G, stride_xn, stride_x,
                                stride_dn, stride_dt, stride_do, TAPS), dtype)
    else:
        x = tl.load(x_ptr + row * stride_x + offs, mask=m, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * H + offs, mask=m, other=0.0).to(tl.float32)
        x = round_to(x + r, dtype)
        tl.store(res_ptr + row * H + offs, x.to(dtype), mask=m)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / H + eps)
    w = round_to(tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32), dtype)
    y = w * round_to(x * rstd, dtype)
    tl.store(out_ptr + (row // OUT_B) * stride_on + (row % OUT_B) * stride_ot + offs, round_to(y, dtype).to(dtype),
             mask=m)


def _add_rms_norm_triton(x, weight, eps, residual, out, conv_dynamic=None, conv_base=None) -> None:
    h = x.shape[-1]
    if out.numel() == 0:
        return
    block_h = next_pow2(h)
    if conv_dynamic is None:
        x2 = x.reshape(-1, h)
        conv = dict(d_ptr=x2, base_ptr=x2, B=1, G=1, stride_x=x2.stride(0), stride_xn=0, stride_dn=0, stride_dt=0,
                    stride_do=0, TAPS=0)
    else:  # [N, B, H] rows (validated), convolved in the kernel
        x2 = x
        conv = dict(d_ptr=conv_dynamic, base_ptr=conv_base, B=x.shape[1], G=h // conv_dynamic.shape[-1],
                    stride_x=x.stride(1), stride_xn=x.stride(0), stride_dn=conv_dynamic.stride(0),
                    stride_dt=conv_dynamic.stride(1), stride_do=conv_dynamic.stride(2), TAPS=conv_base.shape[0])
    # a contiguous out, or [N, B, H] token-major (the transpose of a contiguous [B, N, H])
    rows = dict(OUT_B=1, stride_on=h, stride_ot=0) if out.is_contiguous() else dict(
        OUT_B=out.shape[1], stride_on=out.stride(0), stride_ot=out.stride(1))
    _add_rms_norm_kernel[(out.numel() // h,)](
        out_ptr=out, x_ptr=x2, res_ptr=x2 if residual is None else residual, w_ptr=weight, H=h, eps=float(eps), **rows,
        HAS_RESIDUAL=residual is not None, BLOCK_H=block_h,
        num_warps=1 if interpreting() else min(16, max(1, block_h // 512)), **conv,
    )


def _validate_add_rms_norm(x, weight, eps, residual, out, conv_dynamic=None, conv_base=None):
    op = ADD_RMS_NORM
    check_fused_conv(op, x, conv_dynamic, conv_base, "the add")
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
        token_major = out.dim() == 3 and out.transpose(0, 1).is_contiguous()
        if out.shape != x.shape or not (out.is_contiguous() or token_major):
            raise ValueError(f"{op}: out must be a tensor of x's shape {tuple(x.shape)}, contiguous or (3-d) the "
                             f"transpose(0, 1) of a contiguous tensor, got {tuple(out.shape)}"
                             f"{'' if out.is_contiguous() else ' (neither layout)'}")
    if not isinstance(eps, (float, int)) or eps < 0:
        raise ValueError(f"{op}: eps must be a non-negative float, got {eps!r}")
    if conv_dynamic is not None:  # row t is read by rows t..t+K-1: nothing may be written over x
        for name, t in (("out", out), ("residual", residual)):
            if t is not None and overlap(t, x):
                raise ValueError(f"{op}: {name} overlaps x, which the convolution reads across rows; write into "
                                 "another buffer")


def add_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *,
                 residual: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None,
                 conv_dynamic: Optional[torch.Tensor] = None, conv_base: Optional[torch.Tensor] = None,
                 backend: str = "auto", validate: bool = True) -> torch.Tensor:
    """Residual add and RMSNorm of a decoder layer (HF ``hidden = residual + hidden; norm(hidden)``).

    Args:
        x: ``[..., H]`` fp32/bf16/fp16, last dim contiguous (rows may be strided; a row layout that
            cannot be viewed as ``[rows, H]`` is copied first). May be empty.
        weight: ``[H]`` the norm weight, any float dtype (cast to x's dtype, as HF's bf16 weight is).
        eps: RMSNorm epsilon.
        residual: None, or the contiguous residual stream (x's shape and dtype); it is updated in place
            to ``residual + x`` rounded to the dtype, and that sum is what gets normalised.
        out: None, or a tensor of x's shape and dtype to write the result into (e.g. rows of a buffer that a
            following GEMM reads together with other rows): contiguous, or for ``[N, B, H]`` the ``transpose(0, 1)``
            of a contiguous ``[B, N, H]`` tensor (token-major rows: ``out.transpose(0, 1)[1:]`` are rows 1..B-1 of
            every request, contiguous, without row 0).
        conv_dynamic, conv_base: None, or a grouped dynamic causal convolution of x (``[N, B, H]``) applied before
            the add, as :func:`dflash_kernels.grouped_dynamic_conv` takes them (``[N, B, K, H/G]`` in x's dtype,
            ``[K, H]``): DFlash2's ``finish`` after a sublayer, fused into the residual add and the next norm
            (one launch instead of two, and the convolved rows are never written). Rounded to the dtype once
            before the add, as that op stores it.
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
    call_op(_add_rms_norm_op, x, weight, eps, residual, out, conv_dynamic, conv_base, chosen, device=x.device,
            checked=not validate)
    return out


def _check_add_rms_norm(x, weight, eps, residual, out, conv_dynamic, conv_base, backend):
    _validate_add_rms_norm(x, weight, eps, residual, out, conv_dynamic, conv_base)


@torch.library.custom_op("dflash::add_rms_norm", mutates_args=("residual", "out"))
@checked_by(_check_add_rms_norm)
def _add_rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: Optional[torch.Tensor],
                     out: torch.Tensor, conv_dynamic: Optional[torch.Tensor], conv_base: Optional[torch.Tensor],
                     backend: str) -> None:
    """``torch.ops.dflash.add_rms_norm``: :func:`add_rms_norm` after validation (writes residual and out). A
    convolution runs in the Triton kernel; elsewhere it is the convolution's reference (its "cpu" and "torch"
    body), then the add and norm as without one."""
    chosen = resolve_backend(ADD_RMS_NORM, backend, x.device, available=_BACKENDS)
    if chosen == "triton":
        _add_rms_norm_triton(x, weight, eps, residual, out, conv_dynamic, conv_base)
        return
    if conv_dynamic is not None:
        x = grouped_dynamic_conv_reference(x, conv_dynamic, conv_base)
    body = registered(ADD_RMS_NORM, chosen)
    if body is not None:
        body(x, weight, eps, residual, out)
        return
    out.copy_(add_rms_norm_reference(x, weight, eps, residual=residual))


@_add_rms_norm_op.register_fake
def _add_rms_norm_fake(x, weight, eps, residual, out, conv_dynamic, conv_base, backend):
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
    act = round_to(g / (1.0 + tl.exp(-g)), dtype)
    tl.store(out_ptr + row * I + cols, round_to(act * u, dtype).to(dtype), mask=m)


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

"""``grouped_dynamic_conv``: DFlash2's grouped dynamic causal convolution over the block rows of every request.

A DFlash2 layer wraps attention and its MLP each in two such convolutions: ``prepare`` convolves the normed
sublayer input with ``base_kernel[0]`` plus the first half of ``kernel_projection(x)``, ``finish`` the sublayer
output with ``base_kernel[1]`` plus the second half (:mod:`dflash.dflash2`). This op is one convolution, for a
runtime whose GEMM computes the dynamic kernels (the CPU path: ``cpu_linear``, then this op); it reads them as a
strided view of that output. On the GPU path the engine runs the fused forms instead: ``prepare`` as
:mod:`dflash_kernels.conv_prepare` (the projection GEMM with this convolution in its epilogue) and ``finish`` inside
the following ``add_rms_norm`` (its ``conv_dynamic`` / ``conv_base``). :func:`conv_taps` is the convolution's one
Triton body, which all three kernels run; :func:`check_conv` and :func:`check_conv_out` its operand checks.

Launches and bytes per call (e = element size of x, e_b of base): 1 launch (none when empty), grid (rows,
channel tiles); reads x once (the K-1 earlier rows of a tap come from cache), the dynamic kernels and base,
writes the output: ``2*N*B*H*e + N*B*K*(H/G)*e + K*H*e_b``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from dflash_kernels._dispatch import call_op, checked_by, resolve_backend
from dflash_kernels._triton_utils import (
    FLOAT_DTYPES, check_last_dim_contiguous, check_shape, check_tensor, interpreting, next_pow2, round_to,
)

GROUPED_DYNAMIC_CONV = "grouped_dynamic_conv"
_BACKENDS = ("triton", "torch")


def grouped_dynamic_conv_reference(x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """Definition (z-lab ``GroupedDynamicCausalConv``): causal convolution over the rows of each block,
    ``y[n, t, c] = sum_o (base[o, c] + dynamic[n, t, o, c // G]) * x[n, t - o, c]`` with rows before the block's
    first row zero, G = H / dynamic.shape[-1]. Per tap the base part is added, then the dynamic part, in x's
    dtype (the official rounding order). Differentiable (plain torch)."""
    b, q, hidden = x.shape
    taps, groups = base.shape[0], dynamic.shape[-1]
    rows = x.view(b, q, groups, hidden // groups)
    dynamic = dynamic.view(b, q, taps, groups, 1)
    out = torch.zeros_like(rows)
    for o in range(min(taps, q)):  # taps reaching before row 0 read only zeros
        shifted = rows if o == 0 else F.pad(rows[:, :-o], (0, 0, 0, 0, o, 0))
        out = out + base[o].view(1, 1, groups, -1).to(x.dtype) * shifted
        out = torch.addcmul(out, dynamic[:, :, o], shifted)
    return out.view_as(x)


@triton.jit
def conv_taps(x_ptr, d_ptr, base_ptr, n, t, cols, m, H, G, stride_xn, stride_xt, stride_dn, stride_dt, stride_do,
              TAPS: tl.constexpr):
    """fp32 ``sum_o (base[o, c] + dynamic[n, t, o, c // G]) * x[n, t - o, c]`` over the K taps, at rows (n, t) and
    channels ``cols`` (masked by ``m``; n, t scalars or tensors that broadcast against cols). A tap reaching before
    the block's first row reads x as zero (``base * 0`` is still added, as the definition's zero padding does).
    Every kernel that convolves a block (this op, ``add_rms_norm``'s finish, ``dynamic_conv_prepare``) runs it."""
    for o in tl.static_range(TAPS):
        ok = m & (t >= o)
        xs = tl.load(x_ptr + n * stride_xn + (t - o) * stride_xt + cols, mask=ok, other=0.0).to(tl.float32)
        w = tl.load(base_ptr + o * H + cols, mask=m, other=0.0).to(tl.float32)
        dyn = tl.load(d_ptr + n * stride_dn + t * stride_dt + o * stride_do + cols // G, mask=ok,
                      other=0.0).to(tl.float32)
        if o == 0:
            acc = (w + dyn) * xs
        else:
            acc += (w + dyn) * xs
    return acc


@triton.jit
def gemm_x_tile(x_ptr, d_ptr, base_ptr, rows, ks, mask, conv_rows, K, B, G, stride_xn, stride_xm, stride_dn,
                stride_dt, stride_do, dtype: tl.constexpr, TAPS: tl.constexpr, LOWP_DOT: tl.constexpr,
                PLAIN_TAIL: tl.constexpr):
    """A GEMM's x tile at ``rows`` (a [BLOCK_M] vector) and columns ``ks`` (masked by ``mask``), as its dot takes
    it: in the dtype with LOWP_DOT (16-bit operands), else fp32. TAPS > 0: rows below ``conv_rows`` are rows
    ``n * B + t`` of a block x ``[N, B, K]`` (requests ``stride_xn``, rows ``stride_xm`` apart), convolved
    (:func:`conv_taps`) and rounded to the dtype once, the value ``grouped_dynamic_conv`` would have stored; with
    PLAIN_TAIL, rows from ``conv_rows`` on load plain, ``stride_xm`` apart (without it they are masked: a GEMM whose
    rows are all block rows spares the second load's shared memory); every row loads plain at TAPS = 0. The GEMMs
    that run DFlash2's ``prepare`` in their input pass (``gate_up_silu``, ``qkv_proj``) load their x tiles here."""
    r = rows.to(tl.int64)[:, None]
    if TAPS > 0:
        conv = round_to(conv_taps(x_ptr, d_ptr, base_ptr, r // B, r % B, ks[None, :], mask & (r < conv_rows), K, G,
                                  stride_xn, stride_xm, stride_dn, stride_dt, stride_do, TAPS), dtype)
        if PLAIN_TAIL:
            plain = tl.load(x_ptr + r * stride_xm + ks[None, :], mask=mask & (r >= conv_rows), other=0.0)
            x = tl.where(r < conv_rows, conv, plain.to(tl.float32))
        else:
            x = conv
        if LOWP_DOT:
            x = x.to(dtype)
    else:
        x = tl.load(x_ptr + r * stride_xm + ks[None, :], mask=mask, other=0.0)
    if not LOWP_DOT:  # fp32 operands (fp32 inputs; the interpreter, whose 16-bit loads are raw integers)
        x = x.to(tl.float32)
    return x


@triton.jit
def _grouped_dynamic_conv_kernel(out_ptr, x_ptr, d_ptr, base_ptr, B, H, G,
                                 stride_xn, stride_xt, stride_dn, stride_dt, stride_do,
                                 TAPS: tl.constexpr, BLOCK_C: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # n * B + t
    n = row // B
    t = row % B
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    m = cols < H
    acc = conv_taps(x_ptr, d_ptr, base_ptr, n, t, cols, m, H, G, stride_xn, stride_xt, stride_dn, stride_dt,
                    stride_do, TAPS)
    dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + row * H + cols, round_to(acc, dtype).to(dtype), mask=m)


def _grouped_dynamic_conv_triton(x, dynamic, base, out) -> None:
    n, b, h = x.shape
    if out.numel() == 0:
        return
    block_c = min(next_pow2(h), 8192 if interpreting() else 1024)
    _grouped_dynamic_conv_kernel[(n * b, triton.cdiv(h, block_c))](
        out_ptr=out, x_ptr=x, d_ptr=dynamic, base_ptr=base, B=b, H=h, G=h // dynamic.shape[-1],
        stride_xn=x.stride(0), stride_xt=x.stride(1), stride_dn=dynamic.stride(0), stride_dt=dynamic.stride(1),
        stride_do=dynamic.stride(2), TAPS=base.shape[0], BLOCK_C=block_c, num_warps=4,
    )


def grouped_dynamic_conv(x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor, *,
                         out: torch.Tensor | None = None, backend: str = "auto") -> torch.Tensor:
    """One grouped dynamic causal convolution over the B block rows of each of N requests.

    Args:
        x: ``[N, B, H]`` fp32/bf16/fp16, last dim contiguous (requests and rows may be strided): the rows to
            convolve (``prepare``: the normed sublayer input; ``finish``: the sublayer output).
        dynamic: ``[N, B, K, H/G]`` in x's dtype, last dim contiguous: row t's dynamic kernel, one value per group
            of G channels; a view ``proj.view(N, B, 2, K, H/G)[:, :, side]`` of ``kernel_projection``'s output.
        base: ``[K, H]`` contiguous, any float dtype: ``base_kernel[side]``.
        out: ``None``, or a contiguous ``[N, B, H]`` tensor in x's dtype sharing no memory with x, to write into
            (the engine passes the block rows its merged QKV GEMM reads).
        backend: ``"auto" | "triton" | "cpu" | "torch"`` (``"cpu"`` is the reference).

    Returns:
        ``out``, or a new ``[N, B, H]`` tensor in x's dtype: :func:`grouped_dynamic_conv_reference`; the kernel accumulates
        the K taps in fp32 and rounds once. Rows depend only on earlier rows of their block, so a shortened
        (tail) block's valid rows are unaffected by the rows after them.
    """
    chosen = resolve_backend(GROUPED_DYNAMIC_CONV, backend, x.device, available=_BACKENDS)
    if out is None:
        out = x.new_empty(x.shape)
    call_op(_grouped_dynamic_conv_op, x, dynamic, base, out, chosen, device=x.device)
    return out


def overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory spans of ``a`` and ``b`` (one storage) intersect."""
    if a.numel() == 0 or b.numel() == 0 or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False

    def span(t):
        start = t.data_ptr()
        return start, start + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) * t.element_size()

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 <= b1 and b0 <= a1


def check_conv(op: str, x, dynamic, base, x_name: str = "x", dynamic_name: str = "dynamic",
               base_name: str = "base") -> None:
    """The operands of one convolution: x ``[N, B, H]`` float (last dim contiguous), its dynamic kernels
    ``[N, B, K, H/G]`` in x's dtype (last dim contiguous, H/G dividing H), base ``[K, H]`` contiguous, K >= 1.
    ``op`` and the names are the calling op's, for its messages."""
    check_tensor(op, x_name, x, ndim=3, dtypes=FLOAT_DTYPES)
    check_last_dim_contiguous(op, x_name, x)
    n, b, h = x.shape
    check_tensor(op, dynamic_name, dynamic, ndim=4, dtypes=(x.dtype,), device=x.device)
    check_tensor(op, base_name, base, ndim=2, dtypes=FLOAT_DTYPES, device=x.device)
    taps = base.shape[0]
    groups = dynamic.shape[-1]
    if groups == 0 or h % groups:
        raise ValueError(f"{op}: {dynamic_name}'s last dim (H/G groups) must divide H = {h}, got {groups}")
    check_shape(op, dynamic_name, dynamic, (n, b, taps, groups), f"[N, B, K, H/G]: N, B from {x_name}, K from "
                f"{base_name}")
    check_last_dim_contiguous(op, dynamic_name, dynamic)
    check_shape(op, base_name, base, (taps, h), "[K, H]")
    if taps == 0:
        raise ValueError(f"{op}: {base_name} must have at least one tap (K >= 1), got shape {tuple(base.shape)}")
    if not base.is_contiguous():
        raise ValueError(f"{op}: {base_name} must be contiguous; pass {base_name}.contiguous()")


def check_fused_conv(op: str, x, conv_dynamic, conv_base, into: str) -> None:
    """The optional convolution an op runs on its input x before ``into`` (its ``conv_dynamic`` / ``conv_base``):
    both or neither, and then :func:`check_conv`'s operands."""
    if (conv_dynamic is None) != (conv_base is None):
        raise ValueError(f"{op}: pass conv_dynamic and conv_base together (a convolution of x before {into}), or "
                         "neither")
    if conv_dynamic is not None:
        check_conv(op, x, conv_dynamic, conv_base, dynamic_name="conv_dynamic", base_name="conv_base")


def check_conv_out(op: str, x, out, x_name: str = "x") -> None:
    """``out``: a contiguous tensor of x's shape, dtype and device sharing no memory with x (row t of a
    convolution reads rows t-K+1..t of x)."""
    check_tensor(op, "out", out, dtypes=(x.dtype,), device=x.device)
    if out.shape != x.shape or not out.is_contiguous():
        raise ValueError(f"{op}: out must be a contiguous tensor of {x_name}'s shape {tuple(x.shape)}, got "
                         f"{tuple(out.shape)}{'' if out.is_contiguous() else ' (not contiguous)'}")
    if overlap(out, x):
        raise ValueError(f"{op}: out overlaps {x_name} (row t reads rows t-K+1..t of {x_name}); write into another "
                         "buffer")


def _check_grouped_dynamic_conv(x, dynamic, base, out, backend):
    check_conv(GROUPED_DYNAMIC_CONV, x, dynamic, base)
    check_conv_out(GROUPED_DYNAMIC_CONV, x, out)


@torch.library.custom_op("dflash::grouped_dynamic_conv", mutates_args=("out",))
@checked_by(_check_grouped_dynamic_conv)
def _grouped_dynamic_conv_op(x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor, out: torch.Tensor,
                             backend: str) -> None:
    """``torch.ops.dflash.grouped_dynamic_conv``: :func:`grouped_dynamic_conv` after validation, into ``out``
    (a custom op may not return an alias of an input)."""
    chosen = resolve_backend(GROUPED_DYNAMIC_CONV, backend, x.device, available=_BACKENDS)
    if chosen == "torch":
        out.copy_(grouped_dynamic_conv_reference(x, dynamic, base))
    else:
        _grouped_dynamic_conv_triton(x, dynamic, base, out)


@_grouped_dynamic_conv_op.register_fake
def _grouped_dynamic_conv_fake(x, dynamic, base, out, backend):
    return None

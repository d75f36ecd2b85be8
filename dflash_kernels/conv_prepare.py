"""``dynamic_conv_prepare``: DFlash2's ``GroupedDynamicCausalConv.prepare`` in one launch, the kernel projection GEMM
with the convolution in its epilogue.

``prepare`` on the normed sublayer input x ``[N, B, H]``: ``dynamic = x @ projection^T`` (``kernel_projection``,
``[2*K*H/G, H]``, rows ordered [side, tap, group]) gives both sides' dynamic kernels ``[N, B, 2, K, H/G]``; side 0
convolves x (:func:`dflash_kernels.dynamic_conv.grouped_dynamic_conv_reference` with ``base_kernel[0]``) and side 1
is kept for ``finish`` after the sublayer (``add_rms_norm``'s convolution). Unfused this is two launches (the
runtime's GEMM, then ``grouped_dynamic_conv``) and the dynamic kernels' round trip.

Kernel: a program owns ``BLOCK_M`` rows and ``BLOCK_G`` groups; its GEMM tile computes the 2*K dynamic values of
those groups (all sides and taps: weight rows ``(side * K + tap) * H/G + group``) from one stream of x over H, stores
them (rounded to the dtype, where the GEMM's output would be), and after a CTA barrier convolves the groups' G
channels of its rows, reading back its own side-0 values and the K-1 earlier rows of x (L2). A tap reaching before
a block's first row reads zero (rows are ``n * B + t``; a tile may span requests). Tiles are untuned guesses (no GPU
has run this kernel; ``tests/kernels/test_aot_compile.py`` compiles it for sm_90).

Launches and bytes per call (e = element size of x and the projection, e_b of base): 1 launch (none when empty);
reads x and the projection once (x again by every group tile of a row tile, from L2; the projection once per row
tile, one tile up to 128 rows), base; writes the output and the dynamic kernels:
``2*N*B*H*e + 2*K*(H/G)*H*e + K*H*e_b + N*B*2*K*(H/G)*e``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from dflash_kernels._dispatch import call_op, checked_by, resolve_backend
from dflash_kernels._triton_utils import (
    FLOAT_DTYPES, check_last_dim_contiguous, check_tensor, interpreting, next_pow2, round_to,
)
from dflash_kernels.dynamic_conv import check_conv_out, conv_taps, grouped_dynamic_conv_reference, overlap

DYNAMIC_CONV_PREPARE = "dynamic_conv_prepare"
_BACKENDS = ("triton", "torch")


def dynamic_conv_prepare_reference(x: torch.Tensor, projection: torch.Tensor,
                                   base: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Definition (z-lab ``GroupedDynamicCausalConv.prepare``): x ``[N, B, H]``, projection ``[2*K*H/G, H]``, base
    ``[K, H]`` (``base_kernel[0]``) -> ``(the convolved x [N, B, H], dynamic [N, B, 2, K, H/G])``: the projection
    ``F.linear(x, projection)`` in x's dtype, then side 0's convolution of x."""
    n, b, _ = x.shape
    taps = base.shape[0]
    dynamic = F.linear(x, projection).view(n, b, 2, taps, projection.shape[0] // (2 * taps))
    return grouped_dynamic_conv_reference(x, dynamic[:, :, 0], base), dynamic


@triton.jit
def _dynamic_conv_prepare_kernel(out_ptr, dyn_ptr, x_ptr, w_ptr, base_ptr, M, B, H, NG, G,
                                 stride_xn, stride_xt, stride_w,
                                 TAPS: tl.constexpr, LOWP_DOT: tl.constexpr, DOT_PREC: tl.constexpr,
                                 BLOCK_M: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_G: tl.constexpr,
                                 BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_g = tl.program_id(1)
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # n * B + t
    row_ok = rows < M
    n = rows // B
    t = rows % B
    x_rows = x_ptr + n[:, None] * stride_xn + t[:, None] * stride_xt
    # column (j, gi) of the tile: side/tap j = side * K + tap, group g0 + gi; weight row j * NG + group
    cols = tl.arange(0, BLOCK_J * BLOCK_G)
    j = cols // BLOCK_G
    group = pid_g * BLOCK_G + cols % BLOCK_G
    col_ok = (j < 2 * TAPS) & (group < NG)
    w_rows = w_ptr + (j * NG + group).to(tl.int64)[:, None] * stride_w
    acc = tl.zeros((BLOCK_M, BLOCK_J * BLOCK_G), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < H
        a = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if not LOWP_DOT:  # fp32 operands (fp32 inputs; the interpreter, whose 16-bit loads are raw integers)
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(a, tl.trans(w), acc, input_precision=DOT_PREC)
    dtype = out_ptr.dtype.element_ty
    # dynamic is [M, 2K, NG] contiguous: row stride 2K*NG, (side, tap) stride NG
    per_row = 2 * TAPS * NG
    tl.store(dyn_ptr + rows[:, None] * per_row + (j * NG + group)[None, :], round_to(acc, dtype).to(dtype),
             mask=row_ok[:, None] & col_ok[None, :])
    tl.debug_barrier()  # the convolution below reads this program's side-0 values back
    c_lo = pid_g * BLOCK_G * G  # the tile's channels: [c_lo, c_lo + BLOCK_G * G) inside H
    for c0 in range(0, BLOCK_G * G, BLOCK_C):
        ch = c_lo + c0 + tl.arange(0, BLOCK_C)
        m = row_ok[:, None] & ((ch < H) & (ch < c_lo + BLOCK_G * G))[None, :]
        conv = conv_taps(x_ptr, dyn_ptr, base_ptr, n[:, None], t[:, None], ch[None, :], m, H, G, stride_xn,
                         stride_xt, B * per_row, per_row, NG, TAPS)
        tl.store(out_ptr + rows[:, None] * H + ch[None, :], round_to(conv, dtype).to(dtype), mask=m)


def _tile(m: int, taps: int, groups: int, g: int, fp32: bool) -> tuple[dict, int]:
    """(BLOCK_M/J/G/K/C, num_warps). GPU: one row tile up to 128 rows (the projection read once per launch); 16 or
    32 GEMM columns a program (2K sides and taps of BLOCK_G groups: 64-128 programs at K = 2, H/G = 256, so that
    the 4-8 MB projection streams from many SMs). Guesses, to be measured on a GPU. The interpreter takes the
    largest tiles (fewer programs)."""
    block_j = next_pow2(2 * taps)
    if interpreting():
        block_g = max(1, min(next_pow2(groups), 128 // block_j))
        tile = dict(BLOCK_M=max(16, min(128, next_pow2(m))), BLOCK_G=block_g, BLOCK_K=128,
                    BLOCK_C=min(next_pow2(block_g * g), 1024))
        return dict(tile, BLOCK_J=block_j), 1
    cols = 16 if m <= 16 else 32
    block_g = max(1, cols // block_j)
    block_m = 16 if m <= 16 else (64 if m <= 64 else 128)
    # the epilogue's [BLOCK_M, BLOCK_C] tiles (int64 addresses among them) at 4096 elements: no spills at sm_90
    return dict(BLOCK_M=block_m, BLOCK_J=block_j, BLOCK_G=block_g, BLOCK_K=64 if fp32 or block_m > 64 else 128,
                BLOCK_C=min(next_pow2(block_g * g), 4096 // block_m)), 4 if block_m <= 64 else 8


def _dynamic_conv_prepare_triton(x, projection, base, out, dynamic) -> None:
    n, b, h = x.shape
    m = n * b
    if m == 0:
        return
    taps = base.shape[0]
    groups = projection.shape[0] // (2 * taps)
    fp32 = x.dtype == torch.float32
    tile, num_warps = _tile(m, taps, groups, h // groups, fp32)
    grid = (triton.cdiv(m, tile["BLOCK_M"]), triton.cdiv(groups, tile["BLOCK_G"]))
    _dynamic_conv_prepare_kernel[grid](
        out_ptr=out, dyn_ptr=dynamic, x_ptr=x, w_ptr=projection, base_ptr=base, M=m, B=b, H=h, NG=groups,
        G=h // groups, stride_xn=x.stride(0), stride_xt=x.stride(1), stride_w=projection.stride(0), TAPS=taps,
        LOWP_DOT=not fp32 and not interpreting(), DOT_PREC="ieee" if fp32 else "tf32", num_warps=num_warps, **tile,
    )


def dynamic_conv_prepare(x: torch.Tensor, projection: torch.Tensor, base: torch.Tensor, *,
                         out: torch.Tensor | None = None, dynamic: torch.Tensor | None = None,
                         backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """DFlash2's ``prepare`` before a sublayer: the kernel projection and side 0's convolution, one launch.

    Args:
        x: ``[N, B, H]`` fp32/bf16/fp16, last dim contiguous (requests and rows may be strided): the normed
            sublayer input of the B block rows of N requests.
        projection: ``[2*K*H/G, H]`` in x's dtype, last dim contiguous: ``kernel_projection.weight`` (rows
            ordered [side, tap, group]).
        base: ``[K, H]`` contiguous, any float dtype: ``base_kernel[0]``.
        out: ``None``, or a contiguous ``[N, B, H]`` tensor in x's dtype sharing no memory with x (e.g. the block rows
            of the buffer a following GEMM reads).
        dynamic: ``None``, or a contiguous ``[N, B, 2, K, H/G]`` tensor in x's dtype sharing no memory with x or
            out: where both sides' dynamic kernels go.
        backend: ``"auto" | "triton" | "cpu" | "torch"`` (``"cpu"`` is the reference: on CPU the runtime's own
            GEMM, then ``grouped_dynamic_conv``, is the faster path).

    Returns:
        ``(out, dynamic)`` (new tensors where not given) as :func:`dynamic_conv_prepare_reference`: the GEMM
        accumulates in fp32 and rounds once to the dtype, the convolution reads those rounded values, accumulates
        its K taps in fp32 and rounds once (``grouped_dynamic_conv``'s rule). ``dynamic[:, :, 1]`` is ``finish``'s
        operand.
    """
    chosen = resolve_backend(DYNAMIC_CONV_PREPARE, backend, x.device, available=_BACKENDS)
    if out is None:
        out = x.new_empty(x.shape)
    if dynamic is None:
        dynamic = x.new_empty(_dynamic_shape(x, projection, base))
    call_op(_dynamic_conv_prepare_op, x, projection, base, out, dynamic, chosen, device=x.device)
    return out, dynamic


def _dynamic_shape(x, projection, base) -> tuple[int, ...]:
    """``[N, B, 2, K, H/G]`` from the operands, or ``(0,)`` where they have the wrong form (the op's checks then
    name the argument)."""
    forms = ((x, 3), (projection, 2), (base, 2))
    if not all(isinstance(t, torch.Tensor) and t.dim() == d for t, d in forms) or base.shape[0] == 0:
        return (0,)
    taps = base.shape[0]
    return (*x.shape[:2], 2, taps, projection.shape[0] // (2 * taps))


def _check_dynamic_conv_prepare(x, projection, base, out, dynamic, backend):
    op = DYNAMIC_CONV_PREPARE
    check_tensor(op, "x", x, ndim=3, dtypes=FLOAT_DTYPES)
    check_last_dim_contiguous(op, "x", x)
    n, b, h = x.shape
    check_tensor(op, "base", base, ndim=2, dtypes=FLOAT_DTYPES, device=x.device)
    taps = base.shape[0]
    if taps == 0 or base.shape[1] != h or not base.is_contiguous():
        raise ValueError(f"{op}: base must be a contiguous [K, H] = [K, {h}] tensor with K >= 1 (base_kernel[0]), "
                         f"got shape {tuple(base.shape)}{'' if base.is_contiguous() else ' (not contiguous)'}")
    check_tensor(op, "projection", projection, ndim=2, dtypes=(x.dtype,), device=x.device)
    rows = projection.shape[0]
    groups = rows // (2 * taps)
    if projection.shape[1] != h or rows % (2 * taps) or groups == 0 or h % groups:
        raise ValueError(f"{op}: projection must be [2*K*H/G, H] = [2*{taps}*H/G, {h}] with H/G groups dividing "
                         f"H (kernel_projection.weight), got shape {tuple(projection.shape)}")
    check_last_dim_contiguous(op, "projection", projection)
    check_conv_out(op, x, out)
    check_tensor(op, "dynamic", dynamic, dtypes=(x.dtype,), device=x.device)
    if dynamic.shape != (n, b, 2, taps, groups) or not dynamic.is_contiguous():
        raise ValueError(f"{op}: dynamic must be a contiguous [N, B, 2, K, H/G] = {(n, b, 2, taps, groups)} tensor, "
                         f"got {tuple(dynamic.shape)}{'' if dynamic.is_contiguous() else ' (not contiguous)'}")
    for name, other in (("x", x), ("out", out)):
        if overlap(dynamic, other):
            raise ValueError(f"{op}: dynamic overlaps {name}; write the dynamic kernels into another buffer")


@torch.library.custom_op("dflash::dynamic_conv_prepare", mutates_args=("out", "dynamic"))
@checked_by(_check_dynamic_conv_prepare)
def _dynamic_conv_prepare_op(x: torch.Tensor, projection: torch.Tensor, base: torch.Tensor, out: torch.Tensor,
                             dynamic: torch.Tensor, backend: str) -> None:
    """``torch.ops.dflash.dynamic_conv_prepare``: :func:`dynamic_conv_prepare` after validation, into ``out`` and
    ``dynamic`` (a custom op may not return an alias of an input)."""
    chosen = resolve_backend(DYNAMIC_CONV_PREPARE, backend, x.device, available=_BACKENDS)
    if chosen == "torch":
        convolved, projected = dynamic_conv_prepare_reference(x, projection, base)
        out.copy_(convolved)
        dynamic.copy_(projected)
    else:
        _dynamic_conv_prepare_triton(x, projection, base, out, dynamic)


@_dynamic_conv_prepare_op.register_fake
def _dynamic_conv_prepare_fake(x, projection, base, out, dynamic, backend):
    return None

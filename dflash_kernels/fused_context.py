"""fused_context: target taps -> fc projection -> RMSNorm (the draft's ``hidden_norm(fc(cat(taps)))``)."""
from __future__ import annotations

import functools
from typing import Sequence, Union

import torch
import triton
import triton.language as tl

from dflash_kernels._dispatch import call_op, checked_by, resolve_backend
from dflash_kernels._triton_utils import (
    FLOAT_DTYPES, check_last_dim_contiguous, check_tensor, interpreting, next_pow2, rms_norm_reference,
)

OP = "fused_context"
MAX_SEPARATE_TAPS = 8
_BACKENDS = ("triton", "torch")

Taps = Union[torch.Tensor, Sequence[torch.Tensor]]


def _split_taps(taps: Taps, fc_weight: torch.Tensor) -> list[torch.Tensor]:
    """Normalise the three accepted tap layouts to a list of [N, H] views (no copies)."""
    if isinstance(taps, torch.Tensor):
        if taps.dim() == 3:
            return list(taps.unbind(0))
        if taps.dim() == 2:
            check_tensor(OP, "fc_weight", fc_weight, ndim=2)
            h = fc_weight.shape[0]
            if h == 0 or taps.shape[1] % h != 0:
                raise ValueError(f"{OP}: a 2-D taps tensor must be [N, T*H] with H = fc_weight.shape[0] = {h}; "
                                 f"got taps shape {tuple(taps.shape)}")
            return [taps[:, t * h:(t + 1) * h] for t in range(taps.shape[1] // h)]
        raise ValueError(f"{OP}: taps must be a list of [N, H] tensors, one [N, T*H] or one [T, N, H] tensor; "
                         f"got a tensor of shape {tuple(taps.shape)}")
    if not isinstance(taps, (list, tuple)) or len(taps) == 0:
        raise TypeError(f"{OP}: taps must be a non-empty list/tuple of [N, H] tensors or one tensor")
    return list(taps)


def _validate(taps: list[torch.Tensor], fc_weight, norm_weight, eps, out):
    for i, t in enumerate(taps):
        check_tensor(OP, f"taps[{i}]", t, ndim=2, dtypes=FLOAT_DTYPES, device=taps[0].device)
        if t.shape != taps[0].shape:
            raise ValueError(f"{OP}: taps[{i}] has shape {tuple(t.shape)} but taps[0] has {tuple(taps[0].shape)}; "
                             "all taps must be [N, H]")
        if t.dtype != taps[0].dtype:
            raise TypeError(f"{OP}: taps[{i}] is {t.dtype} but taps[0] is {taps[0].dtype}; cast all taps to one dtype")
    n, h = taps[0].shape
    dev = taps[0].device
    check_tensor(OP, "fc_weight", fc_weight, ndim=2, dtypes=FLOAT_DTYPES, device=dev)
    if tuple(fc_weight.shape) != (h, len(taps) * h):
        raise ValueError(f"{OP}: fc_weight must be [H, T*H] = [{h}, {len(taps) * h}] (nn.Linear layout, T={len(taps)} "
                         f"taps of width {h}); got {tuple(fc_weight.shape)}")
    check_tensor(OP, "norm_weight", norm_weight, ndim=1, dtypes=FLOAT_DTYPES, device=dev)
    if norm_weight.shape[0] != h:
        raise ValueError(f"{OP}: norm_weight must be [H] = [{h}], got {tuple(norm_weight.shape)}")
    if not isinstance(eps, (float, int)) or eps < 0:
        raise ValueError(f"{OP}: eps must be a non-negative float, got {eps!r}")
    if out is not None:
        check_tensor(OP, "out", out, ndim=2, dtypes=(taps[0].dtype,), device=dev)
        if tuple(out.shape) != (n, h):
            raise ValueError(f"{OP}: out must be [N, H] = [{n}, {h}], got {tuple(out.shape)}")
        check_last_dim_contiguous(OP, "out", out)


def fused_context_reference(taps: Taps, fc_weight: torch.Tensor, norm_weight: torch.Tensor,
                            eps: float = 1e-6) -> torch.Tensor:
    """Definition: ``RMSNorm(cat(taps, -1) @ fc_weight.T)`` computed in the taps' dtype (HF numerics)."""
    taps = _split_taps(taps, fc_weight)
    x = torch.cat(taps, dim=-1)
    y = x @ fc_weight.to(x.dtype).t()
    return rms_norm_reference(y, norm_weight, eps)


@triton.jit
def _fc_gemm_kernel(
    out_ptr, ws_ptr, w_ptr, norm_w_ptr,
    t0, t1, t2, t3, t4, t5, t6, t7,
    rs0, rs1, rs2, rs3, rs4, rs5, rs6, rs7,
    tap_stride, N, H, stride_wn, stride_wk, stride_ws, stride_out, eps, K_CHUNK,
    NUM_TAPS: tl.constexpr, UNIFORM: tl.constexpr, FUSE_NORM: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    # Split-K: program (.., .., s) covers columns [s*K_CHUNK, (s+1)*K_CHUNK) of the virtual concat and
    # writes its own fp32 partial (summed by the norm kernel: deterministic, no atomics).
    split = tl.program_id(2)
    kc_lo = split * K_CHUNK
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    col_ok = cols < H
    rows64 = rows.to(tl.int64)
    cols64 = cols.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for t in tl.static_range(NUM_TAPS):
        # Each tap is read from its own pointer: the concat is never materialised.
        if UNIFORM:
            base = t0 + t * tap_stride
            rs = rs0
        elif t == 0:
            base = t0
            rs = rs0
        elif t == 1:
            base = t1
            rs = rs1
        elif t == 2:
            base = t2
            rs = rs2
        elif t == 3:
            base = t3
            rs = rs3
        elif t == 4:
            base = t4
            rs = rs4
        elif t == 5:
            base = t5
            rs = rs5
        elif t == 6:
            base = t6
            rs = rs6
        else:
            base = t7
            rs = rs7
        lo = tl.maximum(kc_lo - t * H, 0)
        hi = tl.minimum(kc_lo + K_CHUNK - t * H, H)
        for k0 in range(lo, hi, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < hi
            x = tl.load(base + rows64[:, None] * rs + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                        other=0.0).to(tl.float32)
            wk = (t * H + ks).to(tl.int64)
            w = tl.load(w_ptr + cols64[:, None] * stride_wn + wk[None, :] * stride_wk,
                        mask=col_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PREC)
    if FUSE_NORM:
        ms = tl.sum(acc * acc, axis=1) / H
        nw = tl.load(norm_w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        y = acc * tl.rsqrt(ms + eps)[:, None] * nw[None, :]
        tl.store(out_ptr + rows64[:, None] * stride_out + cols64[None, :], y.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])
    else:
        ws = ws_ptr + split.to(tl.int64) * N * stride_ws
        tl.store(ws + rows64[:, None] * stride_ws + cols64[None, :], acc, mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _rmsnorm_rows_kernel(out_ptr, x_ptr, w_ptr, N, H, SPLITS, stride_x, stride_out, eps, BLOCK_H: tl.constexpr):
    """RMSNorm of rows of sum_s x[s] (the split-K partials [SPLITS, N, H] fp32)."""
    row = tl.program_id(0).to(tl.int64)
    ss = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        offs = h0 + tl.arange(0, BLOCK_H)
        x = tl.zeros((BLOCK_H,), dtype=tl.float32)
        for s in range(0, SPLITS):
            x += tl.load(x_ptr + (s * N + row) * stride_x + offs, mask=offs < H, other=0.0)
        ss += x * x
    rstd = tl.rsqrt(tl.sum(ss, axis=0) / H + eps)
    for h0 in range(0, H, BLOCK_H):
        offs = h0 + tl.arange(0, BLOCK_H)
        m = offs < H
        x = tl.zeros((BLOCK_H,), dtype=tl.float32)
        for s in range(0, SPLITS):
            x += tl.load(x_ptr + (s * N + row) * stride_x + offs, mask=m, other=0.0)
        w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * stride_out + offs, (x * rstd * w).to(out_ptr.dtype.element_ty), mask=m)


def _uniform_tap_stride(taps: list[torch.Tensor]):
    """Element gap between consecutive taps if they are equally spaced views of one buffer, else None."""
    if len(taps) == 1:
        return 0
    t0 = taps[0]
    gap = taps[1].data_ptr() - t0.data_ptr()
    if gap % t0.element_size():
        return None
    for i, t in enumerate(taps):
        if t.stride() != t0.stride() or t.data_ptr() - t0.data_ptr() != i * gap:
            return None
    return gap // t0.element_size()


@functools.lru_cache(maxsize=8)
def _sm_count_index(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _sm_count(dev: torch.device) -> int:
    return _sm_count_index(dev.index if dev.index is not None else torch.cuda.current_device())


def _fused_context_triton(taps: list[torch.Tensor], fc_weight, norm_weight, eps, out, split_k=None) -> None:
    n, h = taps[0].shape
    dev = taps[0].device
    if n == 0:
        return
    taps = [t if t.stride(-1) == 1 or h == 1 else t.contiguous() for t in taps]
    tap_stride = _uniform_tap_stride(taps)
    if tap_stride is None and len(taps) > MAX_SEPARATE_TAPS:
        # More separate buffers than the kernel has pointer slots: fall back to one packed copy.
        packed = torch.stack(taps, 0)
        taps, tap_stride = list(packed.unbind(0)), packed.stride(0)
    uniform = tap_stride is not None
    ptrs = taps[:1] * MAX_SEPARATE_TAPS if uniform else taps + taps[:1] * (MAX_SEPARATE_TAPS - len(taps))
    row_strides = [t.stride(0) for t in ptrs]
    if interpreting():
        block_m, block_n, block_k = min(64, next_pow2(n)), min(256, next_pow2(h)), min(256, next_pow2(h))
    else:
        block_m = 16 if n <= 16 else (32 if n <= 32 else 64)
        block_n = 32 if n <= 32 else 64
        block_k = 128 if n <= 32 else 64
        if next_pow2(h) <= block_n:
            block_n = next_pow2(h)
    block_n = max(block_n, 16)
    tiles = triton.cdiv(n, block_m) * triton.cdiv(h, block_n)
    k_tiles = triton.cdiv(len(taps) * h, block_k)
    if split_k is None:
        if interpreting():
            split_k = 2 if block_n < h and k_tiles >= 2 else 1
        else:
            # Small N leaves too few output tiles to keep enough weight bytes in flight: split K.
            split_k = max(1, min(8, k_tiles // 4, triton.cdiv(_sm_count(dev), tiles) * 2))
    split_k = max(1, min(int(split_k), k_tiles))
    k_chunk = triton.cdiv(k_tiles, split_k) * block_k
    split_k = triton.cdiv(len(taps) * h, k_chunk)
    fuse_norm = block_n >= h and split_k == 1
    ws = out if fuse_norm else torch.empty((split_k, n, h), dtype=torch.float32, device=dev)
    dot_prec = "ieee" if taps[0].dtype == torch.float32 or fc_weight.dtype == torch.float32 else "tf32"
    grid = (triton.cdiv(n, block_m), triton.cdiv(h, block_n), split_k)
    _fc_gemm_kernel[grid](
        out_ptr=out, ws_ptr=ws, w_ptr=fc_weight, norm_w_ptr=norm_weight,
        t0=ptrs[0], t1=ptrs[1], t2=ptrs[2], t3=ptrs[3], t4=ptrs[4], t5=ptrs[5], t6=ptrs[6], t7=ptrs[7],
        rs0=row_strides[0], rs1=row_strides[1], rs2=row_strides[2], rs3=row_strides[3],
        rs4=row_strides[4], rs5=row_strides[5], rs6=row_strides[6], rs7=row_strides[7],
        tap_stride=tap_stride or 0, N=n, H=h, stride_wn=fc_weight.stride(0), stride_wk=fc_weight.stride(1),
        stride_ws=ws.stride(-2), stride_out=out.stride(0), eps=float(eps), K_CHUNK=k_chunk,
        NUM_TAPS=len(taps), UNIFORM=uniform, FUSE_NORM=fuse_norm, DOT_PREC=dot_prec,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )
    if not fuse_norm:
        _rmsnorm_rows_kernel[(n,)](out_ptr=out, x_ptr=ws, w_ptr=norm_weight, N=n, H=h, SPLITS=split_k,
                                   stride_x=ws.stride(1), stride_out=out.stride(0), eps=float(eps),
                                   BLOCK_H=min(next_pow2(h), 4096))


def fused_context(taps: Taps, fc_weight: torch.Tensor, norm_weight: torch.Tensor, eps: float = 1e-6, *,
                  out: torch.Tensor | None = None, backend: str = "auto") -> torch.Tensor:
    """Project the target's tapped hidden states to the draft width and RMS-normalise them.

    out = RMSNorm(concat(taps, -1) @ fc_weight.T) * norm_weight, RMS statistics in fp32.

    Args:
        taps: the T tapped hidden states of the N new context rows, as one of
            * a list/tuple of T tensors ``[N, H]`` (each read from its own pointer; rows may be strided,
              the last dim must be contiguous or is made so),
            * one tensor ``[N, T*H]`` (tap t = columns ``t*H:(t+1)*H``),
            * one tensor ``[T, N, H]``.
            dtype fp32 / bf16 / fp16, all taps the same. N may be 0.
        fc_weight: ``[H, T*H]``, the draft's ``fc.weight`` (nn.Linear layout, no bias); any float dtype.
        norm_weight: ``[H]``, the draft's ``hidden_norm.weight``.
        eps: RMSNorm epsilon (``rms_norm_eps`` of the draft config).
        out: None, or an ``[N, H]`` tensor in the taps' dtype (last dim contiguous, rows may be strided) to
            write the result into, e.g. rows of a buffer that a following GEMM reads together with other rows.
        backend: ``"auto" | "triton" | "torch"``.

    Returns:
        ``out``, or a new ``[N, H]`` tensor in the taps' dtype.
    """
    taps_list = _split_taps(taps, fc_weight)
    _validate(taps_list, fc_weight, norm_weight, eps, out)
    chosen = resolve_backend(OP, backend, taps_list[0].device, available=_BACKENDS)
    if out is None:
        out = taps_list[0].new_empty((taps_list[0].shape[0], fc_weight.shape[0]))
    call_op(_fused_context_op, taps_list, fc_weight, norm_weight, float(eps), out, chosen, device=taps_list[0].device)
    return out


def _check(taps, fc_weight, norm_weight, eps, out, backend):
    _validate(taps, fc_weight, norm_weight, eps, out)


@torch.library.custom_op("dflash::fused_context", mutates_args=("out",))
@checked_by(_check)
def _fused_context_op(taps: list[torch.Tensor], fc_weight: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                      out: torch.Tensor, backend: str) -> None:
    """``torch.ops.dflash.fused_context``: :func:`fused_context` after validation (writes out); ``taps`` is the
    list of T ``[N, H]`` views the public function makes of any accepted layout."""
    chosen = resolve_backend(OP, backend, taps[0].device, available=_BACKENDS)
    if chosen == "torch":
        out.copy_(fused_context_reference(taps, fc_weight, norm_weight, eps))
        return
    _fused_context_triton(taps, fc_weight, norm_weight, eps, out)


@_fused_context_op.register_fake
def _fused_context_fake(taps, fc_weight, norm_weight, eps, out, backend):
    return None

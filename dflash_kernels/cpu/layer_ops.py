"""The CPU bodies of ``add_rms_norm`` and ``silu_mul``: the native kernels on fp32 rows, else the references'
rounding steps with fewer ops per call."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from dflash_kernels._dispatch import register
from dflash_kernels.cpu import native as cpu_native
from dflash_kernels.layer_ops import ADD_RMS_NORM, SILU_MUL, silu_mul_reference


@register(ADD_RMS_NORM, "cpu")
def add_rms_norm_cpu(x, weight, eps, residual, out) -> None:
    """``add_rms_norm`` on CPU tensors: ``cpu_native.add_rms_norm`` for fp32 rows, else the reference's rounding
    steps with torch's fused RMSNorm (fp32 statistics, the normalised value rounded to the dtype, then the weight
    multiply, written into ``out``): fewer ops per call. A token-major ``out`` (not contiguous) gets the same values
    through a contiguous buffer."""
    if not out.is_contiguous():
        rows = torch.empty(out.shape, dtype=out.dtype)
        add_rms_norm_cpu(x, weight, eps, residual, rows)
        out.copy_(rows)
        return
    if cpu_native.add_rms_norm(x, weight, eps, residual, out):
        return
    s = x if residual is None else residual.add_(x)
    torch.mul(weight.to(s.dtype), F.rms_norm(s, (s.shape[-1],), eps=eps), out=out)


@register(SILU_MUL, "cpu")
def silu_mul_cpu(gate_up):
    """``silu_mul`` on CPU tensors: ``cpu_native.silu_mul`` where it applies (fp32 rows), else the reference."""
    out = gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))
    if cpu_native.silu_mul(gate_up, out):
        return out
    return silu_mul_reference(gate_up).contiguous()

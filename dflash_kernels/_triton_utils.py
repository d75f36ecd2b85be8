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


def as_index_tensor(op: str, name: str, value, device: torch.device) -> torch.Tensor:
    """An int or a 1-element integer tensor -> 1-element int64 tensor on ``device`` (graph-friendly)."""
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
        return value.reshape(1).to(torch.int64)
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

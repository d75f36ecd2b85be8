"""Tolerance rule shared by the kernel tests.

A kernel's error against an fp64 reference may be at most 2x the error of the same PyTorch op run in the
same low precision, plus a small floor:
* one output-dtype ulp of the reference value at that element (the rounding of the final store; the CPU
  interpreter truncates bf16 stores instead of rounding them, which costs up to 1 ulp), and
* 8 fp32 ulps of the largest reference value: the kernels compute in fp32, and two different fp32
  operation orders differ by a few ulps (for fp32 inputs the torch baseline is itself only ~1-2 ulps, so
  "2x" alone fails about once per hundred random draws of draft_attention; measured 6.4 ulps vs 1.4).
  For bf16 outputs this term is ~1e-4 of a bf16 ulp, so it does not weaken the low-precision check.
"""
from __future__ import annotations

import math

import torch


def ulp(ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One unit in the last place of ``dtype`` at each value of ``ref`` (fp64)."""
    info = torch.finfo(dtype)
    mag = ref.abs().clamp_min(info.tiny)
    return torch.exp2(torch.floor(torch.log2(mag))) * info.eps


def assert_within_rule(out: torch.Tensor, ref64: torch.Tensor, lowp: torch.Tensor, what: str = "") -> None:
    assert out.shape == ref64.shape == lowp.shape, (out.shape, ref64.shape, lowp.shape)
    assert not torch.isnan(ref64).any(), f"{what}: the fp64 reference has NaN"
    assert not torch.isnan(out).any(), f"{what}: output has NaN (an element was not written)"
    if out.numel() == 0:
        return
    baseline = (lowp.double() - ref64).abs().max()
    err = (out.double() - ref64).abs()
    allowed = 2 * baseline + ulp(ref64, out.dtype) + 8 * torch.finfo(torch.float32).eps * ref64.abs().max()
    bad = err > allowed
    assert not bad.any(), (f"{what}: kernel error {err.max().item():.3e} exceeds 2 x torch {out.dtype} error "
                           f"{baseline.item():.3e} + 1 ulp at {int(bad.sum())} of {err.numel()} elements")


def chi2(counts: torch.Tensor, probs: torch.Tensor, n: int) -> tuple[float, float]:
    """(statistic, critical value at p ~ 1e-6); a sample in a zero-probability cell is an automatic fail."""
    exp = probs.flatten() * n
    obs = counts.flatten().double()
    if (obs[exp == 0] > 0).any():
        return math.inf, 0.0
    live = exp > 0
    stat = float(((obs[live] - exp[live]) ** 2 / exp[live]).sum())
    df = int(live.sum()) - 1
    z = 4.75  # Wilson-Hilferty upper quantile, one-sided p ~ 1e-6
    crit = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat, crit

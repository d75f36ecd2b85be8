"""dflash_kernels: Triton and C++/CUDA kernels for DFlash speculative decoding.

Every op has a pure-PyTorch reference (its definition), a Triton kernel and, where the
extension provides one, a compiled op; the public function takes ``backend=``.
"""
from __future__ import annotations

import torch

from dflash_kernels._dispatch import BACKENDS, backend_status

__all__ = ["BACKENDS", "available_backends"]


def available_backends(device: str | torch.device = "cpu") -> dict[str, tuple[bool, str]]:
    """Map each backend to ``(usable, reason)`` for tensors on ``device``."""
    device = torch.device(device)
    return {name: backend_status(name, device) for name in BACKENDS if name != "auto"}

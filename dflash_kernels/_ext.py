"""Loader for the compiled extension ``dflash_kernels._C`` (C++ CPU ops, CUDA ops)."""
from __future__ import annotations

import torch


def status(device: torch.device) -> tuple[bool, str]:
    """Whether the compiled ops can run on tensors of ``device``, and why not."""
    return False, "the compiled extension dflash_kernels._C is not built"

"""Shared helpers of the extension tests (not collected: no test_ prefix)."""
import pytest
import torch

from dflash_kernels import _ext

EXT_CPU_OK, EXT_CPU_WHY = _ext.status("cpu")
EXT_CUDA_OK, EXT_CUDA_WHY = (_ext.status("cuda") if torch.cuda.is_available()
                             else (False, "no CUDA device"))

needs_ext = pytest.mark.skipif(
    not EXT_CPU_OK,
    reason=f"compiled extension unavailable: {EXT_CPU_WHY}")


def devices():
    """CPU always; CUDA when a device and the CUDA ops are there (skipped with the reason otherwise)."""
    return [
        "cpu",
        pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
            not EXT_CUDA_OK, reason=f"CUDA ops unavailable: {EXT_CUDA_WHY}")]),
    ]

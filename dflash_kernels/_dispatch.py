"""Backend selection shared by every public op.

Rule: an explicitly requested backend that cannot run raises; ``"auto"`` picks the fastest
backend that can run on the given tensors. ``DFLASH_KERNELS_BACKEND`` (auto|triton|cpu|torch|ext)
overrides the ``backend=`` argument of every op process-wide.

``"cpu"`` is the eager CPU path: an op's CPU implementation (the same definition as its reference, with
the per-call Python work cut: batched over requests, one RoPE table per call) where it has one, else
its reference, which is already what runs on a CPU. It runs on CPU tensors only.
"""
from __future__ import annotations

import os

import torch

BACKENDS = ("auto", "triton", "cpu", "torch", "ext")
ENV_VAR = "DFLASH_KERNELS_BACKEND"


def triton_status(device: torch.device) -> tuple[bool, str]:
    """Whether Triton kernels can run on tensors of ``device``, and why not."""
    try:
        import triton  # noqa: F401
    except ImportError as exc:  # pragma: no cover - triton is a hard dependency
        return False, f"triton is not importable ({exc})"
    interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if device.type == "cuda":
        if interpret:
            return False, "TRITON_INTERPRET=1 runs kernels on the CPU only"
        return True, "compiled for the GPU"
    if device.type == "cpu":
        if interpret:
            return True, "CPU interpreter (TRITON_INTERPRET=1)"
        return False, "CPU tensors need TRITON_INTERPRET=1 set before dflash_kernels is imported"
    return False, f"no Triton backend for device type {device.type!r}"


def resolve_backend(op: str, backend: str, device: torch.device, available: tuple[str, ...]) -> str:
    """Return the backend ``op`` will run with.

    ``available`` lists the backends the op implements, fastest first (``"torch"`` last).
    """
    forced = os.environ.get(ENV_VAR)
    if forced:
        if forced not in BACKENDS:
            raise ValueError(f"{ENV_VAR}={forced!r} is not one of {BACKENDS}")
        backend = forced
    if backend not in BACKENDS:
        raise ValueError(f"{op}: backend={backend!r} is not one of {BACKENDS}")
    if backend == "auto":
        for candidate in available:
            if backend_status(candidate, device)[0]:
                return candidate
        return "torch"
    if backend not in available and backend != "cpu":
        raise ValueError(f"{op}: backend={backend!r} is not implemented for this op; choose from {available}")
    ok, why = backend_status(backend, device)
    if not ok:
        raise RuntimeError(f"{op}: backend={backend!r} cannot run on {device.type} tensors: {why}")
    # "cpu" on an op without a separate CPU implementation: its reference is that op's CPU path.
    return backend if backend in available else "torch"


def backend_status(backend: str, device: torch.device) -> tuple[bool, str]:
    if backend == "torch":
        return True, "pure PyTorch reference"
    if backend == "cpu":
        if device.type == "cpu":
            return True, "eager CPU implementation"
        return False, f"the CPU implementations need CPU tensors, these are on {device.type}"
    if backend == "triton":
        return triton_status(device)
    if backend == "ext":
        from dflash_kernels import _ext

        return _ext.status(device)
    return False, f"unknown backend {backend!r}"


def lean_version_bump(op) -> None:
    """Give the mutating custom op ``op`` (a ``torch.library.custom_op``) a cheaper ADInplaceOrView kernel.

    Eager calls of a mutating custom op pass through that kernel, which bumps the version counters of the
    written arguments. torch's (``torch/_library/custom_ops.py``) first calls ``fill_defaults``, which rebuilds
    the schema's argument list for every argument: quadratic in the argument count, about 140 us of a
    ``verify_attention`` call (17 arguments) on the project's CPU, against 140 us for the attention itself.
    This kernel does the same work (bump the written tensors, found once from the schema; redispatch past the
    key with torch's own keyset) without that. Under ``torch.compile`` and FakeTensor nothing changes.
    """
    overload = op._opoverload
    written = [(i, a.name) for i, a in enumerate(overload._schema.arguments)
               if a.alias_info is not None and a.alias_info.is_write]
    after = torch._C._after_ADInplaceOrView_keyset

    def adinplaceorview(keyset, *args, **kwargs):
        for i, name in written:
            t = args[i] if i < len(args) else kwargs.get(name)
            if t is not None:
                torch._C._increment_version(t)
        return overload.redispatch(keyset & after, *args, **kwargs)

    op._lib.impl(op._name, adinplaceorview, "ADInplaceOrView", with_keyset=True)

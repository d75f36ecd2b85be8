"""Merged projections without a second copy of the weights.

A decoder layer reads ``q_proj``/``k_proj``/``v_proj`` (and ``gate_proj``/``up_proj``) from the same
input; one GEMM over the stacked weight costs one launch instead of three and reads the same bytes.
:func:`merged_weight` stacks the modules' weights into one buffer once and re-points each module's
parameter at its row slice of that buffer, so the model keeps working (and saving, and loading
state dicts in place) exactly as before while the runtime multiplies by the whole buffer. On the CPU,
:func:`row_blocks` hands the same projections to ``dflash_kernels.cpu.linear`` as row blocks instead: one call, no copy.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from dflash_kernels.cpu.linear import RowBlocks


def _views_of(merged: torch.Tensor, params: Sequence[torch.Tensor]) -> bool:
    """Whether ``params`` are consecutive row slices of ``merged``, in order."""
    offset = merged.storage_offset()
    storage = merged.untyped_storage()._cdata
    for p in params:
        if (p.untyped_storage()._cdata != storage or p.storage_offset() != offset or p.dtype != merged.dtype
                or p.shape[1:] != merged.shape[1:] or not p.is_contiguous()):
            return False
        offset += p.numel()
    return offset == merged.storage_offset() + merged.numel()


def _checked(linears: Sequence[nn.Linear], name: str) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """The linears' weights and biases, once they are known to stack: same dtype, device and input size; a bias on
    all or none."""
    weights = [lin.weight for lin in linears]
    first = weights[0]
    for lin, w in zip(linears, weights):
        if w.dtype != first.dtype or w.device != first.device or w.shape[1:] != first.shape[1:]:
            raise ValueError(f"{name}: cannot merge {type(lin).__name__} weights of shape {tuple(w.shape)}, "
                             f"{w.dtype}, {w.device} with {tuple(first.shape)}, {first.dtype}, {first.device}; "
                             "the projections of one layer must share dtype, device and input size")
    biases = [lin.bias for lin in linears]
    if any(b is not None for b in biases) and not all(b is not None for b in biases):
        raise ValueError(f"{name}: some projections have a bias and some do not; cannot merge them")
    return weights, biases


def row_blocks(linears: Sequence[nn.Linear], name: str) -> tuple[RowBlocks, None]:
    """``(blocks, None)``: ``linears`` as the row blocks of one stacked projection, left where they are (no copy,
    nothing re-pointed), for ``dflash_kernels.cpu.linear.linear``, which reads up to three blocks as one weight in one
    call (the blocks carry the biases). The same checks as :func:`merged_weight`."""
    weights, biases = _checked(linears, name)
    return RowBlocks(weights, None if biases[0] is None else biases), None


def merged_weight(linears: Sequence[nn.Linear], owner: nn.Module, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(weight [sum(out_i), in], bias or None)`` of ``linears`` stacked in order, sharing storage with them.

    The buffer is remembered on ``owner`` under ``name`` (a plain attribute: not a parameter, not in
    the state dict) and reused while the modules' parameters are still its views; if a parameter was
    replaced since, the weights are merged again. Weights must share dtype, device and input size.
    """
    weights, biases = _checked(linears, name)
    cached = owner.__dict__.get(name)
    if cached is not None and _views_of(cached[0], weights) and (
            cached[1] is None if biases[0] is None else _views_of(cached[1], biases)):
        return cached
    merged = (torch.cat([w.detach() for w in weights]),
              torch.cat([b.detach() for b in biases]) if biases[0] is not None else None)
    for attr, buffer in (("weight", merged[0]), ("bias", merged[1])):
        if buffer is None:
            continue
        row = 0
        for lin in linears:
            old = getattr(lin, attr)
            rows = old.shape[0]
            setattr(lin, attr, nn.Parameter(buffer[row:row + rows], requires_grad=old.requires_grad))
            row += rows
    owner.__dict__[name] = merged
    return merged

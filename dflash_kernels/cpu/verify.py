"""The CPU body of ``verify_greedy``: the acceptance rule on NumPy's argmax of the logits."""
from __future__ import annotations

from dflash_kernels._dispatch import register
from dflash_kernels.cpu.argmax import argmax_cpu
from dflash_kernels.verify import _accept_greedy


@register("verify_greedy", "cpu")
def verify_greedy_cpu(logits, draft_tokens):
    """``verify_greedy`` on CPU tensors: the reference's acceptance on :func:`argmax_cpu` of the logits."""
    return _accept_greedy(argmax_cpu(logits), draft_tokens)

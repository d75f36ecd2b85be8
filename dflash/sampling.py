"""Sampling settings and z-lab's ``sample``.

The rules themselves live once, in :mod:`dflash_kernels.verify`: the temperature/top-k/top-p filter
(``filter_logits_reference``) and the lossless acceptance of proposals, one-hot (argmax) or drawn from a
sparse draft distribution (DFlash2's selector) (``verify_sample``). Both runtimes use them through the kernel
library.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash_kernels.verify import filter_logits_reference

GREEDY_EPS = 1e-5


def check_sampling_args(temperature: float, top_p: float, top_k: int) -> None:
    if not isinstance(temperature, (int, float)) or temperature != temperature or temperature < 0:
        raise ValueError(f"temperature must be a number >= 0 (0 = greedy), got {temperature!r}")
    if not isinstance(top_p, (int, float)) or not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k must be an integer >= 0 (0 = no top-k), got {top_k!r}")


@dataclass(frozen=True)
class SamplingParams:
    """Validated sampling settings of one ``generate`` call (``temperature < 1e-5`` means greedy)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        check_sampling_args(self.temperature, self.top_p, self.top_k)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def filtered(self) -> bool:
        """Whether top-k or top-p removes anything (an extra pass over the vocabulary when sampling)."""
        return self.top_k > 0 or self.top_p < 1.0


def sampling_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0) -> torch.Tensor:
    """[..., V] logits -> [..., V] fp32 probabilities after temperature, top-k, then top-p (the kernel
    library's filter, HF warper order), renormalised over the kept tokens."""
    return torch.softmax(filter_logits_reference(logits, temperature, top_k, top_p), dim=-1)


def sample(
    logits: torch.Tensor,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """z-lab ``sample``: [..., V] logits -> [...] token ids; argmax when temperature < 1e-5."""
    if temperature < GREEDY_EPS:
        return torch.argmax(logits, dim=-1)
    probs = sampling_probs(logits, temperature, top_p, top_k)
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])

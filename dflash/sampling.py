"""Sampling settings and z-lab's ``sample``.

The rules themselves live once, in :mod:`dflash_kernels.verify`: the temperature/top-k/top-p filter
(``filter_logits_reference``) and the lossless acceptance of one-hot (argmax) proposals
(``verify_sample``). Both runtimes use them through the kernel library.
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


def rejection_sample_candidates(logits: torch.Tensor, proposals: torch.Tensor, candidates: torch.Tensor,
                                draft_q: torch.Tensor, sampling: SamplingParams,
                                generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling of one block whose draft distributions are sparse (DFlash2's selector): position i
    proposed ``proposals[0, i]`` from ``draft_q[0, i]`` over the token ids ``candidates[0, i]``.

    p_i = the target's distribution (temperature, top-k, top-p) at row i of ``logits`` [1, v, V]; proposal d_i
    is accepted with probability min(1, p_i(d_i) / q_i(d_i)) while all earlier ones were; at the first rejection
    the next token is drawn from max(p_i - q_i, 0) renormalised (p_i itself if that is zero everywhere), after v-1
    acceptances from p_{v-1}. Returns ``(accepted [1], next_token [1])`` int64."""
    p = sampling_probs(logits[0], sampling.temperature, sampling.top_p, sampling.top_k)
    n = proposals.shape[1]
    q = torch.zeros((n, p.shape[-1]), dtype=p.dtype, device=p.device)
    q.scatter_add_(1, candidates[0], draft_q[0].to(p.dtype))
    rows = torch.arange(n, device=p.device)
    p_d, q_d = p[rows, proposals[0]], q[rows, proposals[0]]
    u = torch.rand(n, generator=generator, device=p.device, dtype=p.dtype)
    accepted = int((u * q_d < p_d).int().cumprod(0).sum())
    dist = p[accepted]
    if accepted < n:
        residual = (p[accepted] - q[accepted]).clamp_min(0)
        if float(residual.sum()) > 0:
            dist = residual / residual.sum()
    bonus = torch.multinomial(dist, 1, generator=generator)
    return torch.tensor([accepted], device=p.device), bonus

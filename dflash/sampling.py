"""Target-side sampling and the lossless acceptance rule of the reference runtime.

Proposals are the draft's argmax tokens (a one-hot proposal distribution q). With one-hot q,
standard speculative sampling reduces to: accept draft token d with probability p(d); on
rejection draw from p with d removed and renormalised; if every proposal is accepted, draw the
bonus token from the target's next row. Every emitted token is then distributed exactly as the
target's own sample.
"""
from __future__ import annotations

import torch

GREEDY_EPS = 1e-5


def check_sampling_args(temperature: float, top_p: float, top_k: int) -> None:
    if not isinstance(temperature, (int, float)) or temperature != temperature or temperature < 0:
        raise ValueError(f"temperature must be a number >= 0 (0 = greedy), got {temperature!r}")
    if not isinstance(top_p, (int, float)) or not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k must be an integer >= 0 (0 = no top-k), got {top_k!r}")


def sampling_probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0) -> torch.Tensor:
    """[..., V] logits -> [..., V] fp32 probabilities after temperature, top-k, then top-p.

    top-k keeps the k largest logits; top-p keeps the smallest prefix of the sorted distribution
    whose mass reaches ``top_p`` (at least one token); the kept mass is renormalised.
    """
    scaled = logits.float() / temperature
    if 0 < top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k, dim=-1).values[..., -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p
        keep_sorted = mass_before < top_p
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        probs = probs * keep
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


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


def accept_one_hot_proposals(
    probs: torch.Tensor, draft_tokens: torch.Tensor, generator: torch.Generator | None = None
) -> tuple[int, int]:
    """Speculative sampling with argmax (one-hot) proposals, one request.

    Args:
        probs: [v, V] target probabilities for the rows of the verified block (row j scores the
            token after block position j).
        draft_tokens: [v-1] proposals.
    Returns:
        (accepted, next_token): the number of accepted proposals and the token emitted after
        them (the residual sample at the first rejection, else the bonus from row v-1).
    """
    n_draft = draft_tokens.shape[0]
    for j in range(n_draft):
        d = int(draft_tokens[j])
        p_d = float(probs[j, d])
        u = torch.rand((), generator=generator, device=probs.device).item()
        if u < p_d:
            continue
        residual = probs[j].clone()
        residual[d] = 0.0
        total = residual.sum()
        if total <= 0:  # p was one-hot on d, which cannot be rejected; kept for safety
            return j, d
        return j, int(torch.multinomial(residual / total, 1, generator=generator))
    return n_draft, int(torch.multinomial(probs[n_draft], 1, generator=generator))

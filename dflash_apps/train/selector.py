"""Training and evaluating a DFlash2 draft's candidate selector on packed blocks (see :mod:`dflash_apps.train.blocks`).

The selector (:class:`dflash.dflash2.CandidateSelector`) reranks the ``selector_top_k`` best draft logits of each
block position by ``logit + <predecessor[prev] * hidden_projection(h), successor[candidate]>`` and walks the block
left to right from the anchor. Its training objective (z-lab publishes none; this is the rule of speculators'
DFlash2 trainer) is a K-way cross-entropy over those candidates toward the target's token, with the previous token
teacher-forced (the sequence's own, as the walk sees it whenever every earlier proposal was right) and, when the
target's token is not among the candidates, the weakest candidate replaced by it so that every position has a
label. It is added to the draft's own loss with the same position weights; its gradient also reaches the draft's
logits, since the walk ranks their sum with the transition score. Evaluation walks the selector's greedy path as
the runtimes do.
"""
from __future__ import annotations

import torch

from dflash_apps.train.blocks import acceptance_lengths, weighted_block_loss


def teacher_forced_predecessors(block_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The token before each block row [b, A*B] (target ids): the anchor for row 1, row k-1's label for row k > 1.
    Row 0 of a block (no label) gets a token too, which no loss reads."""
    before = torch.where(labels >= 0, labels, block_ids)  # row 0: the anchor; a row without a label: its own id
    return torch.cat([before[:, :1], before[:, :-1]], dim=1)


def training_candidates(logits: torch.Tensor, labels: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``top_k`` best logits' indices [b, q, k] (best first), the label's place among them replacing the
    weakest where it is missing, and that place [b, q] (-100 where the row has no label)."""
    candidates = logits.detach().topk(top_k, dim=-1).indices
    hit = candidates == labels[..., None]
    keep = hit.any(-1) | (labels < 0)  # rows without a label keep their top-k
    candidates[..., -1] = torch.where(keep, candidates[..., -1], labels)
    place = torch.where(keep, hit.long().argmax(-1), top_k - 1)
    return candidates, torch.where(labels >= 0, place, -100)


def selector_scores(selector, logits: torch.Tensor, hidden: torch.Tensor, predecessors: torch.Tensor,
                    candidates: torch.Tensor, candidate_ids: torch.Tensor) -> torch.Tensor:
    """Scores [b, q, k] of ``candidates`` (indices into the last dim of ``logits``; ``candidate_ids`` their target
    token ids) after ``predecessors`` [b, q]: :meth:`CandidateSelector.select`'s score, for all rows at once."""
    transition = selector.transition_scores(selector.hidden_projection(hidden), predecessors, candidate_ids)
    return logits.gather(-1, candidates) + transition


def selector_loss(selector, logits: torch.Tensor, hidden: torch.Tensor, block_ids: torch.Tensor,
                  labels: torch.Tensor, target_labels: torch.Tensor, block_size: int, gamma: float | None,
                  column_ids: torch.Tensor | None = None):
    """The selector's K-way cross-entropy (module docstring) over packed blocks, position-weighted as the draft's
    loss: ``(loss, stats)`` of :func:`weighted_block_loss` over the candidates (its accuracy is the teacher-forced
    selector's). ``logits`` [b, q, V'] with ``labels`` indices into their last dim (-100: none); ``target_labels``
    the same labels as target token ids; ``column_ids`` the target token id of each logit column (None: the full
    vocabulary, column = id)."""
    candidates, place = training_candidates(logits, labels, selector.top_k)
    candidate_ids = candidates if column_ids is None else column_ids.to(candidates.device)[candidates]
    scores = selector_scores(selector, logits, hidden, teacher_forced_predecessors(block_ids, target_labels),
                             candidates, candidate_ids)
    return weighted_block_loss(scores, place, block_size, gamma)


@torch.no_grad()
def selector_path_acceptance(draft, hidden: torch.Tensor, logits: torch.Tensor, block_ids: torch.Tensor,
                             labels: torch.Tensor) -> torch.Tensor:
    """Teacher-forced acceptance length of each full block (as :func:`acceptance_lengths`) for the proposals of
    the selector's greedy walk from the block's anchor (the runtimes' ``select_block``). hidden [b, A*B, H],
    logits [b, A*B, V] (full vocabulary), block_ids / labels [b, A*B]."""
    B = draft.config.block_size
    b, q, _ = hidden.shape
    pred = torch.full((b, q // B, B), -1, dtype=torch.long, device=labels.device)
    full = (labels.view(b, q // B, B)[:, :, 1:] != -100).all(-1)
    if full.any():
        rows = hidden.view(b, q // B, B, -1)[full]
        path, _, _ = draft.candidate_selector.select(rows[:, 1:], logits.view(b, q // B, B, -1)[full][:, 1:],
                                                     block_ids.view(b, q // B, B)[full][:, 0])
        pred[full] = torch.cat([torch.full_like(path[:, :1], -1), path], dim=1).to(pred.device)
    return acceptance_lengths(pred.view(b, q), labels, B)

"""Soft labels for draft training: the target's own next-token distribution at each labelled block row.

The responses are the target's greedy tokens, so a hard label says only which token the target ranks first. Its
whole distribution at that position also says how close the runners-up are: information a small draft learns from
with less data (knowledge distillation). It is recomputed, not stored: the data folder holds the features of the
draft's deepest tapped layer at every position, and the target layers after that tap (its "tail"), its final norm
and LM head turn them into the target's logits. The tail runs causally over the whole stored sequence, so every
position sees exactly the prefix the target saw. Stored features are bf16, so these logits are close to the
target's rather than bit-equal; the hard label, the target's greedy token, stays exact.
"""
from __future__ import annotations

from typing import Sequence

import torch


class TailTeacher:
    """The target's layers after tapped layer ``tap``, its final norm and rotary embedding (shared, never trained).

    ``hidden(target_hidden, layer_ids)`` -> the final-normed hidden state [b, Lmax, H] of every position of a packed
    batch's features; the caller multiplies by LM-head rows to get logits over any vocabulary."""

    def __init__(self, target, tap: int):
        n = target.config.num_hidden_layers
        if not 0 <= tap < n - 1:
            raise ValueError(f"soft labels need target layers after the draft's deepest tap {tap} (the target has "
                             f"{n} layers, 0..{n - 1}): tap a layer before {n - 1} or train with hard labels only")
        self.tap = tap
        self.layers = target.model.layers[tap + 1:]
        self.norm = target.model.norm
        self.rotary = target.model.rotary_emb
        self.hidden_size = target.config.hidden_size

    @torch.no_grad()
    def hidden(self, target_hidden: torch.Tensor, layer_ids: Sequence[int]) -> torch.Tensor:
        """``target_hidden`` [b, Lmax, T*H]: a packed batch's features, the taps ``layer_ids`` side by side (the
        draft's order), right-padded; the one of ``tap`` feeds the tail (padding only follows real positions, and
        the tail is causal)."""
        if self.tap not in layer_ids:
            raise ValueError(f"the features hold taps {list(layer_ids)}, not the teacher's tap {self.tap}")
        H = self.hidden_size
        j = list(layer_ids).index(self.tap)
        weight = self.norm.weight
        x = target_hidden[..., j * H:(j + 1) * H].to(device=weight.device, dtype=weight.dtype)
        b, lmax, _ = x.shape
        pos = torch.arange(lmax, device=x.device)[None].expand(b, -1)
        # An explicit additive causal mask, which every attention implementation (eager or SDPA) honours.
        causal = torch.full((lmax, lmax), torch.finfo(x.dtype).min, dtype=x.dtype, device=x.device).triu(1)
        mask = causal[None, None].expand(b, 1, -1, -1)
        rope = self.rotary(x, pos)
        for layer in self.layers:
            x = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=rope)
        return self.norm(x)


def soft_targets(hidden: torch.Tensor, position_ids: torch.Tensor, ctx_len: int, head_rows: torch.Tensor) -> torch.Tensor:
    """The teacher's probabilities [b, q, V'] for the packed block rows: row at position p predicts token p, i.e.
    the teacher's distribution after position p - 1, over the LM-head rows ``head_rows`` [V', H] (the columns of
    the draft's logits). ``hidden`` from :meth:`TailTeacher.hidden`; ``position_ids``/``ctx_len`` of the packed
    batch (anchor rows and padding blocks get some position's distribution; their labels exclude them)."""
    rows = (position_ids[:, ctx_len:] - 1).clamp(0, hidden.shape[1] - 1)
    h = hidden.gather(1, rows[..., None].expand(-1, -1, hidden.shape[-1]))
    return torch.softmax((h @ head_rows.T).float(), dim=-1)

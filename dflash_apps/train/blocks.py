"""Anchors, packed blocks, the block mask and the position-weighted loss.

One training example is a clean sequence ``ids`` [L] (prompt + target response) with the target
features of positions ``0..L-2``. ``A`` anchors are drawn uniformly without replacement from the
response positions ``prompt_len .. L-2`` (an anchor needs at least one label after it) and
resampled every time the sequence is visited. Anchor ``a`` gives the block
``[ids[a], MASK × (B-1)]`` at positions ``a .. a+B-1`` whose row ``k`` (1..B-1) predicts
``ids[a+k]`` — exactly the draft call at inference right after ``ids[a]`` was committed.

All blocks of a batch row are packed into one draft forward: queries are the ``A·B`` block rows,
keys are ``[context rows 0..Lmax-1, block rows]``. The block mask lets a block row see

* context position ``p`` iff ``p < a`` (strictly before its anchor: the anchor's own features do
  not exist yet at inference), and
* the rows of its own block, bidirectionally — never other blocks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from dflash_kernels import default_backend as default_kernel_backend
from dflash_kernels.tree import build_tree, tree_accept_greedy_tokens

DEFAULT_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


def default_gamma(block_size: int) -> float:
    """Paper values (γ=7 for B=16, 5 for B=10, 4 for B=8); other B: linear interpolation/extrapolation
    through those points, i.e. γ ≈ B/2 - 0 .. (B=8→4, B=12→5.67, B=16→7)."""
    if block_size in DEFAULT_GAMMA:
        return DEFAULT_GAMMA[block_size]
    if block_size < 10:
        return max(1.0, 4.0 + (block_size - 8) * 0.5)
    return 5.0 + (block_size - 10) * (2.0 / 6.0)


def loss_weights(block_size: int, gamma: float | None = None) -> torch.Tensor:
    """Weights of the B-1 predicted positions: ``w_k = exp(-(k-1)/γ)``, k = 1..B-1 (k=1 first masked row)."""
    gamma = default_gamma(block_size) if gamma is None else gamma
    k = torch.arange(1, block_size, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


def sample_anchors(prompt_len: int, seq_len: int, num_anchors: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """Sorted anchor positions (int64) drawn without replacement from ``[prompt_len, seq_len-2]``."""
    lo, hi = prompt_len, seq_len - 2
    n = hi - lo + 1
    if n <= 0:
        return torch.empty(0, dtype=torch.long)
    perm = torch.randperm(n, generator=generator)[: min(num_anchors, n)]
    return (perm + lo).sort().values


@dataclass
class PackedBatch:
    target_hidden: torch.Tensor   # [b, Lmax, T*H]
    block_ids: torch.Tensor       # [b, A*B] token ids of the block rows
    position_ids: torch.Tensor    # [b, Lmax + A*B]
    labels: torch.Tensor          # [b, A*B] (-100 = no loss; always -100 on anchor rows)
    anchors: torch.Tensor         # [b, A] (-1 = padding block)
    ctx_len: int                  # Lmax
    block_size: int

    def dense_mask(self) -> torch.Tensor:
        return build_block_mask(self.anchors, self.ctx_len, self.block_size)


def pack_batch(records: Sequence[dict], anchors: Sequence[torch.Tensor], block_size: int, mask_token_id: int) -> PackedBatch:
    """Pad the sequences and build the packed blocks (see module docstring)."""
    b = len(records)
    B = block_size
    A = max(1, max(len(a) for a in anchors))
    lmax = max(int(r["features"].shape[0]) for r in records)
    th = records[0]["features"].shape[-1]
    feats = torch.zeros(b, lmax, th, dtype=torch.float32)
    block_ids = torch.full((b, A * B), mask_token_id, dtype=torch.long)
    labels = torch.full((b, A * B), -100, dtype=torch.long)
    anc = torch.full((b, A), -1, dtype=torch.long)
    pos = torch.zeros(b, lmax + A * B, dtype=torch.long)
    pos[:, :lmax] = torch.arange(lmax)
    k = torch.arange(B)
    for i, (r, a) in enumerate(zip(records, anchors)):
        f = r["features"]
        feats[i, : f.shape[0]] = f.float()
        ids = r["ids"].long()
        L = ids.shape[0]
        for j, av in enumerate(a.tolist()):
            anc[i, j] = av
            s = j * B
            block_ids[i, s] = ids[av]
            tgt = av + k[1:]
            ok = tgt < L
            lab = torch.full((B - 1,), -100, dtype=torch.long)
            lab[ok] = ids[tgt[ok]]
            labels[i, s + 1: s + B] = lab
            pos[i, lmax + s: lmax + s + B] = av + k
        # padding blocks: positions continue after the last real one (never attended from outside)
    return PackedBatch(feats, block_ids, pos, labels, anc, lmax, B)


def build_block_mask(anchors: torch.Tensor, ctx_len: int, block_size: int) -> torch.Tensor:
    """Dense bool mask [b, 1, A*B, ctx_len + A*B], True = attend (see module docstring).

    Padding blocks (anchor -1) see only themselves, so no softmax row is empty."""
    b, A = anchors.shape
    B = block_size
    q_anchor = anchors.repeat_interleave(B, dim=1)                      # [b, A*B]
    ctx = torch.arange(ctx_len)[None, None, :] < q_anchor[:, :, None]    # [b, q, ctx]
    blk = torch.arange(A).repeat_interleave(B)
    same = (blk[:, None] == blk[None, :])[None].expand(b, -1, -1)        # [b, q, q]
    return torch.cat([ctx, same], dim=-1)[:, None]


def weighted_block_loss(logits: torch.Tensor, labels: torch.Tensor, block_size: int, gamma: float | None = None,
                        soft: torch.Tensor | None = None, soft_weight: float = 0.0):
    """Position-weighted cross-entropy over the masked block rows.

    ``logits`` [b, A*B, V] (any float dtype; computed in fp32), ``labels`` [b, A*B] with -100 for rows
    without a target (anchor rows, positions past the sequence end, padding blocks).
    Row k of a block (k = 1..B-1) has weight ``exp(-(k-1)/γ)``.

    ``soft`` [b, A*B, V]: the target's probabilities over the same columns (soft labels,
    :mod:`dflash_apps.train.teacher`); a row's loss is then ``(1 - soft_weight)`` x its CE against the label +
    ``soft_weight`` x its CE against ``soft`` (the KL divergence from the target plus the target's entropy, a
    constant). Rows without a label stay out either way.

    Normalisation (the paper leaves it open): a weighted mean, ``Σ w·CE / Σ w`` over the rows that
    have a label, so the loss is comparable across batches with different numbers of valid rows and
    equals plain CE when all rows predict perfectly alike.

    Returns ``(loss, stats)`` with per-position (unweighted) accuracy counts in ``stats``.
    """
    B = block_size
    w = torch.cat([torch.zeros(1), loss_weights(B, gamma)]).to(logits.device)  # row 0 = anchor
    b, q, V = logits.shape
    k_of_row = torch.arange(q, device=logits.device) % B
    wr = w[k_of_row][None].expand(b, -1)
    valid = labels != -100
    ce = F.cross_entropy(logits.reshape(-1, V).float(), labels.reshape(-1).clamp(min=0), reduction="none").view(b, q)
    if soft is not None and soft_weight:
        soft_ce = -(soft * torch.log_softmax(logits.float(), dim=-1)).sum(-1)
        ce = (1.0 - soft_weight) * ce + soft_weight * soft_ce
    wr = wr * valid
    loss = (ce * wr).sum() / wr.sum().clamp(min=1e-9)
    with torch.no_grad():
        correct = (logits.argmax(-1) == labels) & valid
        per_k_correct = torch.zeros(B, device=logits.device).index_add_(0, k_of_row.repeat(b), correct.reshape(-1).float())
        per_k_count = torch.zeros(B, device=logits.device).index_add_(0, k_of_row.repeat(b), valid.reshape(-1).float())
    return loss, {"per_k_correct": per_k_correct, "per_k_count": per_k_count}


def acceptance_lengths(pred: torch.Tensor, labels: torch.Tensor, block_size: int) -> torch.Tensor:
    """Teacher-forced acceptance length per block (1 + leading run of correct predictions, counting the
    bonus token), for blocks whose B-1 labels all exist. pred/labels [b, A*B] -> [n_full_blocks] float."""
    B = block_size
    b, q = labels.shape
    lab, full = _block_labels(labels, B)
    pr = pred.view(b, q // B, B)[:, :, 1:]
    run = ((pr == lab).long().cumprod(-1)).sum(-1)
    return (1 + run[full]).float()


def _block_labels(labels: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """labels [b, A*B] -> (each block's B-1 labels [b, A, B-1], which blocks have all of them [b, A] bool)."""
    b, q = labels.shape
    lab = labels.view(b, q // block_size, block_size)[:, :, 1:]
    return lab, (lab != -100).all(-1)


def tree_acceptance_lengths(logits: torch.Tensor, labels: torch.Tensor, block_size: int,
                            budgets: Sequence[int], *, vocab_ids: torch.Tensor | None = None,
                            backend: str | None = None, chunk: int = 64) -> dict[int, torch.Tensor]:
    """Teacher-forced acceptance length per block of a draft tree of each of ``budgets`` nodes (``generate(...,
    tree_budget=n)``), for blocks whose B-1 labels all exist: the engine's rules themselves, ``build_tree`` on the
    block's draft logits (rows 1..B-1; the anchor row's are not used) and ``tree_accept_greedy_tokens`` with the
    labels as the target's greedy tokens (a node at depth d gets label d + 1: what the target emits after it if
    the node lies on the target's path, and off that path the walk never reads it), so 1 + the depth of the
    deepest tree node on the target's path. One tree a block, of the largest budget: ``build_tree`` returns its
    nodes best first, so the tree of n nodes is its first n + 1 (each parent before its children). logits
    [b, A*B, V'] (V': the draft's vocabulary; ``vocab_ids`` maps its indices to token ids as in ``build_tree``),
    labels [b, A*B] (token ids, -100 = none) -> {n: [n_full_blocks] float}; blocks go through the ops ``chunk``
    at a time (their logits are copied per chunk). ``backend``: the ops' (default: the engine's for the logits'
    device)."""
    B = block_size
    backend = backend or default_kernel_backend(logits.device)
    b, q, v = logits.shape
    lab, full = _block_labels(labels, B)
    drafts = logits.view(b, q // B, B, v)[:, :, 1:][full]                       # [R, B-1, V']
    follow = F.pad(lab[full], (0, 1))  # [R, B]: the token after a node of depth d (d = B-1: none, never read)
    out: dict[int, list[torch.Tensor]] = {n: [] for n in budgets}
    for c0 in range(0, drafts.shape[0] if budgets else 0, chunk):
        z = drafts[c0:c0 + chunk].float().contiguous()
        anchor = torch.zeros(z.shape[0], dtype=torch.long, device=z.device)  # the root's token: never compared
        tokens, parents, depths = build_tree(z, anchor, max(budgets), vocab_ids=vocab_ids, backend=backend)
        target_tokens = follow[c0:c0 + chunk].to(z.device).gather(1, depths)
        for n, got in out.items():
            t = n + 1
            _, accepted, _ = tree_accept_greedy_tokens(target_tokens[:, :t].contiguous(), tokens[:, :t].contiguous(),
                                                       parents[:, :t].contiguous(), block_size=B, backend=backend)
            got.append(1 + accepted.float())
    return {n: torch.cat(got) if got else torch.zeros(0) for n, got in out.items()}


# ------------------------------------------------------------------------------------------ forward paths
def draft_forward_dense(draft, batch: PackedBatch, embed_weight: torch.Tensor) -> torch.Tensor:
    """Draft hidden states [b, A*B, H] of all packed blocks with the dense-mask SDPA path."""
    noise = F.embedding(batch.block_ids, embed_weight) * draft.config.input_embedding_scale
    return draft(position_ids=batch.position_ids, attention_mask=batch.dense_mask(),
                 noise_embedding=noise.to(batch.target_hidden.dtype), target_hidden=batch.target_hidden)


def flex_block_mask(batch: PackedBatch, device=None):
    """FlexAttention ``BlockMask`` equal to :func:`build_block_mask`."""
    from torch.nn.attention.flex_attention import create_block_mask

    B = batch.block_size
    b, A = batch.anchors.shape
    q_len = A * B
    device = device or batch.target_hidden.device
    q_anchor = batch.anchors.repeat_interleave(B, dim=1).to(device)
    ctx_len = batch.ctx_len

    def mask_mod(bi, h, q_idx, kv_idx):
        in_ctx = kv_idx < ctx_len
        ctx_ok = kv_idx < q_anchor[bi, q_idx]
        blk_ok = ((kv_idx - ctx_len) // B) == (q_idx // B)
        return torch.where(in_ctx, ctx_ok, blk_ok)

    return create_block_mask(mask_mod, b, None, q_len, ctx_len + q_len, device=str(device))


def draft_forward_flex(draft, batch: PackedBatch, embed_weight: torch.Tensor, block_mask=None, compile: bool = True) -> torch.Tensor:
    """Same as :func:`draft_forward_dense` but attention runs through FlexAttention with a
    ``BlockMask`` (memory O(blocks) instead of a dense mask). Uses the draft's own modules."""
    from torch.nn.attention.flex_attention import flex_attention

    fa = torch.compile(flex_attention) if compile else flex_attention
    if block_mask is None:
        block_mask = flex_block_mask(batch)

    def attend(q, k, v):
        return fa(q, k, v, block_mask=block_mask, scale=q.shape[-1] ** -0.5, enable_gqa=q.shape[1] != k.shape[1])

    noise = F.embedding(batch.block_ids, embed_weight) * draft.config.input_embedding_scale
    return draft(position_ids=batch.position_ids, noise_embedding=noise.to(batch.target_hidden.dtype),
                 target_hidden=batch.target_hidden, attention_fn=attend)

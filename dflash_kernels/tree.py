"""Draft trees (DDTree-style): build a tree of likely continuations from the draft's per-position distributions,
walk it against the target's logits (greedy or sampled), and compact the accepted path's K/V rows.

Node arrays (int64, static shape ``[R, T]``, ``T = budget + 1``, one tree per request): node 0 is the root (the
anchor token, depth 0, parent -1); ``tree_tokens[r, i]`` is node i's target token id, ``tree_parents[r, i] < i``
its parent, ``tree_depths[r, i]`` its depth. Nodes are in selection order (best first), so parents precede
their children.

* ``build_tree``: the ``budget`` best non-root prefixes by summed draft log-probabilities.
* ``tree_ancestor_mask``: the per-round ancestor bitmask ``verify_attention`` takes for a tree.
* ``tree_accept_greedy`` / ``tree_accept_sample``: the acceptance walk -> ``(path, accepted, bonus)``.
* ``tree_compact``: the accepted path's K/V rows of every target layer moved to consecutive cache rows.
"""
from __future__ import annotations

import heapq
from typing import Optional

import numpy as np
import torch
import triton
import triton.language as tl

from dflash_kernels.cpu import native as cpu_native
from dflash_kernels._dispatch import call_op, checked_by, registered, resolve_backend
from dflash_kernels._triton_utils import (
    FLOAT_DTYPES, check_last_dim_contiguous, check_tensor, interpreting, next_pow2,
)
from dflash_kernels.verify import (
    _argmax_partial_kernel, _filter_threshold, _merge_argmax, _rng_for, _rows_per_program, _sample_partial_kernel,
    _vocab_split, check_packed_sampling, filter_logits_reference, gumbel_max, sampling_op_args,
)

_INDEX_DTYPES = (torch.int64,)
_BACKENDS = ("triton", "torch")  # and the wings' registered bodies (dflash_kernels.cpu)
MASK_WORD_BITS = 64


def mask_words(nodes: int) -> int:
    """int64 words per row of the ancestor bitmask of a tree with ``nodes`` nodes."""
    return (nodes + MASK_WORD_BITS - 1) // MASK_WORD_BITS


# --------------------------------------------------------------------------------------------------
# build_tree
# --------------------------------------------------------------------------------------------------

def draft_log_normalizer(draft_logits: torch.Tensor) -> torch.Tensor:
    """``[R, P]`` fp32 ``logsumexp`` of each draft row: log p = fp32(logit - this). Every backend takes it from
    this one torch op (on the logits' device), so that all of them score with bit-identical log-probs."""
    return torch.logsumexp(draft_logits.to(torch.float32), dim=-1)


def distinct_prefixes(depth: int, vocab: int, cap: int) -> int:
    """How many token sequences of length 1..``depth`` a ``vocab``-token draft can propose, counted up to
    ``cap``: the most non-root nodes a draft tree over ``depth`` block positions can have."""
    total, level = 0, 1
    for _ in range(depth):
        level *= vocab
        total += level
        if total >= cap:
            return cap
    return total


def _validate_build(op, draft_logits, anchor, budget, vocab_ids):
    check_tensor(op, "draft_logits", draft_logits, ndim=3, dtypes=FLOAT_DTYPES)
    check_last_dim_contiguous(op, "draft_logits", draft_logits)
    r, p, v = draft_logits.shape
    dev = draft_logits.device
    check_tensor(op, "anchor", anchor, ndim=1, dtypes=_INDEX_DTYPES, device=dev)
    check_last_dim_contiguous(op, "anchor", anchor)
    if anchor.shape[0] != r:
        raise ValueError(f"{op}: anchor must be [R={r}] (the last committed token of each request), got "
                         f"{tuple(anchor.shape)}")
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(f"{op}: budget must be an int >= 1 (non-root tree nodes), got {budget!r}")
    if v < 1 or distinct_prefixes(p, v, budget) < budget:
        raise ValueError(f"{op}: budget={budget} exceeds the number of distinct prefixes of draft_logits "
                         f"{tuple(draft_logits.shape)} (sum of V'^d for d = 1..B-1); lower the budget")
    if vocab_ids is not None:
        check_tensor(op, "vocab_ids", vocab_ids, ndim=1, dtypes=_INDEX_DTYPES, device=dev)
        check_last_dim_contiguous(op, "vocab_ids", vocab_ids)
        if vocab_ids.shape[0] != v:
            raise ValueError(f"{op}: vocab_ids must be [V'={v}] (target id of each draft logit index) or None, got "
                             f"{tuple(vocab_ids.shape)}")


def _top_k_sorted(z: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest values of each row of ``z`` and their indices, ordered by value desc then index asc (a
    stable descending sort's first k), without sorting whole rows: when no tie straddles the k-th place, topk's k
    entries reordered; else, per row, the entries >= the k-th largest value (ties at it included), then a
    stable sort of those few."""
    top = torch.topk(z, k, dim=-1)
    kth = top.values[..., -1:]
    keep = z >= kth
    if bool((keep.sum(-1) == k).all()):  # no tie straddles the k-th place: top holds exactly those k entries
        idx, by_idx = top.indices.sort(dim=-1)                            # index asc, then value desc (stable)
        vals, by_val = top.values.gather(-1, by_idx).sort(dim=-1, descending=True, stable=True)
        return vals, idx.gather(-1, by_val)
    flat, keep = z.reshape(-1, z.shape[-1]), keep.reshape(-1, z.shape[-1])
    vals = torch.empty((flat.shape[0], k), dtype=z.dtype, device=z.device)
    order = torch.empty((flat.shape[0], k), dtype=torch.int64, device=z.device)
    for row in range(flat.shape[0]):
        idx = keep[row].nonzero().flatten()                               # ascending indices
        sel = torch.sort(flat[row, idx], descending=True, stable=True)
        vals[row], order[row] = sel.values[:k], idx[sel.indices[:k]]
    return vals.view(*z.shape[:-1], k), order.view(*z.shape[:-1], k)


def build_tree_reference(draft_logits: torch.Tensor, anchor: torch.Tensor, budget: int, *,
                         vocab_ids: Optional[torch.Tensor] = None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Definition (a host heap). Row p of ``draft_logits`` is the draft's distribution at depth p + 1.

    log p[p, j] = fp32(logit[p, j] - draft_log_normalizer[p]); a node's score is the fp32 sum of log p along
    its path, added root to leaf (root score 0). The tree is the ``budget`` best non-root prefixes in the total
    order: higher score, then smaller depth, then smaller parent index, then higher logit at that position,
    then smaller draft vocab index. The set is prefix-closed (log p <= 0 and the order puts a parent before
    its children and a node before its next sibling), so a best-first search that, for each popped node,
    pushes its first child and its next sibling enumerates it exactly, in order.
    """
    r, p, v = draft_logits.shape
    t = budget + 1
    z = draft_logits.to(torch.float32)
    lse = draft_log_normalizer(draft_logits)
    k = min(budget, v)
    vals, order = _top_k_sorted(z, k)                                     # logit desc, then index asc
    logp = (vals - lse[..., None]).cpu().numpy()                         # fp32 [R, P, K]
    order = order.cpu().numpy()                                           # host arrays: cheap element access
    out = (torch.full((r, t), -1, dtype=torch.int64), torch.full((r, t), -1, dtype=torch.int64),
           torch.zeros((r, t), dtype=torch.int64))
    tokens, parents, depths = (a.numpy() for a in out)                   # views: writes land in out
    tokens[:, 0] = anchor.cpu().numpy()
    ids = vocab_ids.cpu().numpy() if vocab_ids is not None else None
    for req in range(r):
        lp = logp[req]
        score = [np.float32(0.0)]
        heap = [(-float(np.float32(0.0) + lp[0, 0]), 1, 0, 0)]        # (-score, depth, parent, rank)
        for i in range(1, t):
            neg, d, par, rank = heapq.heappop(heap)
            score.append(np.float32(-neg))
            j = int(order[req, d - 1, rank])
            tokens[req, i] = int(ids[j]) if ids is not None else j
            parents[req, i], depths[req, i] = par, d
            if rank + 1 < k:
                heapq.heappush(heap, (-float(score[par] + lp[d - 1, rank + 1]), d, par, rank + 1))
            if d < p:
                heapq.heappush(heap, (-float(score[i] + lp[d, 0]), d + 1, i, 0))
    dev = draft_logits.device
    return tuple(a.to(dev) for a in out)


@triton.jit
def _topk_partial_kernel(z_ptr, pval_ptr, pidx_ptr, P, V, K, S, stride_r, stride_p, BLOCK_V: tl.constexpr):
    """Per (draft row, vocab split of one tile): the split's K best logits, best first (logit desc, index asc),
    in slots ``[row, split, 0..K-1]``; slots past the split's size get index 2**31 - 1 (no candidate)."""
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    idx = split * BLOCK_V + tl.arange(0, BLOCK_V)
    ok = idx < V
    base = (row // P) * stride_r + (row % P) * stride_p
    x = tl.load(z_ptr + base + idx.to(tl.int64), mask=ok, other=float("-inf")).to(tl.float32)
    cand = ok
    out = (row * S + split) * K
    for kk in range(0, K):
        best = tl.max(tl.where(cand, x, float("-inf")), axis=0)
        bi = tl.min(tl.where(cand & (x == best), idx, 2147483647), axis=0)
        tl.store(pval_ptr + out + kk, best)
        tl.store(pidx_ptr + out + kk, bi)
        cand = cand & (idx != bi)


@triton.jit
def _topk_merge_kernel(pval_ptr, pidx_ptr, lse_ptr, lp_ptr, ids_ptr, K, SK, BLOCK_SK: tl.constexpr):
    """Per draft row: the K best of the splits' candidates (logit desc, index asc) as log-probs
    ``fp32(logit - lse)`` and draft indices."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_SK)
    idx = tl.load(pidx_ptr + row * SK + c, mask=c < SK, other=2147483647)
    x = tl.load(pval_ptr + row * SK + c, mask=c < SK, other=float("-inf"))
    cand = idx < 2147483647
    lse = tl.load(lse_ptr + row)
    for kk in range(0, K):
        best = tl.max(tl.where(cand, x, float("-inf")), axis=0)
        bi = tl.min(tl.where(cand & (x == best), idx, 2147483647), axis=0)
        tl.store(lp_ptr + row * K + kk, best - lse)
        tl.store(ids_ptr + row * K + kk, bi)
        cand = cand & (idx != bi)


@triton.jit
def _tree_enumerate_kernel(lp_ptr, ids_ptr, anchor_ptr, vocab_ptr, tok_ptr, par_ptr, dep_ptr, P, K, T,
                           HAS_VOCAB: tl.constexpr, BLOCK_T: tl.constexpr):
    """Per request: best-first enumeration of the prefix lattice. The frontier lives in registers, slot 0 for
    the root's first child and slot i for node i's first child; a popped node's slot takes its next sibling."""
    r = tl.program_id(0).to(tl.int64)
    f = tl.arange(0, BLOCK_T)
    lp_r = lp_ptr + r * P * K
    f_ok = f == 0
    f_score = tl.where(f_ok, tl.load(lp_r), float("-inf"))
    f_depth = tl.where(f_ok, 1, 0)
    f_par = tl.zeros((BLOCK_T,), tl.int32)
    f_rank = tl.zeros((BLOCK_T,), tl.int32)
    node_score = tl.zeros((BLOCK_T,), tl.float32)
    out = r * T
    tl.store(tok_ptr + out, tl.load(anchor_ptr + r))
    tl.store(par_ptr + out, -1)
    tl.store(dep_ptr + out, 0)
    for i in range(1, T):
        # Pop the best entry: score desc, then depth asc, then parent index asc. The frontier holds at most one
        # entry per parent (a parent's children enter one at a time, in rank order = logit desc, index asc),
        # so the parent identifies the entry and the rank rule is implied.
        cand = f_ok & (f_score == tl.max(tl.where(f_ok, f_score, float("-inf")), axis=0))
        cand = cand & (f_depth == tl.min(tl.where(cand, f_depth, 2147483647), axis=0))
        cand = cand & (f_par == tl.min(tl.where(cand, f_par, 2147483647), axis=0))
        slot = tl.min(tl.where(cand, f, 2147483647), axis=0)
        at = f == slot
        score = tl.max(tl.where(at, f_score, float("-inf")), axis=0)
        d = tl.max(tl.where(at, f_depth, 0), axis=0)
        par = tl.max(tl.where(at, f_par, 0), axis=0)
        rank = tl.max(tl.where(at, f_rank, 0), axis=0)
        j = tl.load(ids_ptr + r * P * K + (d - 1) * K + rank)
        if HAS_VOCAB:
            token = tl.load(vocab_ptr + j)
        else:
            token = j.to(tl.int64)
        tl.store(tok_ptr + out + i, token)
        tl.store(par_ptr + out + i, par.to(tl.int64))
        tl.store(dep_ptr + out + i, d.to(tl.int64))
        node_score = tl.where(f == i, score, node_score)
        # Next sibling (same parent, next rank at this depth) into the popped slot, or the slot empties.
        has_sib = rank + 1 < K
        par_score = tl.max(tl.where(f == par, node_score, float("-inf")), axis=0)
        sib = par_score + tl.load(lp_r + (d - 1) * K + rank + 1, mask=has_sib, other=0.0)
        f_score = tl.where(at, sib, f_score)
        f_rank = tl.where(at, rank + 1, f_rank)
        f_ok = f_ok & (~at | has_sib)
        # First child (rank 0 one level deeper) into slot i.
        has_child = d < P
        child = score + tl.load(lp_r + d * K, mask=has_child, other=0.0)
        new = (f == i) & has_child
        f_score = tl.where(new, child, f_score)
        f_depth = tl.where(new, d + 1, f_depth)
        f_par = tl.where(new, i, f_par)
        f_rank = tl.where(new, 0, f_rank)
        f_ok = f_ok | new


def _build_tree_triton(draft_logits, anchor, budget, vocab_ids):
    r, p, v = draft_logits.shape
    t = budget + 1
    k = min(budget, v)
    dev = draft_logits.device
    outs = tuple(torch.empty((r, t), dtype=torch.int64, device=dev) for _ in range(3))
    if r == 0:
        return outs
    rows = r * p
    lse = draft_log_normalizer(draft_logits)                     # a new contiguous [R, P]
    # Splits of one tile each: small tiles under the interpreter so that tests cross split borders.
    block_v = min(next_pow2(v), 64 if interpreting() else 2048)
    s = triton.cdiv(v, block_v)
    pval = torch.empty((rows, s, k), dtype=torch.float32, device=dev)
    pidx = torch.empty((rows, s, k), dtype=torch.int32, device=dev)
    _topk_partial_kernel[(rows, s)](z_ptr=draft_logits, pval_ptr=pval, pidx_ptr=pidx, P=p, V=v, K=k, S=s,
                                    stride_r=draft_logits.stride(0), stride_p=draft_logits.stride(1), BLOCK_V=block_v)
    lp = torch.empty((rows, k), dtype=torch.float32, device=dev)
    ids = torch.empty((rows, k), dtype=torch.int32, device=dev)
    _topk_merge_kernel[(rows,)](pval_ptr=pval, pidx_ptr=pidx, lse_ptr=lse, lp_ptr=lp, ids_ptr=ids, K=k, SK=s * k,
                                BLOCK_SK=next_pow2(s * k))
    tokens, parents, depths = outs
    _tree_enumerate_kernel[(r,)](lp_ptr=lp, ids_ptr=ids, anchor_ptr=anchor,
                                 vocab_ptr=vocab_ids if vocab_ids is not None else anchor, tok_ptr=tokens,
                                 par_ptr=parents, dep_ptr=depths, P=p, K=k, T=t, HAS_VOCAB=vocab_ids is not None,
                                 BLOCK_T=next_pow2(t))
    return outs


def build_tree(draft_logits: torch.Tensor, anchor: torch.Tensor, budget: int, *,
               vocab_ids: Optional[torch.Tensor] = None, backend: str = "auto"
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The draft tree of each request: its ``budget`` best non-root prefixes (DDTree), no host sync.

    Args:
        draft_logits: ``[R, B-1, V']`` fp32/bf16/fp16, last dim contiguous: row p is the draft's distribution
            (logits) for block position p + 1, i.e. tree depth p + 1.
        anchor: ``[R]`` int64: the root token of each tree (the last committed, not yet verified token).
        budget: int N >= 1, the non-root nodes (T = N + 1 nodes); at most the number of distinct prefixes
            (``sum_d V'^d``, d = 1..B-1), else ValueError.
        vocab_ids: ``[V']`` int64 or None: draft logit index j means target token ``vocab_ids[j]`` (a draft with
            a vocabulary subset; ids must be distinct). None: j is the token id.
        backend: ``"auto" | "triton" | "cpu" | "torch"`` (``"cpu"``: CPU tensors, in C).

    Returns:
        ``(tree_tokens, tree_parents, tree_depths)``, int64 ``[R, T]`` each, nodes in selection order (best
        first; node 0 the root). Scores, order and tie rule: :func:`build_tree_reference`.
    """
    chosen = resolve_backend("build_tree", backend, draft_logits.device, available=_BACKENDS)
    return call_op(_build_tree_op, draft_logits, anchor, budget, vocab_ids, chosen, device=draft_logits.device)



def _check_build(draft_logits, anchor, budget, vocab_ids, backend):
    _validate_build("build_tree", draft_logits, anchor, budget, vocab_ids)


@torch.library.custom_op("dflash::build_tree", mutates_args=())
@checked_by(_check_build)
def _build_tree_op(draft_logits: torch.Tensor, anchor: torch.Tensor, budget: int, vocab_ids: Optional[torch.Tensor],
                   backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``torch.ops.dflash.build_tree``: :func:`build_tree` after validation."""
    chosen = resolve_backend("build_tree", backend, draft_logits.device, available=_BACKENDS)
    body = registered("build_tree", chosen)
    if body is not None:
        return body(draft_logits, anchor, budget, vocab_ids)
    if chosen == "torch":
        return build_tree_reference(draft_logits, anchor, budget, vocab_ids=vocab_ids)
    return _build_tree_triton(draft_logits, anchor, budget, vocab_ids)


@_build_tree_op.register_fake
def _build_tree_fake(draft_logits, anchor, budget, vocab_ids, backend):
    shape = (draft_logits.shape[0], budget + 1)
    return tuple(draft_logits.new_empty(shape, dtype=torch.int64) for _ in range(3))


# --------------------------------------------------------------------------------------------------
# tree_ancestor_mask
# --------------------------------------------------------------------------------------------------

def _validate_nodes(op, name, t, shape=None, device=None):
    check_tensor(op, name, t, ndim=2, dtypes=_INDEX_DTYPES, device=device)
    check_last_dim_contiguous(op, name, t)
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{op}: {name} must be [R, T] = {list(shape)} (one row of node values per tree), got "
                         f"{tuple(t.shape)}")
    if t.shape[1] < 1:
        raise ValueError(f"{op}: {name} must have T >= 1 nodes (node 0 is the root), got {tuple(t.shape)}")


def tree_ancestor_mask_reference(tree_parents: torch.Tensor) -> torch.Tensor:
    """Definition: ``[R, T, W]`` int64, W = ceil(T / 64): bit ``j % 64`` of word ``j // 64`` of row i is set
    iff node j is node i or one of its ancestors (follow ``tree_parents`` up to the root)."""
    r, t = tree_parents.shape
    bits = torch.zeros((r, t, mask_words(t) * MASK_WORD_BITS), dtype=torch.uint8)
    par = tree_parents.cpu()
    cur = torch.arange(t).expand(r, t)                   # every node's current ancestor, -1 past the root
    while (cur >= 0).any():
        live = cur >= 0
        bits.scatter_reduce_(2, cur.clamp_min(0)[..., None], live[..., None].to(torch.uint8), reduce="amax")
        cur = torch.where(live, par.gather(1, cur.clamp_min(0)), -1)
    weights = torch.ones(MASK_WORD_BITS, dtype=torch.int64) << torch.arange(MASK_WORD_BITS)  # bit 63: int64 min
    words = (bits.view(r, t, mask_words(t), MASK_WORD_BITS).to(torch.int64) * weights).sum(-1)
    return words.to(tree_parents.device)


@triton.jit
def _ancestor_mask_kernel(par_ptr, mask_ptr, T, W, stride_pr, BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr):
    """Per request: walk every node's parent chain at once (T steps bound any depth), OR-ing each visited
    node's bit into the node's words."""
    r = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK_T)
    i_ok = i < T
    w = tl.arange(0, BLOCK_W)
    cur = tl.where(i_ok, i, -1).to(tl.int64)
    words = tl.zeros((BLOCK_T, BLOCK_W), tl.int64)
    for _ in range(0, T):
        bit = tl.full((BLOCK_T,), 1, tl.int64) << (tl.maximum(cur, 0) % 64)   # bit 63 is the sign, as intended
        hit = (cur >= 0)[:, None] & (w[None, :] == (cur // 64)[:, None])
        words = words | tl.where(hit, bit[:, None], 0)
        cur = tl.load(par_ptr + r * stride_pr + cur, mask=cur >= 0, other=-1)
    out = (r * T + i)[:, None] * W + w[None, :]
    tl.store(mask_ptr + out, words, mask=i_ok[:, None] & (w < W)[None, :])


def tree_ancestor_mask(tree_parents: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """The ancestor bitmask of each tree, for :func:`dflash_kernels.verify_attention` (build once per round,
    pass it to every layer).

    Args:
        tree_parents: ``[R, T]`` int64, ``tree_parents[r, i] < i`` (-1 for the root, node 0).
        backend: ``"auto" | "triton" | "cpu" | "torch"`` (``"cpu"``: CPU tensors, in C).

    Returns:
        ``[R, T, ceil(T / 64)]`` int64: bit ``j % 64`` of word ``j // 64`` of row i is set iff node j is node i
        or an ancestor of it.
    """
    chosen = resolve_backend("tree_ancestor_mask", backend, tree_parents.device, available=_BACKENDS)
    return call_op(_tree_ancestor_mask_op, tree_parents, chosen, device=tree_parents.device)



def _check_ancestor_mask(tree_parents, backend):
    op = "tree_ancestor_mask"
    _validate_nodes(op, "tree_parents", tree_parents)
    if tree_parents.device.type == "cpu":  # the references and kernels follow the parents as addresses
        r, t = tree_parents.shape
        node = torch.arange(t)
        ok = torch.where(node == 0, tree_parents == -1, (tree_parents >= 0) & (tree_parents < node))
        if not bool(ok.all()):
            req, i = divmod(int((~ok).reshape(-1).int().argmax()), t)
            raise ValueError(cpu_native.bad_parent_message(op, tree_parents, req, i))


@torch.library.custom_op("dflash::tree_ancestor_mask", mutates_args=())
@checked_by(_check_ancestor_mask)
def _tree_ancestor_mask_op(tree_parents: torch.Tensor, backend: str) -> torch.Tensor:
    """``torch.ops.dflash.tree_ancestor_mask``: :func:`tree_ancestor_mask` after validation."""
    chosen = resolve_backend("tree_ancestor_mask", backend, tree_parents.device, available=_BACKENDS)
    body = registered("tree_ancestor_mask", chosen)
    if body is not None:
        return body(tree_parents)
    if chosen == "torch":
        return tree_ancestor_mask_reference(tree_parents)
    r, t = tree_parents.shape
    words = mask_words(t)
    mask = torch.empty((r, t, words), dtype=torch.int64, device=tree_parents.device)
    if r:
        _ancestor_mask_kernel[(r,)](par_ptr=tree_parents, mask_ptr=mask, T=t, W=words,
                                    stride_pr=tree_parents.stride(0), BLOCK_T=next_pow2(t), BLOCK_W=next_pow2(words))
    return mask


@_tree_ancestor_mask_op.register_fake
def _tree_ancestor_mask_fake(tree_parents, backend):
    r, t = tree_parents.shape
    return tree_parents.new_empty((r, t, mask_words(t)))


# --------------------------------------------------------------------------------------------------
# tree_accept_greedy / tree_accept_sample
# --------------------------------------------------------------------------------------------------

def _validate_accept(op, logits, tree_tokens, tree_parents, block_size):
    check_tensor(op, "logits", logits, ndim=3, dtypes=FLOAT_DTYPES)
    check_last_dim_contiguous(op, "logits", logits)
    r, t, v = logits.shape
    if t < 1 or v < 1:
        raise ValueError(f"{op}: logits must be [R, T, V] with T >= 1 nodes and V >= 1, got {tuple(logits.shape)}")
    _validate_nodes(op, "tree_tokens", tree_tokens, (r, t), logits.device)
    _validate_nodes(op, "tree_parents", tree_parents, (r, t), logits.device)
    _validate_block_size(op, block_size)


def _validate_block_size(op, block_size):
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"{op}: block_size must be an int >= 1 (B: the path holds depths 0..B-1), got {block_size!r}")


def _walk_reference(choose, tree_tokens, tree_parents, block_size):
    """From the root, descend to the (first) child whose token is ``choose(request, node)`` at the current node
    while one exists and the depth is below B - 1; that choice at the node where the walk stops is the bonus.
    ``choose`` is called once per visited node, request by request, root first."""
    r, t = tree_tokens.shape
    path = torch.full((r, block_size), -1, dtype=torch.int64)
    accepted = torch.zeros(r, dtype=torch.int64)
    bonus = torch.zeros(r, dtype=torch.int64)
    tokens, parents = tree_tokens.cpu(), tree_parents.cpu()
    for req in range(r):
        cur, d = 0, 0
        path[req, 0] = 0
        while True:
            x = choose(req, cur)
            kids = ((parents[req] == cur) & (tokens[req] == x)).nonzero().flatten()
            if d + 1 >= block_size or kids.numel() == 0:
                bonus[req] = x
                break
            cur, d = int(kids[0]), d + 1
            path[req, d] = cur
        accepted[req] = d
    dev = tree_tokens.device
    return path.to(dev), accepted.to(dev), bonus.to(dev)


@triton.jit
def _tree_walk_kernel(pval_ptr, pidx_ptr, tok_ptr, par_ptr, path_ptr, acc_ptr, bonus_ptr, R, T, S, BSZ,
                      stride_tr, stride_pr, SAMPLE: tl.constexpr, BLOCK_REQ: tl.constexpr, BLOCK_T: tl.constexpr,
                      BLOCK_S: tl.constexpr):
    """Per group of requests: the walk from the root. A node's choice is its merged split partials: the argmax
    (greedy) or the Gumbel-max winner (SAMPLE), both computed for every node beforehand."""
    reqs = tl.program_id(0) * BLOCK_REQ + tl.arange(0, BLOCK_REQ)
    req_ok = reqs < R
    reqs64 = reqs.to(tl.int64)
    nodes = tl.arange(0, BLOCK_T)
    m = req_ok[:, None] & (nodes < T)[None, :]
    toks = tl.load(tok_ptr + reqs64[:, None] * stride_tr + nodes[None, :], mask=m, other=-1)
    pars = tl.load(par_ptr + reqs64[:, None] * stride_pr + nodes[None, :], mask=m, other=-2)
    sp = tl.arange(0, BLOCK_S)
    cur = tl.zeros((BLOCK_REQ,), tl.int64)
    still = req_ok
    accepted = tl.zeros((BLOCK_REQ,), tl.int64)
    bonus = tl.zeros((BLOCK_REQ,), tl.int64)
    tl.store(path_ptr + reqs64 * BSZ, cur, mask=req_ok)
    for d in range(0, BSZ):
        rows64 = reqs64 * T + cur
        if SAMPLE:
            ok = req_ok[:, None] & (sp < S)[None, :]
            pofs = rows64[:, None] * S + sp[None, :]
            best = tl.load(pval_ptr + pofs, mask=ok, other=float("-inf"))
            bidx = tl.load(pidx_ptr + pofs, mask=ok, other=-1)
            top = tl.max(best, axis=1)
            choice = tl.min(tl.where(ok & (best == top[:, None]) & (bidx >= 0), bidx, 2147483647), axis=1)
        else:
            choice = _merge_argmax(pval_ptr, pidx_ptr, rows64, req_ok, S, BLOCK_S)
        choice = choice.to(tl.int64)
        bonus = tl.where(still, choice, bonus)
        if d < BSZ - 1:
            hit = m & (pars == cur[:, None]) & (toks == choice[:, None])
            child = tl.min(tl.where(hit, nodes[None, :], 2147483647), axis=1)
            still = still & (child < 2147483647)
            cur = tl.where(still, child.to(tl.int64), cur)
            accepted += still.to(tl.int64)
            tl.store(path_ptr + reqs64 * BSZ + d + 1, tl.where(still, cur, -1), mask=req_ok)
    tl.store(acc_ptr + reqs64, accepted, mask=req_ok)
    tl.store(bonus_ptr + reqs64, bonus, mask=req_ok)


def _walk_triton(pval, pidx, s, tree_tokens, tree_parents, block_size, sample):
    r, t = tree_tokens.shape
    dev = tree_tokens.device
    path = torch.empty((r, block_size), dtype=torch.int64, device=dev)
    accepted = torch.empty(r, dtype=torch.int64, device=dev)
    bonus = torch.empty(r, dtype=torch.int64, device=dev)
    if r == 0:
        return path, accepted, bonus
    block_req = min(next_pow2(r), 64 if interpreting() else 16)
    _tree_walk_kernel[(triton.cdiv(r, block_req),)](
        pval_ptr=pval, pidx_ptr=pidx, tok_ptr=tree_tokens, par_ptr=tree_parents, path_ptr=path, acc_ptr=accepted,
        bonus_ptr=bonus, R=r, T=t, S=s, BSZ=block_size, stride_tr=tree_tokens.stride(0),
        stride_pr=tree_parents.stride(0), SAMPLE=sample, BLOCK_REQ=block_req, BLOCK_T=next_pow2(t),
        BLOCK_S=next_pow2(s),
    )
    return path, accepted, bonus


def _tree_accept_greedy_triton(logits, tree_tokens, tree_parents, block_size):
    r, t, v = logits.shape
    rows = r * t
    block_v, chunk, s = _vocab_split(v, rows)
    pval = torch.empty((rows, s), dtype=torch.float32, device=logits.device)
    pidx = torch.empty((rows, s), dtype=torch.int32, device=logits.device)
    if r:
        br = _rows_per_program(rows, block_v)
        _argmax_partial_kernel[(triton.cdiv(rows, br), s)](
            logits_ptr=logits, pval_ptr=pval, pidx_ptr=pidx, R=rows, B=t, V=v, stride_n=logits.stride(0),
            stride_b=logits.stride(1), CHUNK=chunk, S=s, BLOCK_ROWS=br, BLOCK_V=block_v,
        )
    return _walk_triton(pval, pidx, s, tree_tokens, tree_parents, block_size, False)


def _tree_accept_sample_triton(logits, tree_tokens, tree_parents, block_size, temp_t, topk_t, topp_t, seed_t,
                               offset_t, use_top_k, use_top_p):
    """verify_sample's filter and Gumbel-max launches over all R x T node rows with nothing excluded (its draft
    token pointer reads one -1), then the walk: node i of request r draws with Philox row r * T + i."""
    r, t, v = logits.shape
    rows = r * t
    dev = logits.device
    block_v, chunk, s = _vocab_split(v, rows)
    pm = torch.empty((rows, s), dtype=torch.float32, device=dev)
    ps, pbest = torch.empty_like(pm), torch.empty_like(pm)
    pidx = torch.empty((rows, s), dtype=torch.int32, device=dev)
    if r:
        filt = use_top_k or use_top_p
        thr = _filter_threshold(logits, temp_t, topk_t, topp_t, use_top_k, use_top_p) if filt else pidx[:, 0]
        no_draft = torch.full((1,), -1, dtype=torch.int64, device=dev)
        br = _rows_per_program(rows, block_v)
        _sample_partial_kernel[(triton.cdiv(rows, br), s)](
            z_ptr=logits, draft_ptr=no_draft, seed_ptr=seed_t, offset_ptr=offset_t, thr_ptr=thr, pm_ptr=pm, ps_ptr=ps,
            pbest_ptr=pbest, pidx_ptr=pidx, temp_ptr=temp_t, R=rows, B=t, V=v, stride_n=logits.stride(0),
            stride_b=logits.stride(1), stride_dn=0, stride_dj=0, stride_param=1 if temp_t.numel() > 1 else 0,
            CHUNK=chunk, S=s, FILTER=filt, BLOCK_ROWS=br, BLOCK_V=block_v,
        )
    return _walk_triton(pbest, pidx, s, tree_tokens, tree_parents, block_size, True)


def tree_accept_greedy_reference(logits, tree_tokens, tree_parents, *, block_size: int):
    """Definition: the walk (:func:`_walk_reference`) choosing ``argmax(logits)`` at each node (torch.argmax: first
    index among ties, NaN counts as the maximum)."""
    return _walk_reference(lambda req, node: int(logits[req, node].argmax()), tree_tokens, tree_parents, block_size)


def tree_accept_greedy(logits: torch.Tensor, tree_tokens: torch.Tensor, tree_parents: torch.Tensor, *,
                       block_size: int, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy acceptance walk of each request's tree (no host sync).

    From the root, move to the child whose token equals ``argmax(logits)`` at the current node while one
    exists (the first such child if several share the token); that argmax when no child has it is the bonus.

    Args:
        logits: ``[R, T, V]`` fp32/bf16/fp16, last dim contiguous: row i is the target's distribution of the
            token after node i (the verify pass over the tree).
        tree_tokens, tree_parents: ``[R, T]`` int64, as :func:`build_tree` returns them (depths <= B - 1).
        block_size: B; the walk stops at depth B - 1.
        backend: ``"auto" | "triton" | "cpu" | "torch"`` (``"cpu"``: CPU tensors, the argmax by NumPy).

    Returns:
        ``(path [R, B], accepted [R], bonus [R])`` int64: ``path[r, d]`` is the node at depth d of the accepted
        path (``path[r, 0] = 0``; -1 after ``accepted[r]``), ``accepted`` the accepted non-root nodes, ``bonus``
        the target's token after the path.
    """
    chosen = resolve_backend("tree_accept_greedy", backend, logits.device, available=_BACKENDS)
    return call_op(_tree_accept_greedy_op, logits, tree_tokens, tree_parents, block_size, chosen, device=logits.device)



def _check_accept_greedy(logits, tree_tokens, tree_parents, block_size, backend):
    _validate_accept("tree_accept_greedy", logits, tree_tokens, tree_parents, block_size)


@torch.library.custom_op("dflash::tree_accept_greedy", mutates_args=())
@checked_by(_check_accept_greedy)
def _tree_accept_greedy_op(logits: torch.Tensor, tree_tokens: torch.Tensor, tree_parents: torch.Tensor,
                           block_size: int, backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``torch.ops.dflash.tree_accept_greedy``: :func:`tree_accept_greedy` after validation."""
    chosen = resolve_backend("tree_accept_greedy", backend, logits.device, available=_BACKENDS)
    body = registered("tree_accept_greedy", chosen)
    if body is not None:
        return body(logits, tree_tokens, tree_parents, block_size)
    if chosen == "torch":
        return tree_accept_greedy_reference(logits, tree_tokens, tree_parents, block_size=block_size)
    return _tree_accept_greedy_triton(logits, tree_tokens, tree_parents, block_size)


def tree_accept_greedy_tokens_reference(target_tokens, tree_tokens, tree_parents, *, block_size: int):
    """Definition: the walk (:func:`_walk_reference`) choosing ``target_tokens[r, node]`` at each node."""
    return _walk_reference(lambda req, node: int(target_tokens[req, node]), tree_tokens, tree_parents, block_size)


def tree_accept_greedy_tokens(target_tokens: torch.Tensor, tree_tokens: torch.Tensor, tree_parents: torch.Tensor, *,
                              block_size: int, backend: str = "auto"
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`tree_accept_greedy` given the target's argmax token at each node instead of its logits (one launch,
    no host sync): for a verify whose LM head returns the argmax itself (``dflash_kernels.cpu.linear.linear_argmax`` on
    the CPU), so the logits are never written.

    Args:
        target_tokens: ``[R, T]`` int64 (int32 accepted), values in ``[0, 2**31 - 1)``: ``argmax(logits[r, i])``
            of :func:`tree_accept_greedy`.
        tree_tokens, tree_parents, block_size: as :func:`tree_accept_greedy`.
        backend: ``"auto" | "triton" | "cpu" | "torch"``.

    Returns:
        ``(path [R, B], accepted [R], bonus [R])``: :func:`tree_accept_greedy`'s for logits with these argmaxes.
    """
    chosen = resolve_backend("tree_accept_greedy_tokens", backend, target_tokens.device, available=_BACKENDS)
    return call_op(_tree_accept_greedy_tokens_op, target_tokens, tree_tokens, tree_parents, block_size, chosen,
                   device=target_tokens.device)


def _check_accept_greedy_tokens(target_tokens, tree_tokens, tree_parents, block_size, backend):
    op = "tree_accept_greedy_tokens"
    check_tensor(op, "target_tokens", target_tokens, ndim=2, dtypes=(torch.int64, torch.int32))
    r, t = target_tokens.shape
    if t < 1:
        raise ValueError(f"{op}: target_tokens must be [R, T] with T >= 1 nodes, got {tuple(target_tokens.shape)}")
    _validate_nodes(op, "tree_tokens", tree_tokens, (r, t), target_tokens.device)
    _validate_nodes(op, "tree_parents", tree_parents, (r, t), target_tokens.device)
    _validate_block_size(op, block_size)


@torch.library.custom_op("dflash::tree_accept_greedy_tokens", mutates_args=())
@checked_by(_check_accept_greedy_tokens)
def _tree_accept_greedy_tokens_op(target_tokens: torch.Tensor, tree_tokens: torch.Tensor, tree_parents: torch.Tensor,
                                  block_size: int, backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``torch.ops.dflash.tree_accept_greedy_tokens``: :func:`tree_accept_greedy_tokens` after validation."""
    chosen = resolve_backend("tree_accept_greedy_tokens", backend, target_tokens.device, available=_BACKENDS)
    body = registered("tree_accept_greedy_tokens", chosen)
    if body is not None:
        return body(target_tokens, tree_tokens, tree_parents, block_size)
    if chosen == "torch":
        return tree_accept_greedy_tokens_reference(target_tokens, tree_tokens, tree_parents, block_size=block_size)
    rows = target_tokens.numel()  # the tokens as argmax partials of one split (a token's partial is never NaN)
    pidx = target_tokens.reshape(rows, 1).to(torch.int32)
    pval = torch.zeros((rows, 1), dtype=torch.float32, device=target_tokens.device)
    return _walk_triton(pval, pidx, 1, tree_tokens, tree_parents, block_size, False)


@_tree_accept_greedy_tokens_op.register_fake
def _tree_accept_greedy_tokens_fake(target_tokens, tree_tokens, tree_parents, block_size, backend):
    return _accept_fake(target_tokens, block_size)


def _accept_fake(logits, block_size):
    r = logits.shape[0]
    return (logits.new_empty((r, block_size), dtype=torch.int64), logits.new_empty((r,), dtype=torch.int64),
            logits.new_empty((r,), dtype=torch.int64))


@_tree_accept_greedy_op.register_fake
def _tree_accept_greedy_fake(logits, tree_tokens, tree_parents, block_size, backend):
    return _accept_fake(logits, block_size)


def tree_accept_sample_reference(logits, tree_tokens, tree_parents, *, block_size: int, temperature, top_k=0,
                                 top_p=1.0, seed=0, offset=0):
    """Definition (reads seed/offset and the parameters on the host; torch.Generator, not the kernel's stream):
    the walk (:func:`_walk_reference`) choosing, at each visited node i, a token x ~ softmax(filter(logits[:, i]
    / temperature)) (the ``verify_sample`` filter; :func:`gumbel_max`, fresh noise per node). Each visited node's
    draw is independent, so the emitted tokens follow the target's distribution exactly (the proposals are
    deterministic). Parameters: scalars or ``[R]`` tensors."""
    g = _rng_for(seed, offset, logits.device)

    def at(x, req):
        return x[req].item() if isinstance(x, torch.Tensor) else x

    def choose(req, node):
        z = filter_logits_reference(logits[req, node], at(temperature, req), int(at(top_k, req)), float(at(top_p, req)))
        return gumbel_max(z.double(), g)  # (the logits are the log-probabilities up to one constant)

    return _walk_reference(choose, tree_tokens, tree_parents, block_size)


def tree_accept_sample(logits: torch.Tensor, tree_tokens: torch.Tensor, tree_parents: torch.Tensor, *,
                       block_size: int, temperature, top_k=0, top_p=1.0, seed, offset, backend: str = "auto"
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sampled acceptance walk (temperature > 0), exactly lossless for the deterministic tree proposals.

    At the current node draw x from the target's filtered distribution there (``verify_sample``'s filter:
    ``logits / temperature``, top-k, then top-p); if x is a child's token descend to it, else x is the bonus.

    Args:
        logits, tree_tokens, tree_parents, block_size: as :func:`tree_accept_greedy`.
        temperature, top_k, top_p, seed, offset: as :func:`dflash_kernels.verify_sample` (scalars or ``[R]``
            device tensors; seed/offset ints or 1-element device tensors).
        backend: ``"auto" | "triton" | "torch"``.

    Returns:
        ``(path [R, B], accepted [R], bonus [R])`` int64, as :func:`tree_accept_greedy`.
    """
    op = "tree_accept_sample"
    _validate_accept(op, logits, tree_tokens, tree_parents, block_size)  # before sampling_op_args reads logits
    args = sampling_op_args(op, logits, temperature, top_k, top_p, seed, offset)
    chosen = resolve_backend(op, backend, logits.device, available=_BACKENDS)
    return call_op(_tree_accept_sample_op, logits, tree_tokens, tree_parents, block_size, *args, chosen, device=logits.device)


def _check_accept_sample(logits, tree_tokens, tree_parents, block_size, temperature, top_k, top_p, seed, offset,
                         use_top_k, use_top_p, backend):
    op = "tree_accept_sample"
    _validate_accept(op, logits, tree_tokens, tree_parents, block_size)
    check_packed_sampling(op, logits.shape[0], temperature, top_k, top_p, seed, offset, logits.device)


@torch.library.custom_op("dflash::tree_accept_sample", mutates_args=())
@checked_by(_check_accept_sample)
def _tree_accept_sample_op(logits: torch.Tensor, tree_tokens: torch.Tensor, tree_parents: torch.Tensor,
                           block_size: int, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                           seed: torch.Tensor, offset: torch.Tensor, use_top_k: bool, use_top_p: bool,
                           backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``torch.ops.dflash.tree_accept_sample``: :func:`tree_accept_sample` after validation (parameters as
    ``torch.ops.dflash.verify_sample`` takes them)."""
    chosen = resolve_backend("tree_accept_sample", backend, logits.device, available=_BACKENDS)
    if chosen == "triton":
        return _tree_accept_sample_triton(logits, tree_tokens, tree_parents, block_size, temperature.to(torch.float32),
                                          top_k.to(torch.int32), top_p.to(torch.float32),
                                          seed.reshape(1).to(torch.int64), offset.reshape(1).to(torch.int64),
                                          use_top_k, use_top_p)
    if temperature.numel() == 1:
        temperature, top_k, top_p = temperature.item(), int(top_k.item()), top_p.item()
    return tree_accept_sample_reference(logits, tree_tokens, tree_parents, block_size=block_size,
                                        temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, offset=offset)


@_tree_accept_sample_op.register_fake
def _tree_accept_sample_fake(logits, tree_tokens, tree_parents, block_size, temperature, top_k, top_p, seed, offset,
                             use_top_k, use_top_p, backend):
    return _accept_fake(logits, block_size)


# --------------------------------------------------------------------------------------------------
# tree_compact
# --------------------------------------------------------------------------------------------------

def _validate_compact(op, k_cache, v_cache, path, accepted, start, cache_batch_idx):
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(op, name, c, ndim=5, dtypes=FLOAT_DTYPES)
        if not c.is_contiguous():
            raise ValueError(f"{op}: {name} must be a contiguous stacked cache [L, N_cap, max_len, kvH, D]; pass "
                             f"{name}.contiguous() (paged caches are not supported)")
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype or k_cache.device != v_cache.device:
        raise ValueError(f"{op}: k_cache {tuple(k_cache.shape)}/{k_cache.dtype} and v_cache "
                         f"{tuple(v_cache.shape)}/{v_cache.dtype} must have the same shape, dtype and device")
    dev = k_cache.device
    check_tensor(op, "path", path, ndim=2, dtypes=_INDEX_DTYPES, device=dev)
    check_last_dim_contiguous(op, "path", path)
    r = path.shape[0]
    if path.shape[1] < 1:
        raise ValueError(f"{op}: path must be [R, B] with B >= 1 (the walk's output), got {tuple(path.shape)}")
    for name, t in (("accepted", accepted), ("start", start)):
        check_tensor(op, name, t, ndim=1, dtypes=_INDEX_DTYPES, device=dev)
        check_last_dim_contiguous(op, name, t)
        if t.shape[0] != r:
            raise ValueError(f"{op}: {name} must be [R={r}] like path's first dim, got {tuple(t.shape)}")
    if cache_batch_idx is None:
        if r > k_cache.shape[1]:
            raise ValueError(f"{op}: {r} requests but the cache has {k_cache.shape[1]} batch rows; pass "
                             f"cache_batch_idx [R]")
    else:
        check_tensor(op, "cache_batch_idx", cache_batch_idx, ndim=1, dtypes=(torch.int32, torch.int64), device=dev)
        check_last_dim_contiguous(op, "cache_batch_idx", cache_batch_idx)
        if cache_batch_idx.shape[0] != r:
            raise ValueError(f"{op}: cache_batch_idx must be [R={r}], got {tuple(cache_batch_idx.shape)}")


def tree_compact_reference(k_cache, v_cache, path, accepted, start, *, cache_batch_idx=None) -> None:
    """Definition (host indexing): for every layer and request r, cache row ``start[r] + path[r, d]`` is copied
    to row ``start[r] + d`` for ``d <= accepted[r]`` (all sources read before any write; sources at or past
    the capacity are skipped: the verify step never wrote them)."""
    cap = k_cache.shape[2]
    for req, (a, s) in enumerate(zip(accepted.tolist(), start.tolist())):
        b = int(cache_batch_idx[req]) if cache_batch_idx is not None else req
        src = s + path[req, : a + 1].to(torch.int64)
        dst = s + torch.arange(a + 1, device=path.device)
        keep = (src < cap) & (src != dst)
        src, dst = src[keep], dst[keep]
        for cache in (k_cache, v_cache):
            cache[:, b, dst] = cache[:, b, src].clone()


@triton.jit
def _tree_compact_kernel(k_ptr, v_ptr, path_ptr, acc_ptr, start_ptr, bidx_ptr, KVH, D, CAP, BSZ,
                         stride_l, stride_b, stride_pr, HAS_BATCH_IDX: tl.constexpr, BLOCK_B: tl.constexpr,
                         BLOCK_D: tl.constexpr):
    """Per (request, layer x KV head): load the path's rows d <= accepted that move (path[d] != d, source below
    the capacity), then, after a barrier (a destination row can be another depth's source), store them."""
    r = tl.program_id(0).to(tl.int64)
    lh = tl.program_id(1).to(tl.int64)
    layer = lh // KVH
    h = lh % KVH
    if HAS_BATCH_IDX:
        b = tl.load(bidx_ptr + r).to(tl.int64)
    else:
        b = r
    a = tl.load(acc_ptr + r)
    start = tl.load(start_ptr + r)
    d = tl.arange(0, BLOCK_B)
    src = tl.load(path_ptr + r * stride_pr + d, mask=(d < BSZ) & (d <= a), other=0)
    move = (d < BSZ) & (d <= a) & (src != d) & (start + src < CAP)
    e = tl.arange(0, BLOCK_D)
    mask = move[:, None] & (e < D)[None, :]
    base = layer * stride_l + b * stride_b
    src_off = base + ((start + src) * KVH + h)[:, None] * D + e[None, :]
    dst_off = base + ((start + d) * KVH + h)[:, None] * D + e[None, :]
    kv_k = tl.load(k_ptr + src_off, mask=mask)
    kv_v = tl.load(v_ptr + src_off, mask=mask)
    tl.debug_barrier()
    tl.store(k_ptr + dst_off, kv_k, mask=mask)
    tl.store(v_ptr + dst_off, kv_v, mask=mask)


def tree_compact(k_cache: torch.Tensor, v_cache: torch.Tensor, path: torch.Tensor, accepted: torch.Tensor,
                 start: torch.Tensor, *, cache_batch_idx: Optional[torch.Tensor] = None, backend: str = "auto") -> None:
    """Move each request's accepted tree path to consecutive cache rows, in every target layer, in place.

    The verify pass wrote node i's K/V at cache row ``start[r] + i``; the accepted path's node at depth d must
    sit at row ``start[r] + d`` for the next rounds. Rows ``d <= accepted[r]`` are moved (``path[r, d] >= d``);
    the rest stay as they are (scratch past the new length). The tapped feature rows of the path for the
    draft's next context are the runtime's one ``torch.gather``:
    ``features.gather(1, path.clamp_min(0)[..., None].expand(-1, -1, F))`` (features ``[R, T, F]``).

    Args:
        k_cache, v_cache: contiguous stacked caches ``[L, N_cap, max_len, kvH, D]`` of one dtype.
        path, accepted: the walk's ``[R, B]`` and ``[R]`` int64 (:func:`tree_accept_greedy`).
        start: ``[R]`` int64: the cache length before the verify step (node i was written at row start + i).
        cache_batch_idx: ``[R]`` int32/int64: request r uses batch row ``cache_batch_idx[r]`` (default r).
        backend: ``"auto" | "triton" | "cpu" | "torch"`` (``"cpu"``: the moves by ``memcpy`` in C for a walk's
            path on contiguous caches, else the reference).
    """
    chosen = resolve_backend("tree_compact", backend, k_cache.device, available=_BACKENDS)
    call_op(_tree_compact_op, k_cache, v_cache, path, accepted, start, cache_batch_idx, chosen, device=k_cache.device)



def _check_compact(k_cache, v_cache, path, accepted, start, cache_batch_idx, backend):
    op = "tree_compact"
    _validate_compact(op, k_cache, v_cache, path, accepted, start, cache_batch_idx)
    if k_cache.device.type == "cpu":  # the moves' rows are addresses (see check_index_values)
        rows = cache_batch_idx.tolist() if cache_batch_idx is not None else list(range(path.shape[0]))
        error = cpu_native.compact_index_error(path.tolist(), accepted.tolist(), start.tolist(), rows,
                                               k_cache.shape[1])
        if error:
            raise ValueError(f"{op}: {error}")


@torch.library.custom_op("dflash::tree_compact", mutates_args=("k_cache", "v_cache"))
@checked_by(_check_compact)
def _tree_compact_op(k_cache: torch.Tensor, v_cache: torch.Tensor, path: torch.Tensor, accepted: torch.Tensor,
                     start: torch.Tensor, cache_batch_idx: Optional[torch.Tensor], backend: str) -> None:
    """``torch.ops.dflash.tree_compact``: :func:`tree_compact` after validation (writes k_cache, v_cache)."""
    chosen = resolve_backend("tree_compact", backend, k_cache.device, available=_BACKENDS)
    body = registered("tree_compact", chosen)
    if body is not None:
        body(k_cache, v_cache, path, accepted, start, cache_batch_idx)
        return
    if chosen == "torch":
        tree_compact_reference(k_cache, v_cache, path, accepted, start, cache_batch_idx=cache_batch_idx)
        return
    layers, _, rows, kvh, d = k_cache.shape
    r, bsz = path.shape
    if r == 0 or layers == 0:
        return
    _tree_compact_kernel[(r, layers * kvh)](
        k_ptr=k_cache, v_ptr=v_cache, path_ptr=path, acc_ptr=accepted, start_ptr=start,
        bidx_ptr=cache_batch_idx if cache_batch_idx is not None else start, KVH=kvh, D=d, CAP=rows,
        BSZ=bsz, stride_l=k_cache.stride(0), stride_b=k_cache.stride(1), stride_pr=path.stride(0),
        HAS_BATCH_IDX=cache_batch_idx is not None, BLOCK_B=next_pow2(bsz), BLOCK_D=next_pow2(d),
    )


@_tree_compact_op.register_fake
def _tree_compact_fake(k_cache, v_cache, path, accepted, start, cache_batch_idx, backend):
    return None


# --------------------------------------------------------------------------------------------------
# tree_graft_lookup
# --------------------------------------------------------------------------------------------------

def lookup_continuation(seq: list[int], max_ngram: int, min_ngram: int, limit: int) -> list[int]:
    """Prompt lookup over one committed sequence (its last entry the tree's root): for n = ``max_ngram`` down to
    ``min_ngram``, the latest earlier occurrence of the sequence's last n tokens that a token follows; the first n
    with one gives the up to ``limit`` tokens after it. Empty when no suffix recurs (or ``limit`` is 0)."""
    end = len(seq)
    for n in range(max_ngram, min_ngram - 1, -1):
        suffix = seq[end - n:]
        for s in range(end - n - 1, -1, -1):
            if seq[s:s + n] == suffix:
                return seq[s + n:s + n + limit]
    return []


def _validate_graft(op, tree_tokens, tree_parents, tree_depths, tokens, lengths, depth, max_ngram, min_ngram):
    _validate_nodes(op, "tree_tokens", tree_tokens)
    dev = tree_tokens.device
    _validate_nodes(op, "tree_parents", tree_parents, tree_tokens.shape, dev)
    _validate_nodes(op, "tree_depths", tree_depths, tree_tokens.shape, dev)
    r = tree_tokens.shape[0]
    check_tensor(op, "tokens", tokens, ndim=2, dtypes=_INDEX_DTYPES, device=dev)
    check_last_dim_contiguous(op, "tokens", tokens)
    check_tensor(op, "lengths", lengths, ndim=1, dtypes=_INDEX_DTYPES, device=dev)
    if tokens.shape[0] != r or lengths.shape[0] != r:
        raise ValueError(f"{op}: tokens must be [R={r}, C] (each request's committed tokens, the root last) and "
                         f"lengths [R={r}], got {tuple(tokens.shape)} and {tuple(lengths.shape)}")
    for name, value, low in (("depth", depth, 0), ("min_ngram", min_ngram, 1), ("max_ngram", max_ngram, min_ngram)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{op}: {name} must be an int >= {low}, got {value!r}"
                             + (" (max_ngram >= min_ngram)" if name == "max_ngram" else ""))
    if max_ngram > MAX_LOOKUP_NGRAM:
        raise ValueError(f"{op}: max_ngram must be <= {MAX_LOOKUP_NGRAM} (the suffix lengths a kernel unrolls), got "
                         f"{max_ngram}")


MAX_LOOKUP_NGRAM = 8


def tree_graft_lookup_reference(tree_tokens, tree_parents, tree_depths, tokens, lengths, *, depth: int,
                                max_ngram: int, min_ngram: int):
    """Definition (host lists). Per request: ``cont`` = :func:`lookup_continuation` of ``tokens[r, :L]`` (L =
    ``lengths[r]`` clamped to [0, C]) with ``limit = min(depth, T - 1)``, k = len(cont). ``a_j`` is the first node
    (in node order) whose parent is ``a_{j-1}`` (``a_-1`` = the root, node 0) and whose token is ``cont[j]``, while
    one exists. With d(m) the leading a_j below ``T - m``, m is the least with ``k - d(m) <= m`` (then exactly
    equal): the tree keeps its first T - m nodes and its last m become ``cont[d:]``, a chain below ``a_{d-1}``. So
    the tree holds the whole continuation as a path, gives up only its last-selected nodes, and keeps its siblings
    distinct."""
    out = [t.cpu().clone() for t in (tree_tokens, tree_parents, tree_depths)]
    tok, par, dep = (t.tolist() for t in out)
    r, t = tree_tokens.shape
    c = tokens.shape[1]
    limit = min(depth, t - 1)
    for req, length in enumerate(lengths.tolist()):
        seq = tokens[req, :min(max(length, 0), c)].tolist()
        cont = lookup_continuation(seq, max_ngram, min_ngram, limit)
        k = len(cont)
        chain, node = [], 0
        for token in cont:
            kids = [i for i in range(1, t) if par[req][i] == node and tok[req][i] == token]
            if not kids:
                break
            node = kids[0]
            chain.append(node)

        def shared(m):
            return next((j for j, a in enumerate(chain) if a >= t - m), len(chain))

        m = next(m for m in range(k + 1) if k - shared(m) <= m)
        d = k - m
        parent = chain[d - 1] if d else 0
        for q in range(m):
            i = t - m + q
            tok[req][i], par[req][i], dep[req][i] = cont[d + q], parent, d + q + 1
            parent = i
    dev = tree_tokens.device
    return tuple(torch.tensor(x, dtype=torch.int64).view(r, t).to(dev) for x in (tok, par, dep))


@triton.jit
def _graft_lookup_kernel(tok_ptr, par_ptr, dep_ptr, seq_ptr, len_ptr, otok_ptr, opar_ptr, odep_ptr, T, C, LIMIT,
                         stride_tok, stride_par, stride_dep, stride_seq, MAX_N: tl.constexpr, MIN_N: tl.constexpr,
                         BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr):
    """Per request: every suffix length's latest recurrence in BLOCK_C-wide sweeps, the longest that recurs; then
    the continuation's walk down the tree (one masked vector pass a depth), the least m, and the rewritten tail."""
    r = tl.program_id(0).to(tl.int64)
    length = tl.minimum(tl.maximum(tl.load(len_ptr + r), 0), C)
    row = seq_ptr + r * stride_seq
    found_n = length * 0
    found_s = length * 0 - 1
    for n in tl.static_range(MIN_N, MAX_N + 1):                # shortest first: a longer suffix that recurs wins
        latest = length * 0 - 1
        if length >= n + 1:
            for start in range(0, length - n, BLOCK_C):
                s = start + tl.arange(0, BLOCK_C)
                hit = s < length - n
                for j in tl.static_range(n):
                    x = tl.load(row + s + j, mask=hit, other=0)
                    y = tl.load(row + length - n + j)
                    hit = hit & (x == y)
                latest = tl.maximum(latest, tl.max(tl.where(hit, s, -1), axis=0))
        take = latest >= 0
        found_n = tl.where(take, n, found_n)
        found_s = tl.where(take, latest, found_s)
    first = found_s + found_n                                   # the continuation's first index in the row
    k = tl.where(found_s >= 0, tl.minimum(LIMIT, length - first), 0)
    i = tl.arange(0, BLOCK_T).to(tl.int64)
    i_ok = i < T
    tok = tl.load(tok_ptr + r * stride_tok + i, mask=i_ok, other=0)
    par = tl.load(par_ptr + r * stride_par + i, mask=i_ok, other=0)
    dep = tl.load(dep_ptr + r * stride_dep + i, mask=i_ok, other=0)
    m = tl.arange(0, BLOCK_K)                                   # candidate m = 0..k (BLOCK_K > LIMIT)
    alive = m <= k
    shared = tl.zeros((BLOCK_K,), tl.int64)
    chain = tl.zeros((BLOCK_K,), tl.int64)                      # chain[j] = a_j (T + 1 once the walk stops)
    cur = length * 0
    for j in range(0, k):
        want = tl.load(row + first + j)
        kid = tl.min(tl.where(i_ok & (i >= 1) & (par == cur) & (tok == want), i, T + 1), axis=0)
        cur = tl.where(cur <= T, kid, T + 1)
        alive = alive & (cur < T - m)
        shared += alive.to(tl.int64)
        chain = tl.where(m == j, cur, chain)
    cut = tl.min(tl.where((m <= k) & (k - shared <= m), m, BLOCK_K), axis=0)
    d = k - cut
    root_of = tl.sum(tl.where(m == d - 1, chain, 0), axis=0)    # a_{d-1}, or 0 when d = 0
    q = i - (T - cut)
    new = i_ok & (q >= 0)
    new_tok = tl.load(row + first + d + q, mask=new, other=0)
    tok = tl.where(new, new_tok, tok)
    par = tl.where(new, tl.where(q == 0, root_of, i - 1), par)
    dep = tl.where(new, d + q + 1, dep)
    base = r * T + i
    tl.store(otok_ptr + base, tok, mask=i_ok)
    tl.store(opar_ptr + base, par, mask=i_ok)
    tl.store(odep_ptr + base, dep, mask=i_ok)


def tree_graft_lookup(tree_tokens: torch.Tensor, tree_parents: torch.Tensor, tree_depths: torch.Tensor,
                      tokens: torch.Tensor, lengths: torch.Tensor, *, depth: int, max_ngram: int = 4,
                      min_ngram: int = 1, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Put a prompt-lookup continuation into each draft tree as a path, in place of its last-selected nodes.

    The request's own text often repeats (a rewrite, a list, a loop of a small model): the tokens that followed
    the latest earlier occurrence of its last n tokens (n = ``max_ngram`` .. ``min_ngram``, the longest that
    recurs) are a cheap proposal the draft may not rank. The tree keeps its T nodes (the verify step's shape)
    and gives up its last-selected ones, as few as the continuation's new nodes; a continuation the tree already
    holds costs nothing. Verification stays lossless: the acceptance walks accept any deterministic tree.

    Args:
        tree_tokens, tree_parents, tree_depths: ``[R, T]`` int64 trees (:func:`build_tree`'s; siblings distinct).
        tokens: ``[R, C]`` int64, each request's committed tokens, the tree's root last (the engine's output rows).
        lengths: ``[R]`` int64, the committed count of each row (clamped to [0, C]).
        depth: the longest continuation (<= the acceptance walk's ``block_size - 1``; at most T - 1 are used).
        max_ngram, min_ngram: the suffix lengths tried, longest first (1 <= min_ngram <= max_ngram <= 8).
        backend: ``"auto" | "triton" | "cpu" | "torch"``.

    Returns:
        ``(tree_tokens, tree_parents, tree_depths)``, new ``[R, T]`` int64 tensors: the first T - m nodes as given,
        then the continuation's m new nodes. Definition: :func:`tree_graft_lookup_reference`.
    """
    chosen = resolve_backend("tree_graft_lookup", backend, tree_tokens.device, available=_BACKENDS)
    return call_op(_tree_graft_lookup_op, tree_tokens, tree_parents, tree_depths, tokens, lengths, depth, max_ngram,
                   min_ngram, chosen, device=tree_tokens.device)


def _check_graft(tree_tokens, tree_parents, tree_depths, tokens, lengths, depth, max_ngram, min_ngram, backend):
    op = "tree_graft_lookup"
    _validate_graft(op, tree_tokens, tree_parents, tree_depths, tokens, lengths, depth, max_ngram, min_ngram)
    if lengths.device.type == "cpu" and lengths.numel():  # (device kernels clamp them instead)
        c = tokens.shape[1]
        low, high = int(lengths.min()), int(lengths.max())
        if low < 0 or high > c:
            raise ValueError(f"{op}: lengths must lie in [0, C={c}] (each row's committed tokens), got values in "
                             f"[{low}, {high}]")


@torch.library.custom_op("dflash::tree_graft_lookup", mutates_args=())
@checked_by(_check_graft)
def _tree_graft_lookup_op(tree_tokens: torch.Tensor, tree_parents: torch.Tensor, tree_depths: torch.Tensor,
                          tokens: torch.Tensor, lengths: torch.Tensor, depth: int, max_ngram: int, min_ngram: int,
                          backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``torch.ops.dflash.tree_graft_lookup``: :func:`tree_graft_lookup` after validation."""
    chosen = resolve_backend("tree_graft_lookup", backend, tree_tokens.device, available=_BACKENDS)
    body = registered("tree_graft_lookup", chosen)
    if body is not None:
        return body(tree_tokens, tree_parents, tree_depths, tokens, lengths, depth, max_ngram, min_ngram)
    if chosen == "torch":
        return tree_graft_lookup_reference(tree_tokens, tree_parents, tree_depths, tokens, lengths, depth=depth,
                                           max_ngram=max_ngram, min_ngram=min_ngram)
    r, t = tree_tokens.shape
    out = tuple(torch.empty((r, t), dtype=torch.int64, device=tree_tokens.device) for _ in range(3))
    if r:
        limit = min(depth, t - 1)
        _graft_lookup_kernel[(r,)](
            tok_ptr=tree_tokens, par_ptr=tree_parents, dep_ptr=tree_depths, seq_ptr=tokens, len_ptr=lengths,
            otok_ptr=out[0], opar_ptr=out[1], odep_ptr=out[2], T=t, C=tokens.shape[1], LIMIT=limit,
            stride_tok=tree_tokens.stride(0), stride_par=tree_parents.stride(0), stride_dep=tree_depths.stride(0),
            stride_seq=tokens.stride(0), MAX_N=max_ngram, MIN_N=min_ngram, BLOCK_C=128, BLOCK_T=next_pow2(t),
            BLOCK_K=next_pow2(limit + 1))
    return out


@_tree_graft_lookup_op.register_fake
def _tree_graft_lookup_fake(tree_tokens, tree_parents, tree_depths, tokens, lengths, depth, max_ngram, min_ngram,
                            backend):
    return tuple(torch.empty_like(tree_tokens) for _ in range(3))

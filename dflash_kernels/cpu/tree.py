"""The CPU bodies of the tree ops: ``build_tree``, ``tree_ancestor_mask``, the greedy walk on argmax tokens and
``tree_compact`` in C where the native library applies (else their references), ``tree_accept_greedy``'s argmax
by NumPy, ``tree_accept_sample``'s draws over the filter's kept tokens only."""
from __future__ import annotations

import torch

from dflash_kernels._dispatch import register
from dflash_kernels.cpu import native as cpu_native
from dflash_kernels.cpu.argmax import argmax_cpu
from dflash_kernels.tree import (
    _walk_reference, build_tree_reference, draft_log_normalizer, gumbel_draw, mask_words, sampled_walk,
    tree_accept_greedy_tokens_reference, tree_ancestor_mask_reference, tree_compact_reference, walk_parameters,
)


@register("build_tree", "cpu")
def build_tree_cpu(draft_logits, anchor, budget, vocab_ids):
    """``build_tree`` on CPU tensors: the native trees where they apply, else the reference."""
    trees = cpu_native.build_tree(draft_logits, draft_log_normalizer(draft_logits), anchor, budget, vocab_ids)
    if trees is not None:
        return trees
    return build_tree_reference(draft_logits, anchor, budget, vocab_ids=vocab_ids)


@register("tree_ancestor_mask", "cpu")
def tree_ancestor_mask_cpu(tree_parents):
    """``tree_ancestor_mask`` on CPU tensors: the native mask where the library is built, else the reference."""
    mask = cpu_native.tree_ancestor_mask(tree_parents, mask_words(tree_parents.shape[1]))
    if mask is not None:
        return mask
    return tree_ancestor_mask_reference(tree_parents)


@register("tree_accept_greedy", "cpu")
def tree_accept_greedy_cpu(logits, tree_tokens, tree_parents, block_size):
    """``tree_accept_greedy`` on CPU tensors: the reference's walk, each node's argmax by :func:`argmax_cpu`."""
    return _walk_reference(lambda req, node: int(argmax_cpu(logits[req, node])), tree_tokens, tree_parents,
                           block_size)


@register("tree_accept_sample", "cpu")
def tree_accept_sample_cpu(logits, tree_tokens, tree_parents, block_size, temperature, top_k, top_p, seed, offset,
                           use_top_k, use_top_p):
    """``tree_accept_sample`` on CPU tensors: the reference's walk and filter, each node's Gumbel-max over the
    tokens the filter keeps (:func:`kept_gumbel_draw`)."""
    temperature, top_k, top_p = walk_parameters(temperature, top_k, top_p)
    return sampled_walk(logits, tree_tokens, tree_parents, block_size, temperature, top_k, top_p, seed, offset,
                        kept_gumbel_draw)


def kept_gumbel_draw(z, g) -> int:
    """:func:`gumbel_draw` over the entries of ``z`` other than -inf alone: the same distribution (the others have
    probability 0), another random stream, and noise for a top-p nucleus (~256 tokens at most, usually) rather
    than the vocabulary. Where a kept logit is NaN or +inf, or none is kept (all -inf), the whole vocabulary's rule
    decides."""
    kept = (z != float("-inf")).nonzero().squeeze(1)  # (NaN kept: it sends the draw to the whole rule)
    zk = z[kept]
    if not kept.numel() or not bool(torch.isfinite(zk).all()):
        return gumbel_draw(z, g)
    return int(kept[gumbel_draw(zk, g)])


@register("tree_accept_greedy_tokens", "cpu")
def tree_accept_greedy_tokens_cpu(target_tokens, tree_tokens, tree_parents, block_size):
    """``tree_accept_greedy_tokens`` on CPU tensors: the native walk where it applies, else the reference."""
    walked = cpu_native.tree_walk_tokens(target_tokens, tree_tokens, tree_parents, block_size)
    if walked is not None:
        return walked
    return tree_accept_greedy_tokens_reference(target_tokens, tree_tokens, tree_parents, block_size=block_size)


@register("tree_compact", "cpu")
def tree_compact_cpu(k_cache, v_cache, path, accepted, start, cache_batch_idx) -> None:
    """``tree_compact`` on CPU tensors: the moves by ``memcpy`` where they apply, else the reference."""
    if not cpu_native.tree_compact(k_cache, v_cache, path, accepted, start, cache_batch_idx):
        tree_compact_reference(k_cache, v_cache, path, accepted, start, cache_batch_idx=cache_batch_idx)

"""The CPU bodies of the tree ops: ``build_tree``, ``tree_ancestor_mask``, the greedy walk on argmax tokens,
``tree_graft_lookup`` and ``tree_compact`` in C where the native library applies (else their references),
``tree_accept_greedy``'s argmax by NumPy."""
from __future__ import annotations

from dflash_kernels._dispatch import register
from dflash_kernels.cpu import native as cpu_native
from dflash_kernels.cpu.argmax import argmax_cpu
from dflash_kernels.tree import (
    _walk_reference, build_tree_reference, draft_log_normalizer, mask_words, tree_accept_greedy_tokens_reference,
    tree_ancestor_mask_reference, tree_compact_reference, tree_graft_lookup_reference,
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


@register("tree_accept_greedy_tokens", "cpu")
def tree_accept_greedy_tokens_cpu(target_tokens, tree_tokens, tree_parents, block_size):
    """``tree_accept_greedy_tokens`` on CPU tensors: the native walk where it applies, else the reference."""
    walked = cpu_native.tree_walk_tokens(target_tokens, tree_tokens, tree_parents, block_size)
    if walked is not None:
        return walked
    return tree_accept_greedy_tokens_reference(target_tokens, tree_tokens, tree_parents, block_size=block_size)


@register("tree_graft_lookup", "cpu")
def tree_graft_lookup_cpu(tree_tokens, tree_parents, tree_depths, tokens, lengths, depth, max_ngram, min_ngram):
    """``tree_graft_lookup`` on CPU tensors: the native graft where the library is built, else the reference."""
    grafted = cpu_native.tree_graft_lookup(tree_tokens, tree_parents, tree_depths, tokens, lengths,
                                           min(depth, tree_tokens.shape[1] - 1), max_ngram, min_ngram)
    if grafted is not None:
        return grafted
    return tree_graft_lookup_reference(tree_tokens, tree_parents, tree_depths, tokens, lengths, depth=depth,
                                       max_ngram=max_ngram, min_ngram=min_ngram)


@register("tree_compact", "cpu")
def tree_compact_cpu(k_cache, v_cache, path, accepted, start, cache_batch_idx) -> None:
    """``tree_compact`` on CPU tensors: the moves by ``memcpy`` where they apply, else the reference."""
    if not cpu_native.tree_compact(k_cache, v_cache, path, accepted, start, cache_batch_idx):
        tree_compact_reference(k_cache, v_cache, path, accepted, start, cache_batch_idx=cache_batch_idx)

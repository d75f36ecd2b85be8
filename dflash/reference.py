"""Reference decode loop: the official z-lab semantics in plain PyTorch, one request.

Every faster path in this project is checked token for token (and round for round) against this
loop. Per round (block size B, ``start`` = position of the anchor, the last committed token):

1. the draft sees the new context rows (target features of the tokens committed since its last
   call) and the block ``[anchor, MASK × (v-1)]`` at positions ``start … start+v-1``, where
   ``v = min(B, max_length - start)``; its argmax at rows 1..v-1 are the proposals (``draft.propose``:
   target ids, also for a draft vocabulary subset);
2. the target scores the block in one forward pass (HF forward, ``DynamicCache``);
3. acceptance and bookkeeping are the kernel library's definitions, run as PyTorch references:
   ``verify_greedy`` / ``verify_sample`` (longest agreeing prefix + the target's next token; the
   lossless one-hot rule when sampling) and ``commit_round`` (stop tokens, length limit);
4. the target cache is cropped to the committed tokens, the draft cache holds context rows only,
   and the features of the committed rows become the next round's new context.

DFlash2 drafts change step 1 and, when sampling, step 3: the proposals are the candidate selector's walk from
the anchor (greedy: ``draft.select_block``, the official module's argmax walk; sampling: ``candidate_select``'s
reference, a sample from softmax(score / T) over each position's top-k candidates keyed by (seed, round), as the
engine draws it), and sampled verification is rejection sampling over that sparse draft distribution
(``verify_sample`` with ``draft_probs`` / ``draft_indices``, z-lab's ``_rejection_sample``).

Tree rounds (``tree_budget=N``, DDTree) change steps 1-4 only where the block becomes a tree:

1. the draft pass is the same; ``draft.block_logits`` (all v-1 rows, not their argmax) and the anchor
   go to ``build_tree``: the root plus the N best continuations of depth <= v-1 (fewer when v-1
   positions allow fewer distinct sequences; the root alone when v = 1); with ``lookup_depth``,
   ``tree_graft_lookup`` then puts the prompt-lookup continuation (up to min(lookup_depth, v-1) tokens) in as a
   path, in place of the tree's last-selected nodes;
2. the target scores every node in one forward: node i at position ``start + depth[i]``, attending to
   the cached rows and to its ancestors and itself only (a 4-D attention mask);
3. ``tree_accept_greedy`` / ``tree_accept_sample`` walk the tree (the child equal to the target's token
   while one exists) -> the accepted path and the bonus; ``commit_round`` gets the path's tokens;
4. the target cache keeps exactly the committed path's K/V rows, now at consecutive positions, and the
   path's features become the next round's new context.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from dflash.draft import DraftKVCache, DraftModel
from dflash.results import GenerateResult, device_clock
from dflash.sampling import SamplingParams, sample
from dflash.target import TargetAdapter
from dflash_kernels import (
    build_tree, candidate_select, commit_round, distinct_prefixes, first_token_done, tree_accept_greedy,
    tree_accept_sample, tree_graft_lookup, verify_greedy, verify_sample,
)

MAX_TREE_BUDGET = 64  # tree nodes besides the root: the verify kernels hold up to 65 block rows
TREE_LOGIT_BOUND = 1e4  # what non-finite draft logits become before build_tree: -bound for NaN and -inf, +bound for +inf


def finite_tree_logits_(draft_logits: torch.Tensor) -> torch.Tensor:
    """Make the draft's block logits finite, in place, before ``build_tree`` (whose scores, log-softmax sums,
    are undefined for NaN and infinite logits): NaN and -inf become -``TREE_LOGIT_BOUND``, +inf becomes
    +``TREE_LOGIT_BOUND``. The draft only proposes tokens and the target decides, so any finite stand-in keeps
    the output the target's; a NaN draft then proposes what the chain proposes from it, a valid token."""
    return torch.nan_to_num_(draft_logits, nan=-TREE_LOGIT_BOUND, posinf=TREE_LOGIT_BOUND, neginf=-TREE_LOGIT_BOUND)


def tree_attention_mask(parents: torch.Tensor, cached: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive mask [1, 1, T, cached + T] for one tree (``parents`` [T], parents before children): node i
    sees the ``cached`` rows and the nodes on its root path, itself included."""
    T = parents.shape[0]
    sees = torch.zeros(T, T, dtype=torch.bool, device=parents.device)
    for i, p in enumerate(parents.tolist()):
        if p >= 0:
            sees[i] = sees[p]
        sees[i, i] = True
    sees = torch.cat([sees.new_ones(T, cached), sees], dim=1)
    mask = torch.zeros(sees.shape, dtype=dtype, device=parents.device)
    return mask.masked_fill_(~sees, torch.finfo(dtype).min)[None, None]


def reference_generate(target: TargetAdapter, draft: DraftModel, input_ids: torch.Tensor, max_new_tokens: int,
                       stops: list[int], sampling: SamplingParams, block_size: int, seed: int,
                       on_tokens=None, tree_budget: int | None = None,
                       lookup_depth: int | None = None) -> GenerateResult:
    """One request ``input_ids`` [1, P] (validated by :func:`dflash.generate`); ``seed`` keys every random draw;
    ``on_tokens(0, ids)`` is called with each round's committed tokens (the first token included);
    ``tree_budget``: None = chain rounds, N = tree rounds of N nodes besides the root; ``lookup_depth``: trees
    only, the prompt-lookup path grafted into each tree (``tree_graft_lookup``)."""
    from transformers import DynamicCache

    device = target.device
    generator = torch.Generator(device=device).manual_seed(seed)
    mask_id = draft.config.mask_token_id
    draft_dtype = draft.fc.weight.dtype
    use_draft = block_size > 1
    long = dict(dtype=torch.long, device=device)

    prompt_len = input_ids.shape[1]
    max_length = prompt_len + max_new_tokens
    positions = torch.arange(max_length + block_size, device=device)[None]
    target_cache = DynamicCache()
    draft_cache = DraftKVCache()

    t0 = device_clock(device)
    prefill = target.forward(input_ids, positions[:, :prompt_len], target_cache,
                             with_features=use_draft, logits_to_keep=1)
    first = int(sample(prefill.logits[0, -1], sampling.temperature, sampling.top_p, sampling.top_k, generator))
    context = prefill.features
    # commit_round's state for one request: the output buffer holds prompt + first token.
    out_tokens = torch.zeros((1, max_length), **long)
    out_tokens[0, :prompt_len] = input_ids[0]
    out_tokens[0, prompt_len] = first
    lengths = torch.tensor([prompt_len + 1], **long)
    anchor = torch.tensor([first], **long)
    position = torch.tensor([prompt_len], **long)
    max_lengths = torch.tensor([max_length], **long)
    stop_table = torch.tensor([stops], **long) if stops else None
    done = torch.tensor([first_token_done(first, stops, max_new_tokens)], device=device)
    t1 = device_clock(device)
    result = GenerateResult(sequences=out_tokens, acceptance_lengths=[], num_prompt_tokens=prompt_len,
                            prefill_time=t1 - t0)

    if on_tokens is not None:
        on_tokens(0, [first])
    start = prompt_len
    while not bool(done[0]):
        verify_len = min(block_size, max_length - start)
        block = torch.full((1, verify_len), mask_id, **long)
        block[0, 0] = anchor[0]
        draft_logits = None
        if verify_len > 1:
            ta = device_clock(device)
            cached = draft_cache.get_seq_length()
            noise = F.embedding(block, target.embed_weight).to(draft_dtype) * draft.config.input_embedding_scale
            hidden = draft(
                position_ids=positions[:, cached:start + verify_len],
                noise_embedding=noise,
                target_hidden=context.to(draft_dtype),
                past_key_values=draft_cache,
            )
            draft_cache.crop(start)
            if draft.config.dflash2 is not None and sampling.greedy:  # proposals walked by the candidate selector
                block[:, 1:] = draft.select_block(hidden, target.lm_head, anchor)[0]
            elif draft.config.dflash2 is not None:  # a sampled walk; its q over the candidates goes to verification
                selector = draft.candidate_selector
                block[:, 1:], candidates, draft_q = candidate_select(
                    draft.block_logits(hidden, target.lm_head), selector.hidden_projection(hidden[:, 1:]),
                    selector.predecessor_codebook, selector.successor_codebook, anchor, top_k=selector.top_k,
                    temperature=torch.tensor([sampling.temperature], device=device), seed=seed,
                    offset=len(result.acceptance_lengths), backend="torch")
            elif tree_budget is None:
                block[:, 1:] = draft.propose(hidden, target.lm_head)
            else:
                draft_logits = finite_tree_logits_(draft.block_logits(hidden, target.lm_head))
            result.draft_time += device_clock(device) - ta
        tv = device_clock(device)
        offset = len(result.acceptance_lengths)
        if tree_budget is None:
            verify = target.forward(block, positions[:, start:start + verify_len], target_cache,
                                    with_features=use_draft)
            proposals = block[:, 1:]
            if sampling.greedy:
                accepted, bonus = verify_greedy(verify.logits, proposals, backend="torch")
            else:  # a DFlash2 block's proposals were drawn from the selector's q over its candidates
                drawn = (dict(draft_probs=draft_q, draft_indices=candidates)
                         if draft.config.dflash2 is not None and verify_len > 1 else {})
                accepted, bonus = verify_sample(verify.logits, proposals, temperature=sampling.temperature,
                                                top_k=sampling.top_k, top_p=sampling.top_p, seed=seed,
                                                offset=offset, backend="torch", **drawn)
            path = torch.arange(verify_len, **long)[None]  # the block is the path: row d at depth d
        else:
            if draft_logits is None:  # v = 1: the tree is the root alone
                tokens, parents, depths = anchor[:, None], torch.full((1, 1), -1, **long), torch.zeros((1, 1), **long)
            else:
                budget = min(tree_budget, distinct_prefixes(verify_len - 1, draft_logits.shape[-1],
                                                             MAX_TREE_BUDGET + 1))
                tokens, parents, depths = build_tree(draft_logits, anchor, budget, vocab_ids=draft.vocab_ids,
                                                     backend="torch")
                if lookup_depth:
                    tokens, parents, depths = tree_graft_lookup(tokens, parents, depths, out_tokens, lengths,
                                                                depth=min(lookup_depth, verify_len - 1),
                                                                backend="torch")
            mask = tree_attention_mask(parents[0], start, target.embed_weight.dtype)
            verify = target.forward(tokens, start + depths, target_cache, with_features=use_draft,
                                    attention_mask=mask)
            if sampling.greedy:
                path, accepted, bonus = tree_accept_greedy(verify.logits, tokens, parents, block_size=verify_len,
                                                           backend="torch")
            else:
                path, accepted, bonus = tree_accept_sample(verify.logits, tokens, parents, block_size=verify_len,
                                                           temperature=sampling.temperature, top_k=sampling.top_k,
                                                           top_p=sampling.top_p, seed=seed, offset=offset,
                                                           backend="torch")
            proposals = tokens.gather(1, path[:, 1:].clamp(min=0))  # the path's tokens (padding beyond it)
        committed = int(commit_round(proposals, accepted, bonus, out_tokens=out_tokens, lengths=lengths,
                                     positions=position, anchor=anchor, done=done, max_lengths=max_lengths,
                                     stop_tokens=stop_table, backend="torch")[0])
        # Keep the committed rows' K/V: the anchor's and the accepted path's, now at consecutive positions
        # start .. start + committed - 1 (a chain block's rows already are).
        kept = path[0, :committed]
        if tree_budget is None:
            if verify_len > committed:
                target_cache.crop(-(verify_len - committed))
        else:
            rows = torch.cat([torch.arange(start, **long), start + kept])
            for layer in target_cache.layers:
                layer.keys, layer.values = layer.keys[:, :, rows], layer.values[:, :, rows]
        if use_draft:
            context = verify.features[:, kept]
        result.verify_time += device_clock(device) - tv
        result.acceptance_lengths.append(committed)
        if on_tokens is not None:
            on_tokens(0, out_tokens[0, start + 1:start + 1 + committed].tolist())
        start += committed

    result.sequences = out_tokens[:, :int(lengths[0])].clone()
    result.total_time = device_clock(device) - t0
    return result

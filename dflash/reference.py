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
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from dflash.draft import DraftKVCache, DraftModel
from dflash.results import GenerateResult, device_clock
from dflash.sampling import SamplingParams, sample
from dflash.target import TargetAdapter
from dflash_kernels import commit_round, verify_greedy, verify_sample


def reference_generate(target: TargetAdapter, draft: DraftModel, input_ids: torch.Tensor, max_new_tokens: int,
                       stops: list[int], sampling: SamplingParams, block_size: int, seed: int,
                       on_tokens=None) -> GenerateResult:
    """One request ``input_ids`` [1, P] (validated by :func:`dflash.generate`); ``seed`` keys every random draw;
    ``on_tokens(0, ids)`` is called with each round's committed tokens (the first token included)."""
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
    done = torch.tensor([first in stops or max_new_tokens <= 1], device=device)
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
            block[:, 1:] = draft.propose(hidden, target.lm_head)
            result.draft_time += device_clock(device) - ta
        tv = device_clock(device)
        verify = target.forward(block, positions[:, start:start + verify_len], target_cache, with_features=use_draft)
        proposals = block[:, 1:]
        if sampling.greedy:
            accepted, bonus = verify_greedy(verify.logits, proposals, backend="torch")
        else:
            accepted, bonus = verify_sample(verify.logits, proposals, temperature=sampling.temperature,
                                            top_k=sampling.top_k, top_p=sampling.top_p, seed=seed,
                                            offset=len(result.acceptance_lengths), backend="torch")
        committed = int(commit_round(proposals, accepted, bonus, out_tokens=out_tokens, lengths=lengths,
                                     positions=position, anchor=anchor, done=done, max_lengths=max_lengths,
                                     stop_tokens=stop_table, backend="torch")[0])
        # Keep the committed tokens' K/V (DynamicCache.crop(-n) drops the last n positions).
        rejected = verify_len - committed
        if rejected > 0:
            target_cache.crop(-rejected)
        if use_draft:
            context = verify.features[:, :committed]
        result.verify_time += device_clock(device) - tv
        result.acceptance_lengths.append(committed)
        if on_tokens is not None:
            on_tokens(0, out_tokens[0, start + 1:start + 1 + committed].tolist())
        start += committed

    result.sequences = out_tokens[:, :int(lengths[0])].clone()
    result.total_time = device_clock(device) - t0
    return result

"""Reference decode loop: the official z-lab semantics in plain PyTorch, batch 1.

Every faster path in this project is checked token for token against :func:`generate` with
``backend="reference"``. Per round (block size B, ``start`` = index of the last committed token):

1. the draft sees the new context rows (target features of tokens committed since its last call)
   and the block ``[anchor, MASK × (v-1)]`` at positions ``start … start+v-1``, where
   ``v = min(B, max_length - start)``; its argmax at rows 1..v-1 are the proposals;
2. the target scores the block in one forward pass; greedy keeps the longest prefix of proposals
   equal to its argmax and appends its own next token; sampling uses the lossless one-hot rule of
   :mod:`dflash.sampling`;
3. the target cache is cropped to the committed tokens, the draft cache holds context rows only,
   and the features of the anchor + accepted rows become the next round's new context.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.nn.functional as F

from dflash.model import DFlashDraftModel, DraftKVCache
from dflash.sampling import GREEDY_EPS, accept_one_hot_proposals, check_sampling_args, sampling_probs
from dflash.target import TargetAdapter, check_target

BACKENDS = ("auto", "fast", "reference")


@dataclass
class GenerateResult:
    sequences: torch.Tensor  # [1, prompt + generated] int64, like z-lab's output
    acceptance_lengths: list[int]  # tokens emitted per round, bonus included
    num_prompt_tokens: int
    prefill_time: float = 0.0
    draft_time: float = 0.0
    verify_time: float = 0.0
    total_time: float = 0.0
    extra: dict = field(default_factory=dict)

    @property
    def num_generated_tokens(self) -> int:
        return self.sequences.shape[-1] - self.num_prompt_tokens

    @property
    def tau(self) -> float:
        """Mean acceptance length (tokens per round, bonus included)."""
        return sum(self.acceptance_lengths) / max(1, len(self.acceptance_lengths))

    @property
    def decode_time(self) -> float:
        return self.total_time - self.prefill_time

    @property
    def other_time(self) -> float:
        return max(0.0, self.decode_time - self.draft_time - self.verify_time)


def _sync(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def validate_generate_args(
    target: TargetAdapter,
    draft: DFlashDraftModel,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    stop_token_ids,
    temperature: float,
    top_p: float,
    top_k: int,
    block_size: int | None,
    *,
    max_batch: int | None = 1,
) -> tuple[torch.Tensor, list[int], int]:
    """Check every argument before any work; returns (input_ids [b, P], stop ids, block size)."""
    tcfg = target.config
    if tcfg.hidden_size != draft.config.hidden_size:
        raise ValueError(
            f"draft hidden_size {draft.config.hidden_size} != target hidden_size {tcfg.hidden_size}: "
            "a DFlash draft shares the target's embedding and LM head, so the widths must match"
        )
    vocab = target.embed_weight.shape[0]
    mask_id = draft.config.mask_token_id
    if mask_id is None or not 0 <= mask_id < vocab:
        raise ValueError(
            f"draft mask_token_id {mask_id!r} is outside the target vocabulary [0, {vocab}); "
            "set dflash_config.mask_token_id to a row of the target's embedding table"
        )
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"input_ids must be a torch.LongTensor, got {type(input_ids).__name__}")
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise TypeError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, seq] or [seq], got shape {tuple(input_ids.shape)}")
    if max_batch is not None and input_ids.shape[0] > max_batch:
        raise ValueError(
            f"input_ids has batch {input_ids.shape[0]}; the reference backend runs one request at a time — "
            "pass one prompt, or use backend='fast' for batches"
        )
    if input_ids.shape[0] < 1 or input_ids.shape[1] < 1:
        raise ValueError("input_ids is empty: pass at least one prompt token")
    if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab):
        raise ValueError(f"input_ids holds token ids outside the target vocabulary [0, {vocab})")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    check_sampling_args(temperature, top_p, top_k)
    if block_size is None:
        block_size = draft.config.block_size
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
    if stop_token_ids is None:
        stops: list[int] = []
    elif isinstance(stop_token_ids, int):
        stops = [stop_token_ids]
    else:
        stops = [int(s) for s in stop_token_ids]
    return input_ids.to(target.device, torch.long), stops, block_size


def as_target(target, draft: DFlashDraftModel) -> TargetAdapter:
    if not isinstance(draft, DFlashDraftModel):
        raise TypeError(f"draft must be a dflash.DFlashDraftModel, got {type(draft).__name__}")
    if isinstance(target, TargetAdapter):
        if target.layer_ids != draft.config.target_layer_ids:
            return TargetAdapter(target.model, draft.config.target_layer_ids)
        return target
    check_target(target)
    return TargetAdapter(target, draft.config.target_layer_ids)


def fast_supported(target, draft) -> bool:
    """Whether backend='fast' can run this pair (else 'auto' uses the reference loop)."""
    from dflash.fast import unsupported_reason

    return unsupported_reason(target, draft) is None


def generate(
    target,
    draft: DFlashDraftModel,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    stop_token_ids: Sequence[int] | int | None = None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    block_size: int | None = None,
    backend: str = "auto",
    seed: int | None = None,
    **fast_options,
):
    """Speculative generation with a DFlash draft.

    Args:
        target: a Hugging Face LLaMA/Qwen3 causal LM (or a :class:`TargetAdapter`).
        draft: the :class:`DFlashDraftModel` trained for it.
        input_ids: [1, P] or [P] prompt token ids.
        max_new_tokens: tokens to generate at most (>= 1).
        stop_token_ids: generation ends after the first of these tokens (it is kept).
        temperature: 0 = greedy (output equals the target's greedy output); > 0 samples, with
            ``top_p``/``top_k`` applied to the target distribution (output distributed as the target's).
        block_size: B (default: the draft's); 1 = plain autoregressive decoding with the same machinery.
        backend: "reference" (this pure-PyTorch loop, batch 1), "fast" (static caches, kernels,
            CUDA graphs, batches: see :func:`dflash.fast.generate_fast`, which also takes
            ``attention_mask``, per-request limits and stops, ``max_length``), or "auto": fast
            where it can run (LLaMA/Qwen3 targets, supported draft layers), else reference.
        seed: makes sampling reproducible (the two backends draw different random streams).
    Returns:
        :class:`GenerateResult` with ``.sequences`` [1, P + n] and ``.acceptance_lengths``; for
        batched input (fast), a ``BatchResult`` whose fields are per-request lists.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    if not isinstance(draft, DFlashDraftModel):
        raise TypeError(f"draft must be a dflash.DFlashDraftModel, got {type(draft).__name__}")
    if backend == "auto":
        backend = "fast" if fast_supported(target, draft) else "reference"
    if backend == "fast":
        from dflash.fast import generate_fast

        return generate_fast(target, draft, input_ids, max_new_tokens, stop_token_ids, temperature, top_p, top_k,
                             block_size, seed, **fast_options)
    if fast_options:
        raise ValueError(f"options {sorted(fast_options)} need backend='fast'")
    target = as_target(target, draft)
    input_ids, stops, block_size = validate_generate_args(
        target, draft, input_ids, max_new_tokens, stop_token_ids, temperature, top_p, top_k, block_size
    )
    with torch.inference_mode():
        return _reference_generate(
            target, draft, input_ids, max_new_tokens, stops, temperature, top_p, top_k, block_size, seed
        )


def _reference_generate(target, draft, input_ids, max_new_tokens, stops, temperature, top_p, top_k, block_size, seed):
    from transformers import DynamicCache

    device = target.device
    generator = None
    if seed is not None:
        generator = torch.Generator(device=device)
        generator.manual_seed(seed)
    greedy = temperature < GREEDY_EPS
    mask_id = draft.config.mask_token_id
    draft_dtype = draft.fc.weight.dtype
    head_dtype = target.lm_head.weight.dtype
    use_draft = block_size > 1
    stop_set = set(stops)

    def choose(logits: torch.Tensor) -> int:
        if greedy:
            return int(torch.argmax(logits, dim=-1))
        probs = sampling_probs(logits, temperature, top_p, top_k)
        return int(torch.multinomial(probs, 1, generator=generator))

    prompt_len = input_ids.shape[1]
    max_length = prompt_len + max_new_tokens
    out = torch.full((1, max_length + block_size), mask_id, dtype=torch.long, device=device)
    out[:, :prompt_len] = input_ids
    positions = torch.arange(out.shape[1], device=device)[None]
    target_cache = DynamicCache()
    draft_cache = DraftKVCache()

    t0 = _sync(device)
    prefill = target.forward(input_ids, positions[:, :prompt_len], target_cache,
                             with_features=use_draft, logits_to_keep=1)
    out[0, prompt_len] = choose(prefill.logits[0, -1])
    context = prefill.features
    t1 = _sync(device)
    result = GenerateResult(sequences=out, acceptance_lengths=[], num_prompt_tokens=prompt_len, prefill_time=t1 - t0)

    start = prompt_len
    stopped = int(out[0, start]) in stop_set
    while not stopped and start + 1 < max_length:
        verify_len = min(block_size, max_length - start)
        block = out[:, start:start + verify_len].clone()
        if verify_len > 1:
            ta = _sync(device)
            cached = draft_cache.get_seq_length()
            noise = F.embedding(block, target.embed_weight).to(draft_dtype) * draft.config.input_embedding_scale
            hidden = draft(
                position_ids=positions[:, cached:start + verify_len],
                noise_embedding=noise,
                target_hidden=context.to(draft_dtype),
                past_key_values=draft_cache,
            )
            draft_cache.crop(start)
            draft_logits = draft.compute_logits(hidden[:, 1:, :].to(head_dtype), target.lm_head)
            block[:, 1:] = torch.argmax(draft_logits, dim=-1)
            result.draft_time += _sync(device) - ta
        tv = _sync(device)
        verify = target.forward(block, positions[:, start:start + verify_len], target_cache, with_features=use_draft)
        logits = verify.logits[0]
        proposals = block[0, 1:]
        if greedy:
            target_tokens = torch.argmax(logits, dim=-1)
            accepted = int(torch.cumprod((proposals == target_tokens[:-1]).long(), dim=0).sum())
            next_token = int(target_tokens[accepted])
        else:
            accepted, next_token = accept_one_hot_proposals(
                sampling_probs(logits, temperature, top_p, top_k), proposals, generator
            )
        out[0, start + 1:start + accepted + 1] = proposals[:accepted]
        out[0, start + accepted + 1] = next_token
        new_start = start + accepted + 1
        rejected = start + verify_len - new_start
        if rejected > 0:  # DynamicCache.crop(-n) drops the last n positions; crop(0) would drop all
            target_cache.crop(-rejected)
        if use_draft:
            context = verify.features[:, :accepted + 1]
        result.verify_time += _sync(device) - tv

        produced = out[0, start + 1:min(new_start, max_length - 1) + 1].tolist()
        for i, tok in enumerate(produced):
            if tok in stop_set:
                produced = produced[:i + 1]
                stopped = True
                break
        result.acceptance_lengths.append(len(produced))
        start = new_start

    end = min(start + 1, max_length)
    generated = out[0, prompt_len:end].tolist()
    for i, tok in enumerate(generated):
        if tok in stop_set:
            end = prompt_len + i + 1
            break
    result.sequences = out[:, :end].clone()
    result.total_time = _sync(device) - t0
    return result

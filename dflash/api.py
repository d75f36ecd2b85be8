"""``dflash.generate``: argument checks, batch normalisation, and the choice of runtime.

Two runtimes implement the same contract: :mod:`dflash.reference` (the official semantics, one
request, HF forward) and :mod:`dflash.engine` (static state, kernels, captured steps, batches).
Every argument is checked here, before any work, with an error that names it.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from dflash.draft import DraftModel
from dflash.engine import cached_engine, graph_mode_for, target_lock, unsupported_reason
from dflash.reference import MAX_TREE_BUDGET, reference_generate
from dflash.results import BatchResult, GenerateResult
from dflash.sampling import SamplingParams
from dflash.target import TargetAdapter, check_target
from dflash_kernels import distinct_prefixes

BACKENDS = ("auto", "fast", "reference")
# Largest block size B: the kernels' verify and attention paths hold up to 64 block rows (the engine's buffers
# and the reference's position table grow with B); z-lab drafts use 16.
MAX_BLOCK_SIZE = 64


def as_target(target, draft: DraftModel) -> TargetAdapter:
    """The target as a :class:`TargetAdapter` tapping the draft's ``target_layer_ids``; a draft built for a
    target of another depth (config ``num_target_layers``, or taps past the target's layers) is refused: it
    would run on the wrong tapped layers."""
    if not isinstance(draft, DraftModel):
        raise TypeError(f"draft must be a dflash.DFlashDraftModel, got {type(draft).__name__}")
    model = target.model if isinstance(target, TargetAdapter) else target
    check_target(model)
    depth, built_for = len(model.model.layers), draft.config.num_target_layers
    if built_for is not None and built_for != depth:
        raise ValueError(f"draft config num_target_layers={built_for}, but the target has {depth} decoder layers: "
                         "this draft was built for another target (its target_layer_ids "
                         f"{draft.config.target_layer_ids} would tap the wrong layers); pass the target it was "
                         "trained for")
    if isinstance(target, TargetAdapter):
        if target.layer_ids != draft.config.target_layer_ids:
            return TargetAdapter(target.model, draft.config.target_layer_ids)
        return target
    return TargetAdapter(target, draft.config.target_layer_ids)


def check_prompt(target: TargetAdapter, draft: DraftModel, input_ids, max_new_tokens: int, block_size: int | None,
                 *, max_batch: int | None = 1) -> tuple[torch.Tensor, int]:
    """Check the pair and one prompt, for both runtimes: token ids, lengths (prompt + ``max_new_tokens`` within
    the target's ``max_position_embeddings``) and the block size (1..``MAX_BLOCK_SIZE``); returns (input_ids
    [b, P] on the target's device, block size)."""
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
    if draft.config.draft_vocab_size is not None:
        draft.head_rows(target.lm_head)  # checks the subset against the target vocabulary; gathered before any step
    head_rows = target.lm_head.weight.shape[0]
    if draft.config.dflash2 is not None and draft.config.vocab_size != head_rows:
        raise ValueError(f"DFlash2 draft vocab_size {draft.config.vocab_size} != the target LM head's {head_rows} "
                         "tokens: its selector codebooks have one row per target token; pass the target it was "
                         "trained for")
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
    if int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab:
        raise ValueError(f"input_ids holds token ids outside the target vocabulary [0, {vocab})")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    limit = getattr(tcfg, "max_position_embeddings", None)
    if limit is not None and input_ids.shape[1] + max_new_tokens > limit:
        raise ValueError(f"prompt + max_new_tokens = {input_ids.shape[1] + max_new_tokens} exceeds the target's "
                         f"max_position_embeddings {limit}; pass a shorter prompt or fewer max_new_tokens")
    what = "block_size"
    if block_size is None:
        block_size, what = draft.config.block_size, "block_size (the draft config's)"
    if isinstance(block_size, bool) or not isinstance(block_size, int) or not 1 <= block_size <= MAX_BLOCK_SIZE:
        raise ValueError(f"{what} must be an integer in [1, {MAX_BLOCK_SIZE}], got {block_size!r}; "
                         "pass block_size=16 or another value in range")
    return input_ids.to(target.device, torch.long), block_size


def check_tree_budget(tree_budget, block_size: int, draft: DraftModel, target: TargetAdapter) -> None:
    """``tree_budget``: None (chain DFlash) or the number of non-root tree nodes, 1..64, that the draft
    can fill from its B-1 block positions."""
    if tree_budget is None:
        return
    if draft.config.dflash2 is not None:
        raise ValueError("tree_budget needs a DFlash draft: a DFlash2 draft proposes one path through its candidate "
                         "selector, not a tree; pass tree_budget=None")
    if isinstance(tree_budget, bool) or not isinstance(tree_budget, int) or not 1 <= tree_budget <= MAX_TREE_BUDGET:
        raise ValueError(f"tree_budget must be None (chain DFlash) or an integer in [1, {MAX_TREE_BUDGET}] "
                         f"(tree nodes besides the root), got {tree_budget!r}")
    if block_size < 2:
        raise ValueError("tree_budget needs block_size >= 2: the tree grows from the draft's block positions "
                         "1..B-1 and block_size=1 drafts none; pass tree_budget=None")
    vocab = draft.config.draft_vocab_size or target.embed_weight.shape[0]
    most = distinct_prefixes(block_size - 1, vocab, MAX_TREE_BUDGET + 1)
    if tree_budget > most:
        raise ValueError(f"tree_budget={tree_budget} exceeds the {most} distinct token sequences a {vocab}-token "
                         f"draft can propose at block_size={block_size}; pass tree_budget <= {most} or a larger "
                         "block_size")


def check_lookup_depth(lookup_depth, tree_budget, block_size: int) -> None:
    """``lookup_depth``: None, or the longest prompt-lookup path (1..B-1) grafted into each round's tree."""
    if lookup_depth is None:
        return
    if isinstance(lookup_depth, bool) or not isinstance(lookup_depth, int) or lookup_depth < 0:
        raise ValueError(f"lookup_depth must be None or an integer >= 0 (0: no lookup path), got {lookup_depth!r}")
    if lookup_depth and tree_budget is None:
        raise ValueError("lookup_depth grafts a path into the draft tree: it needs tree_budget (an integer), or pass "
                         "lookup_depth=None")
    if lookup_depth > block_size - 1:
        raise ValueError(f"lookup_depth={lookup_depth} exceeds the tree's depth B - 1 = {block_size - 1} at "
                         f"block_size={block_size}; pass lookup_depth <= {block_size - 1}")


def stop_list(stop_token_ids, what: str = "stop_token_ids") -> list[int]:
    """None, an int or a sequence of ints -> a list of ints."""
    if stop_token_ids is None:
        return []
    if isinstance(stop_token_ids, int) and not isinstance(stop_token_ids, bool):
        return [stop_token_ids]
    try:
        return [int(s) for s in stop_token_ids]
    except (TypeError, ValueError):
        raise TypeError(f"{what} must be None, an int or a list of ints, got {stop_token_ids!r}") from None


def normalize_batch(input_ids, attention_mask) -> tuple[list[torch.Tensor], bool]:
    """Ragged prompts from a list of 1-D tensors, a [P]/[1, P] tensor, or a left-padded [N, P] + mask;
    returns (prompts, batched) where ``batched`` says whether to return a :class:`BatchResult`."""
    if isinstance(input_ids, (list, tuple)):
        if not input_ids:
            raise ValueError("input_ids is an empty list: pass at least one prompt")
        for i, p in enumerate(input_ids):
            if not isinstance(p, torch.Tensor) or p.dim() != 1:
                raise ValueError(f"input_ids[{i}] must be a 1-D LongTensor")
        return list(input_ids), True
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"input_ids must be a LongTensor or a list of 1-D LongTensors, got {type(input_ids).__name__}")
    if input_ids.dim() == 1:
        return [input_ids], False
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, seq] or [seq], got shape {tuple(input_ids.shape)}")
    if attention_mask is None:
        return list(input_ids), input_ids.shape[0] > 1
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape {tuple(input_ids.shape)}")
    prompts = []
    for i in range(input_ids.shape[0]):
        keep = attention_mask[i].bool()
        first = int(keep.float().argmax()) if keep.any() else input_ids.shape[1]
        if not keep[first:].all():
            raise ValueError(f"attention_mask row {i} is not left padding (ones must be contiguous at the end)")
        prompts.append(input_ids[i, first:])
    return prompts, input_ids.shape[0] > 1


def generate(
    target,
    draft: DraftModel,
    input_ids,
    max_new_tokens: int | Sequence[int],
    stop_token_ids: Sequence[int] | Sequence[Sequence[int]] | int | None = None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    block_size: int | None = None,
    backend: str = "auto",
    seed: int | None = None,
    *,
    attention_mask: torch.Tensor | None = None,
    max_length: int | None = None,
    kernel_backend: str | None = None,
    use_cuda_graphs: bool | str | None = None,
    on_tokens: Callable[[int, list[int]], None] | None = None,
    tree_budget: int | None = None,
    lookup_depth: int | None = None,
):
    """Speculative generation with a DFlash draft.

    Args:
        target: a Hugging Face LLaMA/Qwen3 causal LM (or a :class:`TargetAdapter`).
        draft: the :class:`DFlashDraftModel` trained for it.
        input_ids: [1, P] or [P] prompt token ids; with backend "fast" also a list of 1-D prompts or a
            left-padded [N, P] with ``attention_mask`` (returns a :class:`BatchResult`).
        max_new_tokens: tokens to generate at most (>= 1); "fast": also one per request.
        stop_token_ids: generation ends after the first of these tokens (it is kept); "fast": also one
            list per request.
        temperature: 0 = greedy (output equals the target's greedy output); > 0 samples, with
            ``top_p``/``top_k`` applied to the target distribution (output distributed as the target's).
        block_size: B, 1..``MAX_BLOCK_SIZE`` (64; default: the draft's); 1 = plain autoregressive decoding with
            the same machinery.
        backend: "reference" (the pure-PyTorch loop of :mod:`dflash.reference`, one request), "fast"
            (:mod:`dflash.engine`: static state, kernels, captured steps, batches), or "auto": fast where
            it can run (LLaMA/Qwen3 targets, supported draft layers), else reference.
        seed: makes sampling reproducible (the two backends draw different random streams).
        attention_mask, max_length (the engine's capacity, default prompt + max_new_tokens rounded up to
            64), kernel_backend ("auto" | "triton" | "cpu" | "torch" | "ext"; "cpu": the eager CPU path with
            its native kernels, what "auto" picks on a CPU without the Triton interpreter), use_cuda_graphs
            (None = on CUDA; True; False; "emulate" = record each step once and replay it, with CUDA-graph semantics, on
            any device): backend "fast" only.
        on_tokens: called as tokens are committed, with (request index, the new token ids): the first
            token after the prefill, then each round's tokens (for streaming output; the engine then
            reads the new tokens back once per round).
        tree_budget: None = chain DFlash (verify the draft's argmax block). An integer N in 1..64 = tree
            mode (DDTree): each round verifies a tree of the anchor plus the N most likely continuations
            (best-first by the product of the draft's per-position probabilities, depth <= B-1) in one
            target pass and commits the longest accepted root-to-node path plus the target's next token.
            Same losslessness as the chain; needs block_size >= 2.
        lookup_depth: tree mode only. None or 0 = the draft's tree as built. An integer 1..B-1 = each round also
            proposes the tokens that followed the latest earlier occurrence of the sequence's last 4..1 tokens
            (prompt lookup, up to this many), grafted into the tree as a path in place of its last-selected nodes
            (:func:`dflash_kernels.tree_graft_lookup`): free acceptance where the text repeats its prompt or
            itself. Same T nodes a round, same losslessness.
    Returns:
        :class:`GenerateResult` with ``.sequences`` [1, P + n] and ``.acceptance_lengths``; for batched
        input, a :class:`BatchResult` whose fields are per-request lists.

    Threads: safe to call from several threads. Calls that share a target model run one at a time (one lock
    per target model, held for the whole call; both runtimes keep per-call state on the model: the engine's
    buffers, the reference's feature hooks); calls on different target models run in parallel, except on
    CUDA, where all calls run one at a time (a step capture must not overlap other CUDA work). Calling
    ``generate`` on the same target from inside ``on_tokens`` raises RuntimeError. The cached engine lives
    on its target model: dropping the target and draft frees both, engine included, at Python's next
    garbage collection (``gc.collect()`` frees them at once; the engine and the model refer to each other).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    sampling = SamplingParams(temperature, top_p, top_k)
    target = as_target(target, draft)
    if seed is None:  # unseeded calls still differ from each other, following torch's global RNG
        seed = int(torch.randint(2**62, ()))
    reason = unsupported_reason(target, draft)  # why the engine cannot run this pair, or None
    if backend == "auto":
        backend = "reference" if reason else "fast"
    if backend == "reference":
        fast_only = {"attention_mask": attention_mask, "max_length": max_length, "kernel_backend": kernel_backend,
                     "use_cuda_graphs": use_cuda_graphs}
        given = sorted(k for k, v in fast_only.items() if v is not None)
        if given:
            raise ValueError(f"options {given} need backend='fast'")
        input_ids, block = check_prompt(target, draft, input_ids, max_new_tokens, block_size)
        check_tree_budget(tree_budget, block, draft, target)
        check_lookup_depth(lookup_depth, tree_budget, block)
        stops = stop_list(stop_token_ids)
        with target_lock(target.model), torch.inference_mode():
            return reference_generate(target, draft, input_ids, max_new_tokens, stops, sampling, block, seed,
                                      on_tokens=on_tokens, tree_budget=tree_budget, lookup_depth=lookup_depth)

    if reason is not None:
        raise ValueError(f"backend='fast' cannot run this pair: {reason}; use backend='reference'")
    graph_mode_for(use_cuda_graphs, target.device)  # a bad value fails here, before any work
    prompts, batched = normalize_batch(input_ids, attention_mask)
    n = len(prompts)
    limits = list(max_new_tokens) if isinstance(max_new_tokens, (list, tuple)) else [max_new_tokens] * n
    if len(limits) != n:
        raise ValueError(f"max_new_tokens has {len(limits)} entries for {n} prompts")
    per_request_stops = (isinstance(stop_token_ids, (list, tuple)) and len(stop_token_ids) > 0
                         and all(isinstance(s, (list, tuple)) for s in stop_token_ids))
    if per_request_stops and len(stop_token_ids) != n:
        raise ValueError(f"stop_token_ids has {len(stop_token_ids)} lists for {n} prompts")
    checked, stops = [], []
    for r, p in enumerate(prompts):
        ids, block = check_prompt(target, draft, p, limits[r], block_size, max_batch=None)
        checked.append(ids[0])
        stops.append(stop_list(stop_token_ids[r] if per_request_stops else stop_token_ids))
    check_tree_budget(tree_budget, block, draft, target)
    check_lookup_depth(lookup_depth, tree_budget, block)
    needed = max(p.shape[0] + m for p, m in zip(checked, limits))
    if max_length is None:
        max_length = -(-needed // 64) * 64
    if needed > max_length:
        raise ValueError(f"max_length={max_length} is too small: the longest request (prompt + max_new_tokens) "
                         f"needs {needed}")
    with target_lock(target.model):
        engine = cached_engine(target.model, draft, batch=n, capacity=max_length, block_size=block,
                               kernel_backend=kernel_backend, use_cuda_graphs=use_cuda_graphs, tree_budget=tree_budget,
                               lookup_depth=lookup_depth or None)
        results: list[GenerateResult] = engine.generate(checked, limits, stops, sampling, seed, on_tokens=on_tokens)
    return BatchResult(results) if batched else results[0]

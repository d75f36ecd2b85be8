"""Fast runtime: static buffers, kernel-backed draft and verify steps, CUDA graphs, batch > 1.

State lives on the device and the two steps have static shapes, so on CUDA each is captured once
per (batch, block size) as a CUDA graph and replayed every round; the host reads one small tensor
(done flags and committed counts) per round. On CPU the same steps run eagerly with the PyTorch
reference kernels or the Triton interpreter.

Invariant per request ``r`` (``positions[r]`` = position of the anchor, the last committed token):
the target cache and the draft context cache both hold exactly ``positions[r]`` valid rows, the
tokens before the anchor. Rolling back a rejected block costs nothing: its rows lie beyond
``positions`` and are overwritten next round.

Round:
  draft step   inject the previous round's committed rows (fused_context + inject_context_kv),
               then every draft layer over [context cache ++ block] (draft_attention), final norm,
               LM head on rows 1..B-1, argmax -> proposals.
  verify step  lean target forward over [anchor, proposals] at positions[r] (taps into a buffer),
               verify_greedy / verify_sample, commit_round (tokens, lengths, positions, anchor,
               stop and length limits, done flags).
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from dflash.generate import GenerateResult, _sync, as_target, validate_generate_args
from dflash.lean_target import LeanTarget, check_lean_target
from dflash.model import DFlashDraftModel, rope_inv_freq
from dflash.sampling import GREEDY_EPS, sample
from dflash_kernels import commit_round, draft_attention, fused_context, inject_context_kv, verify_greedy, verify_sample


def default_kernel_backend(device: torch.device) -> str:
    """``"auto"`` on GPU; the PyTorch references on CPU, where the Triton interpreter is for tests only."""
    return "auto" if device.type == "cuda" else "torch"


class FastDFlash:
    """Preallocated state and the two decode steps for ``batch`` requests of at most ``capacity`` tokens."""

    def __init__(self, target_model, draft: DFlashDraftModel, *, batch: int, capacity: int, block_size: int,
                 kernel_backend: str | None = None, use_cuda_graphs: bool | None = None, prefill_chunk: int = 512):
        check_lean_target(target_model)
        cfg = draft.config
        if cfg.attention_bias:
            raise ValueError("draft: attention_bias drafts are not supported by backend='fast'; use backend='reference'")
        self.target_model = target_model
        self.draft = draft
        self.batch, self.capacity, self.block_size = batch, capacity, block_size
        self.prefill_chunk = prefill_chunk
        device = target_model.lm_head.weight.device
        self.device = device
        self.backend = kernel_backend or default_kernel_backend(device)
        # commit_round has no Triton kernel: with "triton" it takes the compiled op or its reference.
        self.commit_backend = "auto" if self.backend == "triton" else self.backend
        self.use_graphs = device.type == "cuda" if use_cuda_graphs is None else use_cuda_graphs
        self.use_draft = block_size > 1
        # Rows beyond a request's length are scratch for one block: capacity + B keeps them in bounds.
        rows = capacity + block_size
        self.target = LeanTarget(target_model, cfg.target_layer_ids if self.use_draft else [],
                                 batch=batch, capacity=rows)
        dtype = draft.fc.weight.dtype
        inv_freq, self.attention_scaling = rope_inv_freq(cfg)
        self.inv_freq = inv_freq.to(device)
        # Stacked [L, ...] copies for inject_context_kv, filled (and later refreshed) by refresh_weights.
        first = draft.layers[0].self_attn
        layers = cfg.num_hidden_layers
        self.k_weight = first.k_proj.weight.new_empty((layers, *first.k_proj.weight.shape))
        self.v_weight = first.v_proj.weight.new_empty((layers, *first.v_proj.weight.shape))
        self.k_norm_weight = first.k_norm.weight.new_empty((layers, *first.k_norm.weight.shape))
        self.refresh_weights()
        cache_shape = (cfg.num_hidden_layers, batch, rows, cfg.num_key_value_heads, cfg.head_dim)
        self.k_cache = torch.zeros(cache_shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros_like(self.k_cache)
        long = dict(dtype=torch.long, device=device)
        B = block_size
        self.out_tokens = torch.zeros(batch, capacity, **long)
        self.lengths = torch.zeros(batch, **long)
        self.positions = torch.zeros(batch, **long)
        self.anchor = torch.zeros(batch, **long)
        self.done = torch.ones(batch, dtype=torch.bool, device=device)
        self.max_lengths = torch.zeros(batch, **long)
        self.num_new = torch.zeros(batch, **long)
        self.proposals = torch.zeros(batch, B - 1, **long)
        self.features = torch.zeros(batch, B, cfg.num_taps * cfg.hidden_size, dtype=dtype, device=device)
        self.block_offsets = torch.arange(B, device=device)
        self.cu_block = torch.arange(batch + 1, device=device) * B
        self.stop_tokens: torch.Tensor | None = None
        self.kv_bound = 0  # host-side bound on positions + B, grown by B per round (no sync)
        self.sampling: dict | None = None
        self.seed = torch.zeros(1, **long)
        self.offset = torch.zeros(1, **long)
        self.graphs: dict[str, torch.cuda.CUDAGraph] = {}

    def refresh_weights(self) -> None:
        """Re-copy the stacked context K/V weights from the draft (in place, so captured graphs stay valid)."""
        with torch.no_grad():
            for i, layer in enumerate(self.draft.layers):
                attn = layer.self_attn
                self.k_weight[i].copy_(attn.k_proj.weight)
                self.v_weight[i].copy_(attn.v_proj.weight)
                self.k_norm_weight[i].copy_(attn.k_norm.weight)

    # ------------------------------------------------------------------ setup per generation
    def reset(self, prompts: Sequence[torch.Tensor], max_new_tokens: Sequence[int], stops: Sequence[list[int]],
              sampling: dict | None, generator: torch.Generator | None) -> None:
        """Prefill every request (eagerly, one at a time) and set the per-request state.

        ``stops[r]`` are request r's stop tokens (may be empty)."""
        self.sampling = sampling
        self.done.fill_(True)
        self.num_new.zero_()
        width = max((len(s) for s in stops), default=0)
        self.stop_tokens = None
        if width:  # [R, S], padded with -1 (never a token)
            table = [list(s) + [-1] * (width - len(s)) for s in stops]
            self.stop_tokens = torch.tensor(table, dtype=torch.long, device=self.device)
        longest = 0
        for r, prompt in enumerate(prompts):
            p = prompt.shape[0]
            longest = max(longest, p)
            row = torch.tensor([r], device=self.device)
            for c0 in range(0, p, self.prefill_chunk):
                c1 = min(p, c0 + self.prefill_chunk)
                start = torch.full((1,), c0, dtype=torch.long, device=self.device)
                logits, feats = self.target.forward(prompt[None, c0:c1], start, c1, rows=row)
                if self.use_draft:  # the chunk's context rows go straight into the draft cache
                    ctx = fused_context(feats[0], self.draft.fc.weight, self.draft.hidden_norm.weight,
                                        self.draft.config.rms_norm_eps, backend=self.backend)
                    self._inject(ctx, torch.arange(c0, c1, device=self.device),
                                 torch.tensor([0, c1 - c0], device=self.device), start, cache_batch_idx=row)
            last = logits[0, -1]
            if sampling is None:
                first = int(torch.argmax(last))
            else:
                first = int(sample(last, sampling["temperature"], sampling["top_p"], sampling["top_k"], generator))
            self.out_tokens[r, :p] = prompt
            self.out_tokens[r, p] = first
            self.lengths[r] = p + 1
            self.positions[r] = p
            self.anchor[r] = first
            self.max_lengths[r] = p + max_new_tokens[r]
            self.done[r] = bool(first in stops[r] or max_new_tokens[r] <= 1)
        # Graphs need static shapes: attend over the whole cache; eagerly, only as far as needed.
        self.kv_bound = self.capacity + self.block_size if self.use_graphs else longest + self.block_size

    def _inject(self, ctx, positions, cu_lens, cache_lens, cache_batch_idx=None):
        cfg = self.draft.config
        inject_context_kv(ctx, self.k_weight, self.v_weight, self.k_norm_weight, positions, cu_lens, cache_lens,
                          self.k_cache, self.v_cache, inv_freq=self.inv_freq, attention_scaling=self.attention_scaling,
                          eps=cfg.rms_norm_eps, cache_batch_idx=cache_batch_idx, backend=self.backend)

    # ------------------------------------------------------------------ the two steps
    def draft_step(self) -> None:
        """Inject last round's committed rows, run the draft over the block, write proposals."""
        draft, cfg, n, B = self.draft, self.draft.config, self.batch, self.block_size
        start = self.positions - self.num_new  # first row of the rows committed last round
        ctx = fused_context(self.features.view(n * B, -1), draft.fc.weight, draft.hidden_norm.weight,
                            cfg.rms_norm_eps, backend=self.backend)
        # All B rows of every request are written; only num_new of them become valid context
        # (positions advanced by exactly that), so the shapes stay static.
        self._inject(ctx, (start[:, None] + self.block_offsets).view(-1), self.cu_block, start)
        block = torch.cat([self.anchor[:, None], torch.full_like(self.proposals, cfg.mask_token_id)], dim=1)
        h = F.embedding(block, self.target_model.get_input_embeddings().weight).to(ctx.dtype)
        h = h * cfg.input_embedding_scale
        for li, layer in enumerate(draft.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = attn.q_proj(x).view(n, B, attn.num_heads, attn.head_dim)
            k = attn.k_proj(x).view(n, B, attn.num_kv_heads, attn.head_dim)
            v = attn.v_proj(x).view(n, B, attn.num_kv_heads, attn.head_dim)
            o = draft_attention(q, k, v, self.k_cache[li], self.v_cache[li], self.positions, attn.q_norm.weight,
                                attn.k_norm.weight, inv_freq=self.inv_freq, attention_scaling=self.attention_scaling,
                                eps=cfg.rms_norm_eps, sliding_window=attn.window, causal=attn.causal,
                                max_context_len=self.kv_bound,
                                backend=self.backend)
            h = h + attn.o_proj(o.reshape(n, B, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        h = draft.norm(h[:, 1:])
        logits = draft.compute_logits(h.to(self.target_model.lm_head.weight.dtype), self.target_model.lm_head)
        self.proposals.copy_(torch.argmax(logits, dim=-1))

    def verify_step(self) -> None:
        """Target forward over [anchor, proposals], acceptance, commit."""
        block = torch.cat([self.anchor[:, None], self.proposals], dim=1)
        logits, feats = self.target.forward(block, self.positions, self.kv_bound)
        if self.sampling is None:
            accepted, bonus = verify_greedy(logits, self.proposals, backend=self.backend)
        else:
            accepted, bonus = verify_sample(logits, self.proposals, temperature=self.sampling["temperature"],
                                            top_k=self.sampling["top_k"], top_p=self.sampling["top_p"],
                                            seed=self.seed, offset=self.offset, backend=self.backend)
            self.offset.add_(1)
        if feats is not None:
            self.features.copy_(feats)
        self.num_new.copy_(commit_round(self.proposals, accepted, bonus, out_tokens=self.out_tokens,
                                        lengths=self.lengths, positions=self.positions, anchor=self.anchor,
                                        done=self.done, max_lengths=self.max_lengths, stop_tokens=self.stop_tokens,
                                        backend=self.commit_backend))

    def round(self) -> tuple[float, float]:
        """One round; returns (draft seconds, verify seconds)."""
        t0 = _sync(self.device)
        if self.use_draft:
            self._run("draft", self.draft_step)
        t1 = _sync(self.device)
        self._run("verify", self.verify_step)
        t2 = _sync(self.device)
        self.kv_bound = min(self.kv_bound + self.block_size, self.capacity + self.block_size)
        return t1 - t0, t2 - t1

    def _run(self, name: str, step) -> None:
        if not self.use_graphs:
            step()
            return
        graph = self.graphs.get(name)
        if graph is None:
            graph = self._capture(step)
            self.graphs[name] = graph
        graph.replay()

    def _capture(self, step) -> "torch.cuda.CUDAGraph":
        # Warm up on a side stream (compiles Triton kernels, sets up cuBLAS) on copies of the
        # state, then capture the step writing into the live buffers.
        snapshot = {k: v.clone() for k, v in self._mutable().items()}
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()
        torch.cuda.current_stream().wait_stream(stream)
        for k, v in self._mutable().items():
            v.copy_(snapshot[k])
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        for k, v in self._mutable().items():  # capture records without running: restore anyway
            v.copy_(snapshot[k])
        return graph

    def _mutable(self) -> dict[str, torch.Tensor]:
        return {"out_tokens": self.out_tokens, "lengths": self.lengths, "positions": self.positions,
                "anchor": self.anchor, "done": self.done, "num_new": self.num_new, "proposals": self.proposals,
                "features": self.features, "offset": self.offset}


_ENGINE: dict = {}


def cached_engine(target_model, draft: DFlashDraftModel, **options) -> FastDFlash:
    """The engine of the previous call when the models and shapes are the same (its buffers and
    CUDA graphs are reused, so repeated calls neither reallocate nor recapture), else a new one."""
    key = (id(target_model), id(draft), FastDFlash, tuple(sorted(options.items())))
    engine = _ENGINE.get("engine")
    if engine is not None and _ENGINE.get("key") == key and engine.target_model is target_model and engine.draft is draft:
        engine.refresh_weights()
        return engine
    _ENGINE.clear()  # drop the old engine's buffers before allocating the new ones
    engine = FastDFlash(target_model, draft, **options)
    _ENGINE.update(key=key, engine=engine)
    return engine


def unsupported_reason(target, draft: DFlashDraftModel) -> str | None:
    """Why backend='fast' cannot run this pair, or None."""
    model = target.model if hasattr(target, "layer_ids") else target
    try:
        check_lean_target(model)
    except TypeError as exc:
        return str(exc)
    if draft.config.attention_bias:
        return "draft uses attention_bias"
    return None


def normalize_batch(input_ids, attention_mask) -> tuple[list[torch.Tensor], bool]:
    """Ragged prompts from a list of 1-D tensors, a [P]/[1, P] tensor, or a left-padded [N, P] + mask."""
    if isinstance(input_ids, (list, tuple)):
        if not input_ids:
            raise ValueError("input_ids is an empty list: pass at least one prompt")
        prompts = []
        for i, p in enumerate(input_ids):
            if not isinstance(p, torch.Tensor) or p.dim() != 1:
                raise ValueError(f"input_ids[{i}] must be a 1-D LongTensor")
            prompts.append(p)
        return prompts, True
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


def generate_fast(target, draft: DFlashDraftModel, input_ids, max_new_tokens, stop_token_ids=None,
                  temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, block_size: int | None = None,
                  seed: int | None = None, attention_mask: torch.Tensor | None = None,
                  max_length: int | None = None, kernel_backend: str | None = None,
                  use_cuda_graphs: bool | None = None):
    """Batched speculative generation on the fast runtime; see :func:`dflash.generate.generate`.

    ``input_ids``: [P], [1, P], a list of 1-D prompts, or a left-padded [N, P] with ``attention_mask``.
    ``max_new_tokens``: an int or one per request; ``stop_token_ids``: ints shared by all requests,
    or one list per request. Batched input returns a :class:`BatchResult`.
    """
    adapter = as_target(target, draft)
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
        ids, stop, block = validate_generate_args(
            adapter, draft, p, limits[r], stop_token_ids[r] if per_request_stops else stop_token_ids,
            temperature, top_p, top_k, block_size, max_batch=None)
        checked.append(ids[0])
        stops.append(stop)
    needed = max(p.shape[0] + m for p, m in zip(checked, limits))
    if max_length is None:
        max_length = -(-needed // 64) * 64
    if needed > max_length:
        raise ValueError(f"max_length={max_length} is too small: the longest request (prompt + max_new_tokens) "
                         f"needs {needed}")
    limit = getattr(adapter.config, "max_position_embeddings", None)
    if limit is not None and needed > limit:
        raise ValueError(f"prompt + max_new_tokens = {needed} exceeds the target's max_position_embeddings {limit}")
    engine = cached_engine(adapter.model, draft, batch=n, capacity=max_length, block_size=block,
                           kernel_backend=kernel_backend, use_cuda_graphs=use_cuda_graphs)
    greedy = temperature < GREEDY_EPS
    sampling = None if greedy else {"temperature": float(temperature), "top_p": float(top_p), "top_k": int(top_k)}
    if seed is None:  # unseeded calls still differ from each other, following torch's global RNG
        seed = int(torch.randint(2**62, ()))
    generator = torch.Generator(device=engine.device).manual_seed(seed)
    engine.seed.fill_(seed)
    engine.offset.zero_()
    with torch.inference_mode():
        t0 = _sync(engine.device)
        engine.reset(checked, limits, stops, sampling, generator)
        t1 = _sync(engine.device)
        acceptance: list[list[int]] = [[] for _ in checked]
        draft_time = verify_time = 0.0
        done = engine.done.to("cpu", copy=True)
        while not bool(done.all()):
            dt, vt = engine.round()
            draft_time += dt
            verify_time += vt
            was_done = done
            snapshot = torch.cat([engine.done.long(), engine.num_new]).cpu()  # the round's one host read
            done = snapshot[:n].bool()
            for r, n_new in enumerate(snapshot[n:].tolist()):
                if not was_done[r]:
                    acceptance[r].append(int(n_new))
        lengths = engine.lengths.cpu().tolist()
        total = _sync(engine.device) - t0
    results = [
        GenerateResult(sequences=engine.out_tokens[r:r + 1, :lengths[r]].clone(), acceptance_lengths=acceptance[r],
                       num_prompt_tokens=prompt.shape[0], prefill_time=t1 - t0, draft_time=draft_time,
                       verify_time=verify_time, total_time=total)
        for r, prompt in enumerate(checked)
    ]
    return BatchResult(results) if batched else results[0]


class BatchResult:
    """Per-request results of a batched call: ``.sequences`` and ``.acceptance_lengths`` are lists."""

    def __init__(self, results: list[GenerateResult]):
        self.results = results
        self.sequences = [r.sequences[0] for r in results]
        self.acceptance_lengths = [r.acceptance_lengths for r in results]
        first = results[0]
        self.prefill_time, self.draft_time = first.prefill_time, first.draft_time
        self.verify_time, self.total_time = first.verify_time, first.total_time

    @property
    def tau(self) -> float:
        rounds = [a for r in self.acceptance_lengths for a in r]
        return sum(rounds) / max(1, len(rounds))

    @property
    def other_time(self) -> float:
        return max(0.0, self.total_time - self.prefill_time - self.draft_time - self.verify_time)

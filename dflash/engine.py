"""The engine behind ``backend="fast"``: static buffers, kernel-backed draft and verify steps,
captured steps (CUDA graphs, or their emulation on any device), batch > 1.

State lives on the device and the two steps have static shapes, so each is captured once per
setting that changes its work (see :meth:`DFlashEngine.graph_key`) and replayed every round; the
host reads the device once per round, one packed copy (done flags, committed counts, lengths, and
the new tokens when streaming). Everything a call may change — sampling parameters, stop tokens,
seed and offset, lengths — lives in persistent device buffers written in place before replay, so an
engine reused across calls gives the same tokens as a fresh one.

Invariant per request ``r`` (``positions[r]`` = position of the anchor, the last committed token):
the target cache and the draft context cache both hold exactly ``positions[r]`` valid rows, the
tokens before the anchor. Rolling back a rejected block costs nothing: its rows lie beyond
``positions`` and are overwritten next round.

Round (each layer of either model is seven kernels on the GPU: add_rms_norm, merged QKV GEMM, attention
with q/k norm + RoPE fused (split-KV, merged by the last split to finish), o_proj, add_rms_norm, merged
gate/up GEMM with silu·mul in its epilogue (gate_up_silu), down_proj; the draft adds the context rows' K/V
write):
  draft step   fused_context of the previous round's rows, then every draft layer over [context cache ++
               block] (draft_attention; block rows at or beyond ``v = min(B, max_length - position)`` are
               masked, as the reference drafts a v-row block at the tail), final norm, ``draft.propose``
               (LM head + argmax) -> proposals. The context rows ride in each layer's merged QKV GEMM
               (``qkv_proj``, which skips their unread Q columns), stacked under the block rows, so the K/V
               weights are read once per step; their K/V go to the layer's context cache (inject_context_kv:
               k_norm + RoPE + cache write) before its attention: eight kernels per draft layer. A DFlash2 draft
               also convolves each request's block rows around attention and around the MLP: ``prepare`` before
               a sublayer (the kernel projection GEMM, then the convolution in the x-tile load of the QKV GEMM
               or of gate_up_silu; on CPU the steps' GEMM, then ``grouped_dynamic_conv``, and the steps' QKV
               GEMM), ``finish`` after it fused into the next
               ``add_rms_norm``: ten kernels per layer. It proposes the candidate selector's walk from the anchor
               (``candidate_select``: its argmax, or when sampling its draws, whose candidates and q the
               verify step's rejection sampling takes), written into the engine's buffers.
  verify step  lean target forward over [anchor, proposals] at positions[r] (verify_attention writes
               the block's K/V into the target cache; taps into a buffer), verify_greedy /
               verify_sample (a DFlash2 draft's q over its candidates as draft_probs), commit_round (tokens,
               lengths, positions, anchor, stop and length limits, done flags).

Tree mode (``tree_budget=N``, DDTree): the draft step keeps the block's logits instead of their argmax;
the verify step builds each request's tree of T = N + 1 nodes from them (build_tree; with ``lookup_depth``,
tree_graft_lookup puts the request's prompt-lookup continuation in as a path; then its ancestor bitmask),
runs the lean target over the T nodes (node i at position positions[r] + depth, its K/V
written at cache row positions[r] + i, attending to the live rows and its ancestors), walks it
(tree_accept_greedy / tree_accept_sample), moves the accepted path's K/V rows to consecutive rows
(tree_compact), gathers the path's tapped features for the draft, and commits the path's tokens with
the same commit_round. All shapes stay static ([batch, T] trees, [batch, B] paths), nothing is read
on the host.
"""
from __future__ import annotations

import contextlib
import threading
import time
import weakref
from typing import NamedTuple, Sequence

import torch
import torch.nn.functional as F

from dflash.draft import DraftModel, rope_inv_freq
from dflash.graphs import capture
from dflash.lean_target import LeanTarget, check_lean_target, gate_up_act, linear_for
from dflash.merged_linear import merged_weight
from dflash.reference import finite_tree_logits_
from dflash.results import GenerateResult, device_clock
from dflash.sampling import GREEDY_EPS, SamplingParams, sample
from dflash_kernels import (
    add_rms_norm, backend_traits, build_tree, candidate_select, commit_round, default_backend, draft_attention,
    draft_round_setup, first_token_done, fused_context, gate_up_silu, grouped_dynamic_conv, inject_context_kv,
    qkv_proj, tree_accept_greedy, tree_accept_greedy_tokens, tree_accept_sample, tree_ancestor_mask, tree_compact,
    tree_graft_lookup, verify_greedy, verify_greedy_tokens, verify_sample,
)


def graph_mode_for(use_cuda_graphs, device: torch.device) -> str | None:
    """``use_cuda_graphs`` (None | True | False | "emulate") -> "cuda", "emulate" or None (eager)."""
    if use_cuda_graphs == "emulate":
        return "emulate"
    if use_cuda_graphs is None:
        return "cuda" if device.type == "cuda" else None
    if use_cuda_graphs is True:
        if device.type != "cuda":
            raise ValueError(f"use_cuda_graphs=True needs CUDA tensors, the models are on {device}; "
                             "pass use_cuda_graphs='emulate' for the same semantics on this device")
        return "cuda"
    if use_cuda_graphs is False:
        return None
    raise ValueError(f"use_cuda_graphs must be None, True, False or 'emulate', got {use_cuda_graphs!r}")


# Device-to-host reads per decoding round, in every mode (eager or captured, chains or trees, any batch,
# sampling, streaming): the packed read of :meth:`DFlashEngine.host_snapshot`. The tests count them
# (``dflash.graphs.HostSyncCounter``); bench/traffic.py charges each round this many syncs.
HOST_READS_PER_ROUND = 1


class HostSnapshot(NamedTuple):
    """What the host knows after a round, per request: finished, tokens just committed, length, and (streaming
    only) the last B tokens of its output (fewer at its start: the first tokens repeat)."""
    done: list[bool]
    num_new: list[int]
    lengths: list[int]
    last_tokens: list[list[int]]


class DFlashEngine:
    """Preallocated state and the two decode steps for ``batch`` requests of at most ``capacity`` tokens."""

    def __init__(self, target_model, draft: DraftModel, *, batch: int, capacity: int, block_size: int,
                 kernel_backend: str | None = None, use_cuda_graphs: bool | str | None = None,
                 prefill_chunk: int = 512, tree_budget: int | None = None, lookup_depth: int | None = None):
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
        self.backend = kernel_backend or default_backend(device)
        self.traits = backend_traits(self.backend)  # the steps choose their paths by these, not by its name
        self.linear = linear_for(self.backend)
        # commit_round has no Triton kernel: with "triton" it takes the compiled op or its reference.
        self.commit_backend = "auto" if self.backend == "triton" else self.backend
        self.graph_mode = graph_mode_for(use_cuda_graphs, device)
        self.use_draft = block_size > 1
        self.tree_budget = tree_budget  # None: chain rounds; N: trees of N + 1 nodes (validated by generate)
        self.lookup_depth = lookup_depth  # trees: the prompt-lookup path grafted into each tree (None: none)
        # Rows beyond a request's length are scratch for one verified block (B rows, or a tree's T = N + 1)
        # and one drafted block: capacity + that keeps them in bounds.
        self.scratch_rows = block_size if tree_budget is None else max(block_size, tree_budget + 1)
        rows = capacity + self.scratch_rows
        self.target = LeanTarget(target_model, cfg.target_layer_ids if self.use_draft else [],
                                 batch=batch, capacity=rows, backend=self.backend)
        dtype = draft.fc.weight.dtype
        inv_freq, self.attention_scaling = rope_inv_freq(cfg)
        self.inv_freq = inv_freq.to(device)
        # Merged [q; k; v] and [gate; up] weights of each draft layer, shared with the draft's own parameters.
        self.qkv = [merged_weight([l.self_attn.q_proj, l.self_attn.k_proj, l.self_attn.v_proj], l.self_attn,
                                  "_dflash_qkv")[0] for l in draft.layers]
        self.gate_up = [merged_weight([l.mlp.gate_proj, l.mlp.up_proj], l.mlp, "_dflash_gate_up")[0]
                        for l in draft.layers]
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
        self.context_start = torch.zeros(batch, **long)  # written by draft_round_setup at each draft step
        self.block_lens = torch.zeros(batch, **long)
        self.proposals = torch.zeros(batch, B - 1, **long)
        if cfg.dflash2 is not None:  # the selector's candidates and its distribution over them (sampled verify)
            top_k = draft.candidate_selector.top_k
            self.candidates = torch.zeros(batch, B - 1, top_k, **long)
            self.draft_q = torch.zeros(batch, B - 1, top_k, dtype=torch.float32, device=device)
        if tree_budget is not None:  # the draft's block logits (the LM head's dtype, or the draft's for a subset)
            vocab = cfg.draft_vocab_size or target_model.lm_head.weight.shape[0]
            logits_dtype = dtype if cfg.draft_vocab_size else target_model.lm_head.weight.dtype
            self.draft_logits = torch.zeros(batch, B - 1, vocab, dtype=logits_dtype, device=device)
        self.draft_block = torch.full((batch, B), cfg.mask_token_id if self.use_draft else 0, **long)  # [anchor, MASK...]
        self.features = torch.zeros(batch, B, cfg.num_taps * cfg.hidden_size, dtype=dtype, device=device)
        # Input rows of every draft layer's merged QKV GEMM: the block's normed rows (rows [0, batch*B), written
        # by each layer's add_rms_norm) over the context rows (rows [batch*B, 2*batch*B), fused_context's output).
        self.layer_in = torch.zeros(2 * batch * B, cfg.hidden_size, dtype=dtype, device=device)
        self.cu_block = torch.arange(batch + 1, device=device) * B
        # Per-call settings, written in place by reset() (a captured step keeps reading these tensors).
        self.temperature = torch.ones(batch, dtype=torch.float32, device=device)
        self.top_k = torch.zeros(batch, **long)
        self.top_p = torch.ones(batch, dtype=torch.float32, device=device)
        self.seed = torch.zeros(1, **long)
        self.offset = torch.zeros(1, **long)
        self.stop_tables: dict[int, torch.Tensor] = {}  # stop-table width -> [batch, width], -1 padded
        # Host-side settings of the current call; each combination is its own captured step.
        self.sampling = SamplingParams()
        self.stop_width = 0
        self.kv_bound = 0  # host-side bound on positions + scratch rows, grown by B per round (no sync)
        self.graphs: dict[tuple, object] = {}

    # ------------------------------------------------------------------ setup per generation
    def reset(self, prompts: Sequence[torch.Tensor], max_new_tokens: Sequence[int], stops: Sequence[list[int]],
              sampling: SamplingParams, seed: int) -> None:
        """Write the call's settings into the persistent buffers, prefill every request (eagerly, one
        at a time) and set the per-request state. ``stops[r]`` are request r's stop tokens (may be empty)."""
        if len(prompts) > self.batch:
            raise ValueError(f"reset: {len(prompts)} prompts for an engine of batch {self.batch}")
        generator = torch.Generator(device=self.device).manual_seed(seed)
        self.sampling = sampling
        self.temperature.fill_(max(sampling.temperature, GREEDY_EPS))  # read only when sampling
        self.top_k.fill_(sampling.top_k)
        self.top_p.fill_(sampling.top_p)
        self.seed.fill_(seed)
        self.offset.zero_()
        self.done.fill_(True)
        self.num_new.zero_()
        self.stop_width = max((len(s) for s in stops), default=0)
        if self.stop_width:
            table = self.stop_tables.get(self.stop_width)
            if table is None:
                table = self.stop_tables[self.stop_width] = torch.empty(
                    (self.batch, self.stop_width), dtype=torch.long, device=self.device)
            rows = [list(s) + [-1] * (self.stop_width - len(s)) for s in stops]
            rows += [[-1] * self.stop_width] * (self.batch - len(stops))
            table.copy_(torch.tensor(rows, dtype=torch.long))
        longest = 0
        for r, prompt in enumerate(prompts):
            p = prompt.shape[0]
            longest = max(longest, p)
            row = torch.tensor([r], device=self.device)
            for c0 in range(0, p, self.prefill_chunk):
                c1 = min(p, c0 + self.prefill_chunk)
                start = torch.full((1,), c0, dtype=torch.long, device=self.device)
                logits, feats = self.target.forward(prompt[None, c0:c1], start, c1, rows=row, last_logits_only=True)
                if self.use_draft:  # the chunk's context rows go straight into the draft cache
                    # the features in the draft's dtype, as the rounds' feature buffer holds them
                    ctx = self._context_rows(feats[0].to(self.features.dtype))
                    cu = torch.tensor([0, c1 - c0], device=self.device)
                    for li, layer in enumerate(self.draft.layers):
                        q_cols = layer.self_attn.num_heads * layer.self_attn.head_dim
                        self._inject(li, F.linear(ctx, self.qkv[li][q_cols:]), cu, start, cache_batch_idx=row)
            first = int(sample(logits[0, -1], sampling.temperature, sampling.top_p, sampling.top_k, generator))
            self.out_tokens[r, :p] = prompt
            self.out_tokens[r, p] = first
            self.lengths[r] = p + 1
            self.positions[r] = p
            self.anchor[r] = first
            self.max_lengths[r] = p + max_new_tokens[r]
            self.done[r] = first_token_done(first, stops[r], max_new_tokens[r])
        self._reset_kv_bound(longest)

    def fill_random_context(self, context: int, generator: torch.Generator | None = None) -> None:
        """Benchmark state without a prefill: :meth:`set_context` with random context rows (draft and target
        caches), features and anchors, drawn in place on the engine's device (``generator`` must live there):
        a host draw of a batch-8, 32k-context Qwen3-8B state would take minutes and twice its memory."""
        vocab = self.target_model.get_input_embeddings().weight.shape[0]
        rows = min(context + self.block_size, self.k_cache.shape[2])
        for cache in (self.k_cache, self.v_cache, self.target.k_cache, self.target.v_cache, self.features):
            (cache[:, :, :rows] if cache.dim() == 5 else cache).normal_(generator=generator)
        self.anchor.random_(0, vocab, generator=generator)
        self.set_context(context)

    def set_context(self, context: int) -> None:
        """Position every request after ``context`` cached rows, the last round having committed
        ``min(B, context)`` of them, none finished (the state a step sees mid-generation; values untouched)."""
        self.positions.fill_(context)
        self.num_new.fill_(min(self.block_size, context))
        self.max_lengths.fill_(self.capacity)
        self.done.fill_(False)
        self._reset_kv_bound(context)

    def _reset_kv_bound(self, longest: int) -> None:
        """Attention bound for the next round: captured steps need static shapes, so the whole cache;
        eagerly, the longest request's rows plus the scratch rows (grown by B per round)."""
        self.kv_bound = self.capacity + self.scratch_rows if self.graph_mode else longest + self.scratch_rows

    def _context_rows(self, features: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The draft's context rows ``hidden_norm(fc(features))`` of target feature rows ``[M, taps*H]``:
        ``fused_context``; where the backend's own linear kernel beats the fused ops' GEMM (not ``fused_gemm``: the
        CPU's ``cpu_linear``, whose fused_context path is its reference's fp32 GEMM, ~0.9 ms of a SmolLM2 draft step
        against ~0.2), its GEMM by the steps' ``linear``, then ``add_rms_norm``."""
        draft = self.draft
        eps = draft.config.rms_norm_eps
        if not self.traits.fused_gemm:
            return add_rms_norm(self.linear(features, draft.fc.weight), draft.hidden_norm.weight, eps, out=out,
                                backend=self.backend)
        return fused_context(features, draft.fc.weight, draft.hidden_norm.weight, eps, out=out, backend=self.backend)

    def _conv_kernels(self, conv, x: torch.Tensor) -> tuple[dict, dict]:
        """DFlash2's ``GroupedDynamicCausalConv`` dynamic kernels of x [n, B, H] (the projection GEMM by the steps'
        ``linear``) -> (``prepare``: the keyword arguments that convolve a GEMM's input, side 0's kernels [n, B, K,
        H/G] (a view) and ``base_kernel[0]``; ``finish``: those of the ``add_rms_norm`` after the sublayer, side 1's
        and ``base_kernel[1]``)."""
        n, B = x.shape[:2]
        dynamic = self.linear(x, conv.kernel_projection.weight).view(n, B, 2, conv.kernel_size, -1)
        return (dict(conv_dynamic=dynamic[:, :, 0], conv_base=conv.base_kernel[0]),
                dict(conv_dynamic=dynamic[:, :, 1], conv_base=conv.base_kernel[1]))

    def _conv_prepare(self, conv, x: torch.Tensor, out: torch.Tensor | None = None):
        """DFlash2's ``GroupedDynamicCausalConv.prepare`` on x [n, B, H] where the GEMMs do not fuse it (not
        ``fused_gemm``) -> (convolved x, into ``out`` when given; ``finish`` as :meth:`_conv_kernels` returns it):
        the projection GEMM, then ``grouped_dynamic_conv``."""
        prepare, finish = self._conv_kernels(conv, x)
        return grouped_dynamic_conv(x, prepare["conv_dynamic"], prepare["conv_base"], out=out,
                                    backend=self.backend), finish

    def _conv_mlp(self, conv, x: torch.Tensor, gate_up: torch.Tensor):
        """The MLP's ``silu(gate) * up`` of a DFlash2 layer on its normed input x [n, B, H], with ``prepare``
        before it -> (the activation, ``finish`` as :meth:`_conv_kernels` returns it). Where the GEMMs fuse
        (``fused_gemm``): the projection GEMM, then ``gate_up_silu`` with side 0's convolution in its x-tile load
        (the convolved rows are never written); elsewhere :meth:`_conv_prepare`, then the steps' gate/up path."""
        if not self.traits.fused_gemm:
            x, finish = self._conv_prepare(conv, x)
            return gate_up_act(x, gate_up, None, backend=self.backend, linear=self.linear), finish
        prepare, finish = self._conv_kernels(conv, x)
        return gate_up_silu(x, gate_up, backend=self.backend, **prepare), finish

    def _inject(self, li: int, kv: torch.Tensor, cu_lens, cache_lens, cache_batch_idx=None):
        """Layer ``li``'s context rows into its cache; ``kv`` [M, 2*kvH*D] holds their k_proj and v_proj columns."""
        attn = self.draft.layers[li].self_attn
        # view, not unflatten: Tensor.unflatten calls super() in Python, which torch.compile cannot trace under
        # a torch function mode such as torch.set_default_device's
        k, v = kv.view(*kv.shape[:-1], 2, attn.num_kv_heads, attn.head_dim).unbind(-3)
        inject_context_kv(k, v, attn.k_norm.weight, cu_lens, cache_lens, self.k_cache[li], self.v_cache[li],
                          inv_freq=self.inv_freq, attention_scaling=self.attention_scaling,
                          eps=self.draft.config.rms_norm_eps, cache_batch_idx=cache_batch_idx, backend=self.backend)

    # ------------------------------------------------------------------ the two steps
    def draft_step(self) -> None:
        """Inject last round's committed rows, run the draft over the block, write proposals."""
        draft, cfg, n, B = self.draft, self.draft.config, self.batch, self.block_size
        rows = n * B
        x_block = self.layer_in[:rows].view(n, B, -1)
        ctx = self._context_rows(self.features.view(rows, -1), out=self.layer_in[rows:])
        # [anchor, MASK...] block, the first context row committed last round, and the block rows to draft: the
        # reference drafts [anchor, MASK x (v-1)] with v = min(B, max_length - position); block rows at or beyond
        # v are masked out as keys, so rows < v see exactly that block.
        draft_round_setup(self.anchor, self.positions, self.num_new, self.max_lengths, block=self.draft_block,
                          context_start=self.context_start, block_lens=self.block_lens, backend=self.backend)
        h = F.embedding(self.draft_block, self.target_model.get_input_embeddings().weight).to(ctx.dtype)
        if cfg.input_embedding_scale != 1.0:
            h = h * cfg.input_embedding_scale
        # The residual stream h is updated in place: each sub-block's add is fused into the next norm. A DFlash2
        # draft convolves each request's block rows around both sublayers: prepare (_conv_prepare) before one, its
        # finish fused into the add_rms_norm after it (``finish``: that call's convolution arguments).
        delta = None
        finish = {}
        dflash2 = cfg.dflash2 is not None
        fused = self.traits.fused_gemm
        for li, layer in enumerate(draft.layers):
            attn, norm = layer.self_attn, layer.input_layernorm
            q_cols, kv_cols = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
            normed = add_rms_norm(h if delta is None else delta, norm.weight, norm.eps,
                                  residual=None if delta is None else h, out=x_block if fused or not dflash2 else None,
                                  backend=self.backend, **finish)
            # The merged QKV GEMM over the block rows, then the context rows (layer_in); where the GEMMs fuse, without
            # the context rows' Q columns (nothing reads them) and with a DFlash2 block's prepare in its x-tile load.
            if fused:
                prepare, finish = self._conv_kernels(layer.attention_conv, x_block) if dflash2 else ({}, {})
                qkv = qkv_proj(self.layer_in, self.qkv[li], q_cols=q_cols, q_rows=rows, backend=self.backend,
                               **prepare)
            else:
                if dflash2:
                    finish = self._conv_prepare(layer.attention_conv, normed, out=x_block)[1]
                qkv = self.linear(self.layer_in, self.qkv[li])
            # All B rows of every request are written; only num_new of them become valid context
            # (positions advanced by exactly that), so the shapes stay static.
            self._inject(li, qkv[rows:, q_cols:], self.cu_block, self.context_start)
            q = qkv[:rows, :q_cols].view(n, B, attn.num_heads, attn.head_dim)
            k = qkv[:rows, q_cols:q_cols + kv_cols].view(n, B, attn.num_kv_heads, attn.head_dim)
            v = qkv[:rows, q_cols + kv_cols:].view(n, B, attn.num_kv_heads, attn.head_dim)
            o = draft_attention(q, k, v, self.k_cache[li], self.v_cache[li], self.positions, attn.q_norm.weight,
                                attn.k_norm.weight, inv_freq=self.inv_freq, attention_scaling=self.attention_scaling,
                                eps=cfg.rms_norm_eps, sliding_window=attn.window, causal=attn.causal,
                                max_context_len=self.kv_bound, block_lens=self.block_lens, backend=self.backend)
            delta = self.linear(o.reshape(n, B, -1), attn.o_proj.weight)
            norm = layer.post_attention_layernorm
            x = add_rms_norm(delta, norm.weight, norm.eps, residual=h, backend=self.backend, **finish)
            if dflash2:
                act, finish = self._conv_mlp(layer.mlp_conv, x, self.gate_up[li])
            else:
                act = gate_up_act(x, self.gate_up[li], None, backend=self.backend, linear=self.linear)
            delta = self.linear(act, layer.mlp.down_proj.weight)
        if dflash2:  # the selector's walk from each request's anchor (rows past a tail block: unused)
            selector = draft.candidate_selector
            # A DFlash2 draft proposes from rows 1..B-1 over the full vocabulary (DFlashConfig checks both). The final
            # norm writes token-major rows [B, n, H], so rows 1..B-1 of every request lie contiguous: the LM head and
            # the selector's projection skip row 0 without a copy, and candidate_select reads their outputs strided.
            token_major = h.new_empty((B, n, h.shape[-1]))
            add_rms_norm(delta, draft.norm.weight, draft.norm.eps, residual=h, out=token_major.transpose(0, 1),
                         backend=self.backend, **finish)
            x = token_major[1:]
            logits = draft.compute_logits(x.to(self.target_model.lm_head.weight.dtype), self.target_model.lm_head,
                                          self.linear).transpose(0, 1)
            candidate_select(logits, self.linear(x, selector.hidden_projection.weight).transpose(0, 1),
                             selector.predecessor_codebook, selector.successor_codebook, self.anchor,
                             top_k=selector.top_k, temperature=None if self.sampling.greedy else self.temperature,
                             seed=self.seed, offset=self.offset, out=(self.proposals, self.candidates, self.draft_q),
                             backend=self.backend)
            return
        x = add_rms_norm(delta, draft.norm.weight, draft.norm.eps, residual=h, backend=self.backend, **finish)
        if self.tree_budget is None:
            draft.propose(x, self.target_model.lm_head, out=self.proposals, linear=self.linear)
        else:  # tree mode: the verify step builds the tree from all of the block's logits
            finite_tree_logits_(self.draft_logits.copy_(draft.block_logits(x, self.target_model.lm_head, self.linear)))

    def verify_step(self) -> None:
        """Target forward over [anchor, proposals] (or the draft tree), acceptance, commit."""
        filtered = self.sampling.filtered  # filters off: no threshold pass over the vocabulary
        sample_args = dict(temperature=self.temperature, top_k=self.top_k if filtered else 0,
                           top_p=self.top_p if filtered else 1.0, seed=self.seed, offset=self.offset,
                           backend=self.backend)
        # Greedy with an argmax head (the CPU's cpu_linear.linear_argmax screens most of the vocabulary instead of
        # computing it): the target's LM head returns its argmax, acceptance on those tokens.
        tokens_only = self.sampling.greedy and self.traits.argmax_head  # head: the logits, or their argmax
        if self.tree_budget is None:
            block = torch.cat([self.anchor[:, None], self.proposals], dim=1)
            head, feats = self.target.forward(block, self.positions, self.kv_bound, argmax=tokens_only)
            if tokens_only:
                accepted, bonus = verify_greedy_tokens(head, self.proposals, backend=self.backend)
            elif self.sampling.greedy:
                accepted, bonus = verify_greedy(head, self.proposals, backend=self.backend)
            elif self.draft.config.dflash2 is not None:  # proposals drawn from the selector's q over candidates
                accepted, bonus = verify_sample(head, self.proposals, draft_probs=self.draft_q,
                                                draft_indices=self.candidates, **sample_args)
            else:
                accepted, bonus = verify_sample(head, self.proposals, **sample_args)
            if feats is not None:
                self.features.copy_(feats)
            path_tokens = self.proposals
        else:
            B = self.block_size
            tokens, parents, depths = build_tree(self.draft_logits, self.anchor, self.tree_budget,
                                                 vocab_ids=self.draft.vocab_ids, backend=self.backend)
            if self.lookup_depth:
                tokens, parents, depths = tree_graft_lookup(tokens, parents, depths, self.out_tokens, self.lengths,
                                                            depth=self.lookup_depth, backend=self.backend)
            ancestors = tree_ancestor_mask(parents, backend=self.backend)
            head, feats = self.target.forward(tokens, self.positions, self.kv_bound, tree=(depths, ancestors),
                                              argmax=tokens_only)
            if tokens_only:
                path, accepted, bonus = tree_accept_greedy_tokens(head, tokens, parents, block_size=B,
                                                                  backend=self.backend)
            elif self.sampling.greedy:
                path, accepted, bonus = tree_accept_greedy(head, tokens, parents, block_size=B,
                                                           backend=self.backend)
            else:
                path, accepted, bonus = tree_accept_sample(head, tokens, parents, block_size=B, **sample_args)
            # The path's nodes (node i was written at row positions + i) move to rows positions + depth.
            tree_compact(self.target.k_cache, self.target.v_cache, path, accepted, self.positions,
                         backend=self.backend)
            nodes = path.clamp(min=0)  # -1 past the accepted depth: any node, those rows are never committed
            self.features.copy_(feats.gather(1, nodes[..., None].expand(-1, -1, feats.shape[-1])))
            path_tokens = tokens.gather(1, nodes[:, 1:])
        if not self.sampling.greedy:
            self.offset.add_(1)
        self.num_new.copy_(commit_round(path_tokens, accepted, bonus, out_tokens=self.out_tokens,
                                        lengths=self.lengths, positions=self.positions, anchor=self.anchor,
                                        done=self.done, max_lengths=self.max_lengths,
                                        stop_tokens=self.stop_tables.get(self.stop_width),
                                        # no value checks: they read the device on the host, and the values
                                        # are the steps' own (out of range, a request ends untouched)
                                        check=False,
                                        backend=self.commit_backend))

    # ------------------------------------------------------------------ running the steps
    def graph_key(self, name: str) -> tuple:
        """Everything that changes a captured step's work; batch and block size are fixed per engine."""
        if name == "draft":  # a DFlash2 selector picks by argmax or samples
            return (name,) if self.draft.config.dflash2 is None else (name, self.sampling.greedy)
        return (name, self.sampling.greedy, self.sampling.filtered, self.stop_width)

    def run_step(self, name: str) -> None:
        """Run the "draft" or "verify" step: eagerly, or by replaying its captured graph (captured on first use)."""
        step = {"draft": self.draft_step, "verify": self.verify_step}[name]
        if self.graph_mode is None:
            step()
            return
        key = self.graph_key(name)
        graph = self.graphs.get(key)
        if graph is None:
            graph = self.graphs[key] = capture(step, self.graph_mode, self.mutable_state())
        graph.replay()

    def round(self) -> tuple[float, float]:
        """One round; returns (draft seconds, verify seconds)."""
        t0 = device_clock(self.device)
        if self.use_draft:
            self.run_step("draft")
        t1 = device_clock(self.device)
        self.run_step("verify")
        t2 = device_clock(self.device)
        self.kv_bound = min(self.kv_bound + self.block_size, self.capacity + self.scratch_rows)
        return t1 - t0, t2 - t1

    def mutable_state(self) -> list[torch.Tensor]:
        """The buffers a step writes (besides the caches' scratch rows beyond each request's length)."""
        state = [self.out_tokens, self.lengths, self.positions, self.anchor, self.done, self.num_new,
                 self.proposals, self.features, self.offset]
        if self.draft.config.dflash2 is not None:
            state += [self.candidates, self.draft_q]
        return state if self.tree_budget is None else state + [self.draft_logits]

    def host_snapshot(self, n: int, tokens: bool) -> HostSnapshot:
        """The host's one read after a round: the first ``n`` requests' state in one device-to-host copy; with
        ``tokens``, each one's last B tokens too (a round commits at most B)."""
        B = self.block_size
        parts = [self.done[:n].long(), self.num_new[:n], self.lengths[:n]]
        if tokens:
            cols = (self.lengths[:n, None] - B + torch.arange(B, device=self.device)).clamp(min=0)
            parts.append(self.out_tokens[:n].gather(1, cols).flatten())
        values = torch.cat(parts).tolist()
        tails = values[3 * n:]
        last = [tails[r * B:(r + 1) * B] for r in range(n)]
        return HostSnapshot([bool(d) for d in values[:n]], values[n:2 * n], values[2 * n:3 * n], last)

    def generate(self, prompts: Sequence[torch.Tensor], max_new_tokens: Sequence[int], stops: Sequence[list[int]],
                 sampling: SamplingParams, seed: int, on_tokens=None) -> list[GenerateResult]:
        """Decode validated prompts (1-D, on the device) to the end; one :class:`GenerateResult` each, whose
        ``extra["round_times"]`` lists every round's (draft, verify, whole round incl. the host read) seconds.
        ``on_tokens(r, ids)`` is called with request r's newly committed tokens (the first token included).
        The host reads the device once per round (:meth:`host_snapshot`, ``HOST_READS_PER_ROUND``), streaming
        or not, and keeps what it read in Python values."""
        n = len(prompts)
        streaming = on_tokens is not None
        with torch.inference_mode():
            t0 = device_clock(self.device)
            self.reset(prompts, max_new_tokens, stops, sampling, seed)
            t1 = device_clock(self.device)
            state = self.host_snapshot(n, streaming)
            if streaming:
                for r in range(n):
                    on_tokens(r, state.last_tokens[r][-1:])
            acceptance: list[list[int]] = [[] for _ in prompts]
            round_times: list[tuple[float, float, float]] = []  # (draft, verify, whole round) seconds
            while not all(state.done):
                ta = time.perf_counter()
                dt, vt = self.round()
                was_done = state.done
                state = self.host_snapshot(n, streaming)
                round_times.append((dt, vt, time.perf_counter() - ta))
                for r, n_new in enumerate(state.num_new):
                    if not was_done[r]:
                        acceptance[r].append(n_new)
                    if streaming and n_new:
                        on_tokens(r, state.last_tokens[r][self.block_size - n_new:])
            total = device_clock(self.device) - t0
        return [
            GenerateResult(sequences=self.out_tokens[r:r + 1, :state.lengths[r]].clone(),
                           acceptance_lengths=acceptance[r], num_prompt_tokens=prompt.shape[0], prefill_time=t1 - t0,
                           draft_time=sum(t[0] for t in round_times), verify_time=sum(t[1] for t in round_times),
                           total_time=total, extra={"round_times": round_times})
            for r, prompt in enumerate(prompts)
        ]


class TargetSlot:
    """What :func:`dflash.generate` keeps per target model, as an attribute of the model (so it lives exactly
    as long as the model): the lock that serialises calls on the model, and the model's cached engine.

    One lock per target model, not per engine: the reference runtime taps the target's features with forward
    hooks on the model's own layers, so two calls on one target must not overlap in either runtime. A copy or
    pickle of the model gets a fresh, empty slot (a lock can be neither copied nor pickled)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.holder: int | None = None  # the thread inside a call on this model, if any
        self.engine: DFlashEngine | None = None
        self.key: tuple | None = None

    def __reduce__(self):
        return TargetSlot, ()


_SLOT_ATTR = "_dflash_slot"
_SLOTS_LOCK = threading.Lock()  # guards creating slots and every read or write of a slot's engine and key
# Held by every call on a CUDA target: capturing a step (torch.cuda.graph) must not overlap another thread's CUDA
# work. Reentrant: a call from on_tokens on another CUDA target, in the same thread, goes ahead.
_CUDA_LOCK = threading.RLock()


def target_slot(target_model) -> TargetSlot:
    """The model's :class:`TargetSlot`, created on first use."""
    with _SLOTS_LOCK:
        slot = target_model.__dict__.get(_SLOT_ATTR)
        if slot is None:
            slot = target_model.__dict__[_SLOT_ATTR] = TargetSlot()
        return slot


@contextlib.contextmanager
def target_lock(target_model):
    """Hold the target model's lock for one call: calls on one target model run one at a time, calls on
    different target models in parallel, except on CUDA, where all calls run one at a time. A call made from
    inside another on the same model and thread (from ``on_tokens``) would wait for itself forever: it raises
    instead."""
    slot = target_slot(target_model)
    if slot.holder == threading.get_ident():
        raise RuntimeError("dflash.generate was called on a target model from inside another call on the same "
                           "model in the same thread (from on_tokens?); return from on_tokens first")
    on_cuda = target_model.lm_head.weight.device.type == "cuda"
    with _CUDA_LOCK if on_cuda else contextlib.nullcontext(), slot.lock:
        slot.holder = threading.get_ident()
        try:
            yield
        finally:
            slot.holder = None


# A weak reference to the TargetSlot holding the one cached engine (at most one at a time, so a new engine never
# coexists with the old one's buffers), or None. Only the slot holds the engine, so dropping the target and draft
# frees them with it (a reference cycle: at the next garbage collection).
_cached_slot: weakref.ref | None = None


def _holding_slot() -> TargetSlot | None:
    """The slot holding the cached engine, if any (call under ``_SLOTS_LOCK``)."""
    slot = _cached_slot() if _cached_slot is not None else None
    return slot if slot is not None and slot.engine is not None else None


def cached_engine(target_model, draft: DraftModel, **options) -> DFlashEngine:
    """The engine of the previous call when the models and options are the same (its buffers and captured steps
    are reused, so repeated calls neither reallocate nor recapture), else a new one. Call and use it inside
    :func:`target_lock` of ``target_model``: the engine's state is one call's at a time."""
    global _cached_slot
    key = (DFlashEngine, tuple(sorted(options.items())))
    slot = target_slot(target_model)
    with _SLOTS_LOCK:
        if slot.engine is not None and slot.key == key and slot.engine.draft is draft:
            return slot.engine
        _drop_cached_engine()  # drop the old engine's buffers before allocating the new ones
        slot.engine, slot.key = DFlashEngine(target_model, draft, **options), key
        _cached_slot = weakref.ref(slot)
        return slot.engine


def _drop_cached_engine() -> None:
    global _cached_slot
    slot = _holding_slot()
    if slot is not None:
        slot.engine = slot.key = None
    _cached_slot = None


def current_engine() -> DFlashEngine | None:
    """The cached engine, or None."""
    with _SLOTS_LOCK:
        slot = _holding_slot()
        return None if slot is None else slot.engine


def clear_engine_cache() -> None:
    """Drop the cached engine: the next call builds a fresh one."""
    with _SLOTS_LOCK:
        _drop_cached_engine()


def unsupported_reason(target, draft: DraftModel) -> str | None:
    """Why backend='fast' cannot run this pair, or None."""
    model = target.model if hasattr(target, "layer_ids") else target
    try:
        check_lean_target(model)
    except TypeError as exc:
        return str(exc)
    if draft.config.attention_bias:
        return "draft uses attention_bias"
    return None

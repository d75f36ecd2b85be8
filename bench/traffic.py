"""Traffic and launch accountant: what one draft step and one verify step of ``DFlashEngine`` cost on a
GPU, counted without one.

The engine is built for a real configuration on the ``meta`` device (no weights, no caches are
allocated), the engine state is set to `context` cached rows per request, and each step runs once
under a ``TorchDispatchMode`` that records every dispatched op. Runs under ``torch.no_grad()`` (not
inference mode) so that composite ops decompose into the aten ops a GPU runs (``linear`` -> ``mm``,
``to`` -> ``_to_copy`` only when it copies). Launches are split into "pre" (before the first layer's
input norm), "layer" and "post" (from the final norm) by the first op that reads those norm weights.

Model, per recorded op (a model, not a measurement):
  launches  views / metadata / allocation ops are free (``OpOverload.is_view`` and FREE_OPS below);
            every other aten op is one kernel, except ``_safe_softmax`` (6: softmax, two scalar
            fills, eq, all, where, as ATen implements it). ``torch.ops.dflash.*`` per their
            contracts in dflash_kernels/README.md, on the Triton/ext GPU path:
            fused_context 1 GEMM + 1 RMSNorm unless the norm fuses into the epilogue (one split and
            one column tile covers H), inject_context_kv 1, draft_attention / verify_attention 1
            (split-KV, merged by the last split to finish; + 1 memset of its merge counters when the grid
            has more than one split), add_rms_norm 1, silu_mul 1, gate_up_silu 1 (2 above
            ``MAX_FUSED_ROWS`` rows: cuBLAS + silu_mul; 3 with a convolution in front), qkv_proj 1 (none when empty),
            verify_greedy 2, verify_sample 2 (+ the
            radix-select threshold's launches with top-k/top-p, ``threshold_launches``),
            commit_round 1 (the ext op), draft_round_setup 1. Draft trees (``--tree-budget``): build_tree 3 + ATen's
            logsumexp of the fp32 draft logits (assumed 9 kernels: amax, abs, eq, masked_fill_, sub,
            exp_, sum, log_, add_; +1 fp32 copy of 16-bit logits), tree_ancestor_mask 1,
            tree_accept_greedy 2, tree_accept_sample 3 (+ threshold), tree_compact 1. DFlash2 drafts
            (``--draft dflash2``): grouped_dynamic_conv 1, dynamic_conv_prepare 1, candidate_select 1.
  bytes     every distinct tensor operand read once and every output written once (stride-0,
            broadcast dimensions count once); an in-place op's mutated operand is written once and
            also read, except pure overwrites (copy_, fill_, zero_). Gathers and scatters move only
            the rows they touch: ``index`` / ``embedding`` read as many bytes as they write,
            ``index_put_`` reads the values and writes the same number of bytes. dflash ops per
            contract: draft_attention / verify_attention read the live context rows only
            (``context`` per request, not the capacity) plus the fp32 partials of all active splits but
            the merging one (the kernels' own rule), written and read once, and their merge counters;
            verify_attention also writes the block's K/V rows; add_rms_norm reads x, the weight and the
            residual and writes the output and the residual; silu_mul reads [.., 2I] and writes
            [.., I]; gate_up_silu reads x and the [2I, K] weight and writes [.., I] (+ a convolution's dynamic
            kernels and base in its x-tile load; + the [.., 2I] GEMM output written and read above
            ``MAX_FUSED_ROWS``: ``gate_up_silu_cost``); qkv_proj reads x once, the weight once per row tile of
            the GPU tiles (Q-only column tiles over the block rows only: once at up to 256 rows), a
            convolution's dynamic kernels and base once, and writes all but the context rows' Q columns
            (``qkv_proj_cost``); draft_round_setup reads four and
            writes three [N] int64 vectors (block[:, 0] is one); inject_context_kv reads the rows'
            projected K/V and writes only the injected rows; fused_context reads the taps and the fc
            weight once (+ fp32 split-K partials); the top-k/top-p threshold per
            ``threshold_bytes``. Split counts follow the kernels' own heuristics for an H200 (132 SMs).
            Trees: build_tree reads the draft logits once plus the logsumexp's passes over their fp32
            copy (read 4, read+write 2: 6 x 4 bytes per element, plus the copy) and the split top-K
            candidates; a tree verify_attention also reads its depths and ancestor mask;
            tree_compact moves every accepted depth's K/V rows in every layer (an upper bound: all
            B - 1 depths accepted, none already in place). grouped_dynamic_conv reads x, its dynamic
            kernels and base once and writes the output (add_rms_norm's convolution: the same reads, nothing
            written); dynamic_conv_prepare reads x, the projection and base once and writes the output
            and both sides' dynamic kernels; candidate_select reads the logits and projections once and,
            per position, the k candidates' and the predecessor's codebook rows, and writes path,
            candidates and q.
  FLOPs     mm / bmm / addmm 2*M*N*K; the attention ops 4*B*nH*D*(context + B) per request;
            fused_context and gate_up_silu their GEMMs (+ 4 per gate_up_silu output); everything else
            one per output element.
  floor     what the step cannot avoid moving: every weight it uses once (the embedding table only
            as the rows looked up; the LM head in full; a DFlash2 selector's codebooks only as the k + 1 rows
            per position it looks up), the live K/V once, the new K/V rows
            written once, the step's inputs and outputs (draft: fused-context features; verify:
            the tapped features written), and the logits written once and read once.
  time      device = max(bytes / 4.3 TB/s, FLOPs / 790 TFLOP/s) + the attention
            launches' split-KV merge tails (merge_ms_h200: the merging program's dependent L2 round trips,
            ``merge_round_trips``, x 0.3 us, assumed), which run after the splits, not under their traffic.
            4.3 TB/s is the H200 copy bandwidth measured on this project's device runs, 790 TFLOP/s the bf16
            dense rate. predicted_ms_h200: replayed in a CUDA graph, device + launches x 1.5 us (assumed);
            eager (--eager), the longer of device and host, the host's being the step's wall time on the
            meta engine, measured on this CPU (``host_step_ms``: wrappers, validation, dispatcher), + 4 us a
            launch for the launcher and the driver call, which a CPU cannot measure (assumed).
  round     round_ms_h200 (on both rows of a configuration): draft + verify predictions + the engine's host
            syncs per round (``dflash.engine.HOST_READS_PER_ROUND``, counted by the tests: the round's one
            packed device-to-host read of done flags, counts and lengths) x ``HOST_SYNC_US`` (assumed): the
            read waits for the verify step and the next round's launches wait for the read, in graph mode
            and eagerly alike. Steps alone (predicted_ms_h200) leave the sync out, as a step's timing does.

Usage: python bench/traffic.py [--model qwen3-8b] [--draft dflash|dflash2] [--batch 1,8] [--context 2k,32k]
       [--capacity 32k] [--block 16] [--tree-budget 16,32,64] [--eager] [--json] [--out DIR]
       (``dflash bench traffic`` runs this file)
"""
from __future__ import annotations

import argparse
import itertools
import statistics
import json
import math
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from dflash.engine import HOST_READS_PER_ROUND  # noqa: E402
from dflash_kernels.draft_attention import merge_round_trips, partial_slots, pick_max_splits  # noqa: E402
from dflash_kernels.gated_mlp import gate_up_silu_cost  # noqa: E402
from dflash_kernels.qkv_proj import qkv_proj_cost  # noqa: E402
from dflash_kernels.verify import threshold_bytes, threshold_launches  # noqa: E402

H200_BYTES_PER_S = 4.3e12
H200_FLOPS = 790e12
H200_SMS = 132
LAUNCH_US = {"graph": 1.5}  # one replayed launch (assumed)
# An eager launch's share of the host time a CPU cannot measure: the Triton launcher or ATen's launch and the CUDA
# driver's launch call (assumed); the rest of the host's time is measured (``host_step_ms``).
CUDA_LAUNCH_API_US = 4.0
# One dependent L2 round trip of an attention launch's merge tail (assumed: the merge's former 4 serial passes
# over 32 split slots, one dependent load per slot, were estimated at 25-45 us a layer at 32k context).
L2_ROUND_TRIP_US = 0.3
# One host sync of a round: a small device-to-host copy and the stream wait, until the host launches again (assumed).
HOST_SYNC_US = 15.0

# Target shapes from the Hugging Face configs; draft shapes of the z-lab checkpoints (the project's
# research notes, "z-lab DFlash": Qwen3-8B-DFlash-b16 and Qwen3-4B-DFlash-b16 have 5 layers, the
# target's hidden size, 32/8 heads of 128, the target's intermediate size, block 16, taps
# [1, 9, 17, 25, 33]; LLaMA3.1-8B-Instruct-DFlash-UltraChat lists taps [1, 8, 15, 22, 29] but not
# its layer count: 5 layers, the target's widths, is assumed). Taps = build_target_layer_ids(N, 5).
MODELS = {
    "qwen3-8b": dict(type="qwen3", hidden=4096, layers=36, heads=32, kv_heads=8, head_dim=128, inter=12288,
                     vocab=151936, draft_layers=5, draft_inter=12288, mask_token_id=151669, rope_theta=1e6),
    "qwen3-4b": dict(type="qwen3", hidden=2560, layers=36, heads=32, kv_heads=8, head_dim=128, inter=9728,
                     vocab=151936, draft_layers=5, draft_inter=9728, mask_token_id=151669, rope_theta=1e6),
    "llama-3.1-8b": dict(type="llama", hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128, inter=14336,
                         vocab=128256, draft_layers=5, draft_inter=14336, mask_token_id=128002, rope_theta=5e5),
    # hand-checkable size for the tests
    "tiny": dict(type="qwen3", hidden=64, layers=4, heads=4, kv_heads=2, head_dim=16, inter=128,
                 vocab=512, draft_layers=2, draft_inter=128, mask_token_id=510, rope_theta=1e6),
}
# DFlash2 drafts (``--draft dflash2``): the DFlash draft's body above plus DFlash2's convolutions and selector, at
# these settings. Assumed (no published Qwen3-8B DFlash2 config at hand): these are the defaults
# of speculators' DFlash2SpeculatorConfig (dflash.speculators.DFLASH2_DEFAULTS: K 2, G 16, rank 256, top-k 16).
DRAFTS = ("dflash", "dflash2")
DTYPE = torch.bfloat16

aten = torch.ops.aten
FREE_OPS = {  # no kernel: views, metadata, allocation (returns uninitialised memory)
    aten.view.default, aten._unsafe_view.default, aten.t.default, aten.transpose.int, aten.expand.default,
    aten.detach.default, aten.lift_fresh.default, aten.unsqueeze.default, aten.squeeze.dim, aten.select.int,
    aten.slice.Tensor, aten.permute.default, aten.alias.default, aten.as_strided.default, aten.reshape.default,
    aten.empty.memory_format, aten.empty_like.default, aten.new_empty.default, aten.empty_strided.default,
}
PURE_OVERWRITE = {aten.copy_.default, aten.fill_.Scalar, aten.zero_.default}
MATMULS = {aten.mm.default, aten.bmm.default, aten.addmm.default}


def build_models(model: str, capacity: int, block: int, device, dtype: torch.dtype = DTYPE, draft: str = "dflash"):
    """The HF target and the ``draft`` kind (``DRAFTS``) of draft of ``model`` (``MODELS``), built in ``dtype`` on
    ``device`` with HF's own initialisation (none on ``meta``)."""
    from transformers import LlamaConfig, Qwen3Config, LlamaForCausalLM, Qwen3ForCausalLM

    from dflash.config import DFlash2Settings, DFlashConfig, build_target_layer_ids
    from dflash.draft import DraftModel
    from dflash.model import DFlash2DraftModel
    from dflash.speculators import DFLASH2_DEFAULTS

    s = MODELS[model]
    cfg_cls, model_cls = (Qwen3Config, Qwen3ForCausalLM) if s["type"] == "qwen3" else (LlamaConfig, LlamaForCausalLM)
    tcfg = cfg_cls(vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["inter"],
                   num_hidden_layers=s["layers"], num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"],
                   head_dim=s["head_dim"], max_position_embeddings=max(40960, capacity + block),
                   tie_word_embeddings=False, rope_theta=s["rope_theta"])
    dcfg = DFlashConfig(hidden_size=s["hidden"], num_hidden_layers=s["draft_layers"], num_attention_heads=s["heads"],
                        num_key_value_heads=s["kv_heads"], head_dim=s["head_dim"], intermediate_size=s["draft_inter"],
                        num_target_layers=s["layers"],
                        target_layer_ids=build_target_layer_ids(s["layers"], s["draft_layers"]),
                        block_size=block, mask_token_id=s["mask_token_id"], vocab_size=s["vocab"],
                        max_position_embeddings=max(40960, capacity + block),
                        rope_parameters={"rope_type": "default", "rope_theta": s["rope_theta"]},
                        dflash2=DFlash2Settings(**DFLASH2_DEFAULTS) if draft == "dflash2" else None)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return model_cls(tcfg).eval(), (DFlash2DraftModel if draft == "dflash2" else DraftModel)(dcfg).eval()
    finally:
        torch.set_default_dtype(old)


def build_engine(model: str, batch: int, capacity: int, block: int, graphs: bool, tree_budget: int | None = None,
                 draft_kind: str = "dflash"):
    """``DFlashEngine`` for ``model`` and a ``draft_kind`` draft with every weight and buffer on the meta device
    (tree rounds of ``tree_budget`` + 1 nodes when given)."""
    from dflash.engine import DFlashEngine

    target, draft = build_models(model, capacity, block, "meta", draft=draft_kind)
    tree = {} if tree_budget is None else dict(tree_budget=tree_budget)
    return DFlashEngine(target, draft, batch=batch, capacity=capacity, block_size=block,
                        use_cuda_graphs="emulate" if graphs else False, **tree)


# ---------------------------------------------------------------------------------- the cost model
def distinct_bytes(t: torch.Tensor) -> int:
    """Bytes a tensor spans once: broadcast (stride-0) dimensions count once."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            n *= size
    return n * t.element_size()


def tensors_in(args) -> list[torch.Tensor]:
    out, seen = [], set()
    for a in args:
        for t in (a if isinstance(a, (list, tuple)) else [a]):
            if isinstance(t, torch.Tensor) and id(t) not in seen:
                seen.add(id(t))
                out.append(t)
    return out


def aten_cost(func, args, kwargs, out) -> tuple[int, int, int]:
    """(launches, bytes, FLOPs) of one aten op."""
    if func in FREE_OPS or func.is_view:
        return 0, 0, 0
    outs = tensors_in(out if isinstance(out, (list, tuple)) else [out])
    written = sum(distinct_bytes(t) for t in outs)
    flops = sum(t.numel() for t in outs)
    if func in (aten.index.Tensor, aten.embedding.default):
        reads = written + sum(distinct_bytes(t) for t in tensors_in(args[1:]))
        return 1, reads + written, 0
    if func is aten.index_put_.default:
        values = args[2]
        reads = sum(distinct_bytes(t) for t in tensors_in(args[1])) + distinct_bytes(values)
        return 1, reads + distinct_bytes(values), 0
    schema = func._schema.arguments
    values = [args[i] if i < len(args) else kwargs.get(a.name) for i, a in enumerate(schema)]
    mutated = {i for i, a in enumerate(schema) if a.alias_info is not None and a.alias_info.is_write}
    reads = sum(distinct_bytes(t) for t in tensors_in([a for i, a in enumerate(values) if i not in mutated]))
    if mutated:
        written = sum(distinct_bytes(t) for t in tensors_in([values[i] for i in mutated]))
        # out= arguments and pure overwrites are written without being read
        reads += sum(distinct_bytes(t) for t in tensors_in([values[i] for i in mutated if not schema[i].is_out]
                                                            if func not in PURE_OVERWRITE else []))
    if func in MATMULS:
        a, b = args[-2], args[-1]
        flops = 2 * a.shape[-2] * a.shape[-1] * b.shape[-1] * (a.shape[0] if a.dim() == 3 else 1)
    if func is aten._safe_softmax.default:  # softmax, eq(x, -inf), all, where; two scalar fills
        mask = args[0].numel()
        return 6, 2 * reads + 3 * written + 2 * mask, flops
    return 1, reads + written, flops


def dflash_cost(name: str, args, out, context: int) -> tuple[int, int, int]:
    """(launches, bytes, FLOPs) of one ``torch.ops.dflash.*`` op per its contract (dflash_kernels/README.md)."""
    nbytes = lambda ts: sum(distinct_bytes(t) for t in tensors_in(ts))  # noqa: E731
    if name == "fused_context":  # (taps, fc_weight, norm_weight, eps, out, backend)
        taps, fc_weight, norm_weight, out = args[0], args[1], args[2], args[4]
        n, h = out.shape
        k = fc_weight.shape[1]
        # _fused_context_triton's GPU tile and split-K choice
        block_m = 16 if n <= 16 else (32 if n <= 32 else 64)
        block_n = 32 if n <= 32 else 64
        block_k = 128 if n <= 32 else 64
        tiles = math.ceil(n / block_m) * math.ceil(h / block_n)
        k_tiles = math.ceil(k / block_k)
        split = max(1, min(8, k_tiles // 4, math.ceil(H200_SMS / tiles) * 2))
        split = math.ceil(k / (math.ceil(k_tiles / split) * block_k))
        fused = block_n >= h and split == 1
        partials = 0 if fused else 2 * split * n * h * 4
        return (1 if fused else 2), nbytes([taps, fc_weight, norm_weight]) + distinct_bytes(out) + partials, 2 * n * k * h
    if name == "inject_context_kv":  # (k, v, k_norm_weight, cu, cache_lens, k_cache, v_cache, inv_freq, ...)
        k, k_cache = args[0], args[5]
        written = 2 * k.numel() * k_cache.element_size()  # only the injected rows
        return 1, nbytes(args[:5]) + nbytes(args[7:8]) + written, 2 * k.numel()
    if name in ("draft_attention", "verify_attention"):
        q, k, v, k_cache, v_cache = args[:5]
        n, b, nh, d = q.shape
        kvh = k.shape[2]
        splits, slots = attention_splits(name, args, context)
        # fp32 partials (acc [B*nH, D], max, sum) of the active splits but the merging one, written once, read
        # once; with more than one active split, kvH pairs of int32 merge counters read and written per request;
        # with a grid of more than one split, the counters' memset (a launch) writes them first
        counters = n * kvh * 2 * 4
        partials = 2 * n * slots * b * nh * (d + 2) * 4 + (2 * counters if slots else 0)
        memset = counters if splits > 1 else 0
        live = 2 * n * context * kvh * d * k_cache.element_size()  # live context K/V only, not the capacity
        written = 2 * n * b * kvh * d * k_cache.element_size() if name == "verify_attention" else 0
        small = nbytes([q, k, v, *args[5:9]]) + nbytes([args[15]] if name == "draft_attention" else args[16:18])
        return (1 + (splits > 1), small + live + written + partials + memset + distinct_bytes(out),
                4 * n * b * nh * d * (context + b))
    if name == "add_rms_norm":  # x, weight (and the residual, read and written in place) -> out; + a convolution's
        x, weight, residual, out, conv_dynamic, conv_base = args[0], args[1], *args[3:7]  # dynamic kernels, base
        conv_flops = 0 if conv_dynamic is None else 2 * x.numel() * conv_base.shape[0]
        return (1, nbytes([x, weight, conv_dynamic, conv_base]) + 2 * nbytes([residual]) + distinct_bytes(out),
                4 * x.numel() + conv_flops)
    if name == "silu_mul":
        return 1, distinct_bytes(args[0]) + distinct_bytes(out), 4 * out.numel()
    if name == "gate_up_silu":  # (x, weight, out, conv_dynamic, conv_base, backend): the kernel module's own rule
        x, weight, conv_dynamic, conv_base = args[0], args[1], args[3], args[4]
        k, i = x.shape[-1], weight.shape[0] // 2
        m = x.numel() // k if k else 0
        conv = None if conv_dynamic is None else nbytes([conv_dynamic, conv_base])
        launches, moved = gate_up_silu_cost(m, k, i, x.element_size(), conv)
        conv_flops = 0 if conv is None else 2 * x.numel() * conv_base.shape[0]
        return launches, moved, 2 * m * k * 2 * i + 4 * m * i + conv_flops
    if name == "qkv_proj":  # (x, weight, out, q_cols, q_rows, conv_dynamic, conv_base, backend): the module's own rule
        x, weight, q_cols, q_rows, conv_dynamic, conv_base = args[0], args[1], *args[3:7]
        (m, k), n = x.shape, weight.shape[0]
        conv = None if conv_dynamic is None else nbytes([conv_dynamic, conv_base])
        launches, moved, _ = qkv_proj_cost(m, q_rows, k, n, q_cols, x.element_size(), conv)
        conv_flops = 0 if conv is None else 2 * q_rows * k * conv_base.shape[0]
        return launches, moved, 2 * k * (q_rows * n + (m - q_rows) * (n - q_cols)) + conv_flops
    if name == "verify_greedy":
        return 2, nbytes(args) + nbytes(out), args[0].numel()
    if name == "verify_sample":  # the sampling pass + acceptance, plus the radix-select threshold when filtering
        logits, use_top_k, use_top_p = args[0], args[7], args[8]
        rows, vocab = logits.numel() // logits.shape[-1], logits.shape[-1]
        return (2 + threshold_launches(use_top_k, use_top_p),
                nbytes(args) + nbytes(out) + threshold_bytes(rows, vocab, logits.element_size(), use_top_k, use_top_p),
                logits.numel())
    if name == "draft_round_setup":  # reads 4 [N] int64, writes block[:, 0], context_start and block_lens
        n = args[0].shape[0]
        return 1, 7 * n * 8, 3 * n
    if name == "commit_round":
        mutated = nbytes(args[3:8])
        return 1, nbytes(args) + mutated + distinct_bytes(out), 0
    if name == "build_tree":  # logsumexp (ATen, assumed 9 kernels + a copy) + top-K partial, merge, enumeration
        logits, budget = args[0], args[2]
        rows, vocab = logits.numel() // logits.shape[-1], logits.shape[-1]
        k = min(budget, vocab)
        copy = logits.dtype != torch.float32
        lse = rows * vocab * (4 * 6 + (logits.element_size() + 4 if copy else 0))
        candidates = 2 * rows * math.ceil(vocab / 2048) * k * 8  # (value, index) per split, written and read
        return 3 + 9 + int(copy), nbytes(args) + lse + candidates + 2 * rows * k * 8 + nbytes(out), 8 * rows * vocab
    if name == "tree_ancestor_mask":
        return 1, nbytes(args) + distinct_bytes(out), 0
    if name == "tree_accept_greedy":
        return 2, nbytes(args) + nbytes(out), args[0].numel()
    if name == "tree_accept_sample":
        logits, use_top_k, use_top_p = args[0], args[9], args[10]
        rows, vocab = logits.numel() // logits.shape[-1], logits.shape[-1]
        return (3 + threshold_launches(use_top_k, use_top_p),  # + the fill of the draft-token stand-in
                nbytes(args) + nbytes(out) + threshold_bytes(rows, vocab, logits.element_size(), use_top_k, use_top_p),
                logits.numel())
    if name == "tree_compact":  # upper bound: every depth 1..B-1 accepted and moved, K and V, read and written
        k_cache, path = args[0], args[2]
        layers, _, _, kvh, d = k_cache.shape
        moved = 2 * 2 * layers * path.shape[0] * (path.shape[1] - 1) * kvh * d * k_cache.element_size()
        return 1, nbytes(args[2:5]) + moved, 0
    if name == "grouped_dynamic_conv":  # (x, dynamic, base, out, backend)
        x, dynamic, base = args[:3]
        return 1, nbytes(args[:3]) + distinct_bytes(args[3]), 2 * x.numel() * base.shape[0]
    if name == "dynamic_conv_prepare":  # (x, projection, base, out, dynamic, backend): GEMM + conv epilogue
        x, projection, base = args[:3]
        gemm = 2 * x.numel() * projection.shape[0]
        return 1, nbytes(args[:3]) + nbytes(args[3:5]), gemm + 2 * x.numel() * base.shape[0]
    if name == "candidate_select":  # (logits, projected, predecessor, successor, anchor, top_k, temperature, seed,
        logits, projected, predecessor, top_k = args[0], args[1], args[2], args[5]  # offset, path, candidates, q)
        positions, rank = logits.numel() // logits.shape[-1], predecessor.shape[1]
        rows = positions * (top_k + 1) * rank * predecessor.element_size()  # k successor rows + 1 predecessor row
        return (1, nbytes([logits, projected, args[4], *args[6:9]]) + rows + nbytes(args[9:12]),
                positions * (logits.shape[-1] + 3 * top_k * rank))
    raise ValueError(f"traffic: no cost contract for torch.ops.dflash.{name}; add one to dflash_cost")


def attention_splits(name: str, args, context: int) -> tuple[int, int]:
    """(the grid's split count, partial slots a request writes) of a draft/verify_attention call on an H200 with
    ``context`` live rows per request: the kernels' own plan."""
    q, k, k_cache = args[0], args[1], args[3]
    num_splits, bound = (args[16], args[17]) if name == "draft_attention" else (args[14], args[15])
    bound = k_cache.shape[1] if bound is None else min(k_cache.shape[1], max(1, bound))
    splits = num_splits or pick_max_splits(q.shape[0], k.shape[2], bound, H200_SMS)
    return splits, partial_slots(context, splits)


def merge_latency_us(name: str, args, context: int) -> float:
    """The serial tail of an attention launch's split-KV merge: its dependent L2 round trips (the kernels' own
    count, ``merge_round_trips``) x ``L2_ROUND_TRIP_US``; 0 for other ops and for one active split."""
    if name not in ("draft_attention", "verify_attention"):
        return 0.0
    q, k = args[0], args[1]
    slots = attention_splits(name, args, context)[1]
    return merge_round_trips(slots + 1, q.shape[1] * (q.shape[2] // k.shape[2]), q.shape[3]) * L2_ROUND_TRIP_US


def storage_key(t: torch.Tensor) -> tuple[int, int]:
    return t.untyped_storage()._cdata, t.storage_offset()


class Accountant(TorchDispatchMode):
    """Records (phase, op, launches, bytes, FLOPs) of every op dispatched while active. ``phase`` is "pre"
    until an op reads the first layer's input-norm weight, "layer" until an op reads the final norm's
    weight, then "post" (the lean steps call the norm kernels with the weights, not the norm modules)."""

    def __init__(self, context: int, markers: dict[tuple[int, int], str] | None = None):
        super().__init__()
        self.context = context
        self.markers = markers or {}
        self.phase = "pre"
        self.records: list[tuple[str, str, int, int, int]] = []
        self.merge_us = 0.0  # the attention launches' serial merge tails (merge_latency_us), summed

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for t in tensors_in(args):
            self.phase = self.markers.get(storage_key(t), self.phase)
        out = func(*args, **kwargs)
        ns, name = func.namespace, func._schema.name.split("::")[-1]
        if ns == "dflash":
            cost = dflash_cost(name, args, out, self.context)
            self.merge_us += merge_latency_us(name, args, self.context)
        else:
            cost = aten_cost(func, args, kwargs, out)
        self.records.append((self.phase, f"{ns}.{name}", *cost))
        return out


def account(engine, step: str, context: int) -> Accountant:
    """Run ``engine``'s ``step`` ("draft" or "verify") once under an :class:`Accountant`."""
    if step == "draft":
        layers, final = engine.draft.layers, engine.draft.norm
    else:
        layers, final = engine.target_model.model.layers, engine.target_model.model.norm
    mode = Accountant(context, {storage_key(layers[0].input_layernorm.weight): "layer",
                                storage_key(final.weight): "post"})
    with torch.no_grad(), mode:
        getattr(engine, f"{step}_step")()
    return mode


def floor_bytes(engine, step: str, context: int) -> int:
    """The bytes ``step`` cannot avoid moving (see the module docstring)."""
    elem = torch.finfo(DTYPE).bits // 8
    n, B = engine.batch, engine.block_size
    if step == "verify" and getattr(engine, "tree_budget", None) is not None:
        B = engine.tree_budget + 1  # the tree's T nodes are the verified rows
    target, draft = engine.target_model, engine.draft
    H = target.config.hidden_size
    V = target.lm_head.weight.shape[0]
    params = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    logits = 2 * n * B * V * elem  # written once, read once
    if step == "draft":
        cfg = draft.config
        kv_row = cfg.num_key_value_heads * cfg.head_dim
        weights = params(draft) + target.lm_head.weight.numel()
        if cfg.dflash2 is not None:  # the codebooks: only the rows looked up (k candidates + the predecessor)
            selector = draft.candidate_selector
            weights += (n * (B - 1) * (selector.top_k + 1) * cfg.dflash2.selector_rank
                        - selector.predecessor_codebook.numel() - selector.successor_codebook.numel())
        kv = cfg.num_hidden_layers * n * kv_row * 2 * (context + B)  # live rows read + new rows written
        io = n * B * cfg.num_taps * H + n * B * H  # features read, block embedding rows read
        logits = 2 * n * (B - 1) * V * elem
    else:
        cfg = target.config
        kv_row = cfg.num_key_value_heads * engine.target.head_dim
        weights = params(target.model.layers) + params(target.model.norm) + target.lm_head.weight.numel()
        kv = cfg.num_hidden_layers * n * kv_row * 2 * (context + B)
        io = n * B * H + n * B * len(engine.target.layer_ids) * H  # embedding rows read, tapped features written
    return (weights + kv + io) * elem + logits


def host_step_ms(engine, step: str, reps: int = 5) -> float:
    """Host milliseconds of one eager ``step`` ("draft" or "verify"), measured on this CPU: the step run on the
    meta-device engine (median of ``reps`` runs after a warm-up), where every op costs what the host pays for it
    on a GPU (the Python wrappers and their validation, the dispatcher, ``torch.ops.dflash``'s round trip) but no
    device work: meta kernels only infer shapes. Not in it: the Triton launcher and the driver's launch call
    (``CUDA_LAUNCH_API_US`` per launch, assumed)."""
    run = getattr(engine, f"{step}_step")
    times = []
    with torch.no_grad():
        for i in range(reps + 1):
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]) * 1e3


def summarize(engine, step: str, context: int, mode: Accountant, launch_us: float | None) -> dict:
    """A step's totals and per-op table. ``launch_us``: the cost of one replayed launch (graph mode: the host
    launches the whole graph once), added to the device time; None: eager, where the host launches every kernel
    (``host_step_ms`` + the driver's call per launch) while the GPU runs behind it, so the step takes the longer
    of the host's time and the device's."""
    records = mode.records
    launches = sum(r[2] for r in records)
    nbytes = sum(r[3] for r in records)
    flops = sum(r[4] for r in records)
    layers = len(engine.draft.layers if step == "draft" else engine.target_model.model.layers)
    in_layers = sum(r[2] for r in records if r[0] == "layer")
    floor = floor_bytes(engine, step, context)
    roof_ms = max(nbytes / H200_BYTES_PER_S, flops / H200_FLOPS) * 1e3
    device_ms = roof_ms + mode.merge_us / 1e3
    if launch_us is None:
        launch_ms = host_step_ms(engine, step) + launches * CUDA_LAUNCH_API_US / 1e3
        predicted = max(device_ms, launch_ms)
    else:
        launch_ms = launches * launch_us / 1e3
        predicted = device_ms + launch_ms
    by_op: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0, 0])
    for _, op, la, by, fl in records:
        if la:
            agg = by_op[op]
            agg[0] += 1
            agg[1] += la
            agg[2] += by
            agg[3] += fl
    return {
        "step": step, "launches": launches, "launches_per_layer": in_layers / layers,
        "launches_outside_layers": launches - in_layers, "layers": layers,
        "bytes": nbytes, "floor_bytes": floor, "ratio": nbytes / floor, "flops": flops,
        "roofline_ms_h200": roof_ms, "launch_ms_h200": launch_ms, "merge_ms_h200": mode.merge_us / 1e3,
        "predicted_ms_h200": predicted,
        "floor_ms_h200": floor / H200_BYTES_PER_S * 1e3,
        "ops": {op: dict(calls=a[0], launches=a[1], bytes=a[2], flops=a[3]) for op, a in by_op.items()},
    }


# The goals per step (bytes / floor, launches per layer and outside the layers): the numbers to move toward.
GOALS = {"verify": dict(ratio=1.10, per_layer=12, outside=None), "draft": dict(ratio=1.05, per_layer=12, outside=8)}


def goal_text(step: str) -> str:
    g = GOALS[step]
    extra = f", <= {g['outside']} outside layers (fc/inject/head/argmax)" if g["outside"] else ""
    return f"goal: bytes <= {g['ratio']:.2f} x floor, <= {g['per_layer']} launches per layer{extra}"


def measure(model: str, batch: int, context: int, capacity: int, block: int, graphs: bool = True,
            tree_budget: int | None = None, draft: str = "dflash") -> list[dict]:
    """Both steps' summaries for one configuration (tree rounds of ``tree_budget`` + 1 nodes when given; a
    ``draft`` kind of ``DRAFTS``)."""
    engine = build_engine(model, batch, capacity, block, graphs, tree_budget, draft)
    engine.set_context(context)
    launch_us = LAUNCH_US["graph"] if graphs else None
    config = dict(model=model, draft=draft, batch=batch, context=context, capacity=capacity, block=block,
                  tree_budget=tree_budget or "", mode="graph" if graphs else "eager")
    rows = [{**config, **summarize(engine, step, context, account(engine, step, context), launch_us)}
            for step in ("draft", "verify")]
    sync_ms = HOST_READS_PER_ROUND * HOST_SYNC_US / 1e3
    round_ms = sum(r["predicted_ms_h200"] for r in rows) + sync_ms
    for r in rows:  # the cost of one launch: replayed (assumed), or eager (measured host cost, on average)
        r["launch_us"] = launch_us if graphs else r["launch_ms_h200"] * 1e3 / max(1, r["launches"])
        r.update(host_syncs_per_round=HOST_READS_PER_ROUND, sync_ms_h200=sync_ms, round_ms_h200=round_ms)
    return rows


def check_args(args) -> None:
    if args.model not in MODELS:
        raise SystemExit(f"--model {args.model!r}: choose one of {', '.join(MODELS)}")
    if args.draft not in DRAFTS:
        raise SystemExit(f"--draft {args.draft!r}: choose one of {', '.join(DRAFTS)}")
    for name in ("batch", "context"):
        values = common.parse_ints(getattr(args, name))
        if not values or min(values) < 1:
            raise SystemExit(f"--{name} {getattr(args, name)!r}: give positive integers (comma list, k = 1024)")
    capacity, block = common.parse_ints(args.capacity), args.block
    if len(capacity) != 1 or capacity[0] < 1:
        raise SystemExit(f"--capacity {args.capacity!r}: give one positive integer (k = 1024)")
    if block < 2:
        raise SystemExit(f"--block {block}: the draft step needs a block of at least 2")
    if args.tree_budget is not None and not all(1 <= t <= 64 for t in common.parse_ints(args.tree_budget) or [0]):
        raise SystemExit(f"--tree-budget {args.tree_budget!r}: give budgets in [1, 64] (comma list)")
    too_long = [c for c in common.parse_ints(args.context) if c > capacity[0]]
    if too_long:
        raise SystemExit(f"--context {too_long}: exceeds --capacity {capacity[0]}")


COLUMNS = ["model", "draft", "batch", "context", "tree_budget", "step", "launches", "launches_per_layer",
           "launches_outside_layers", "bytes_GB", "floor_GB", "ratio", "GFLOP", "merge_ms_h200", "predicted_ms_h200",
           "floor_ms_h200", "host_syncs_per_round", "round_ms_h200",
           "goal_ratio", "goal_per_layer", "goal_outside"]


def row_of(s: dict) -> dict:
    g = GOALS[s["step"]]
    return {**{k: v for k, v in s.items() if k != "ops"}, "bytes_GB": s["bytes"] / 1e9, "floor_GB": s["floor_bytes"] / 1e9,
            "GFLOP": s["flops"] / 1e9, "goal_ratio": g["ratio"], "goal_per_layer": g["per_layer"],
            "goal_outside": g["outside"] if g["outside"] else ""}


def print_human(s: dict, top: int) -> None:
    tree = f" tree budget {s['tree_budget']}" if s["tree_budget"] else ""
    print(f"\n== {s['model']} ({s['draft']} draft) batch {s['batch']} context {s['context']} capacity {s['capacity']} block {s['block']}"
          f"{tree} ({s['mode']}): {s['step']} step")
    print(f"launches {s['launches']} ({s['launches_per_layer']:.1f} per layer x {s['layers']}, "
          f"{s['launches_outside_layers']} outside layers); bytes {s['bytes'] / 1e9:.3f} GB vs floor "
          f"{s['floor_bytes'] / 1e9:.3f} GB = {s['ratio']:.2f}x; {s['flops'] / 1e9:.1f} GFLOP")
    if s["mode"] == "graph":
        print(f"model H200 time {s['predicted_ms_h200']:.3f} ms = roofline {s['roofline_ms_h200']:.3f} + split-KV "
              f"merge tails {s['merge_ms_h200']:.3f} + launches {s['launch_ms_h200']:.3f} ({s['launch_us']:.2f} us "
              f"each, replayed, assumed); floor {s['floor_ms_h200']:.3f} ms")
    else:
        print(f"model H200 time {s['predicted_ms_h200']:.3f} ms = the longer of the device's, roofline "
              f"{s['roofline_ms_h200']:.3f} + split-KV merge tails {s['merge_ms_h200']:.3f}, and the host's "
              f"{s['launch_ms_h200']:.3f} ({s['launch_us']:.2f} us a launch: measured on this CPU + "
              f"{CUDA_LAUNCH_API_US} us assumed); floor {s['floor_ms_h200']:.3f} ms")
    if s["step"] == "verify":
        print(f"model H200 round {s['round_ms_h200']:.3f} ms = draft + verify + {s['host_syncs_per_round']} host "
              f"sync(s) a round (counted: the engine's packed read) x {HOST_SYNC_US} us (assumed)")
    print(goal_text(s["step"]))
    print(common.table(op_rows(s, top), OP_COLUMNS))


OP_COLUMNS = ["op", "calls", "launches", "MB", "pct_bytes", "GFLOP"]


def op_rows(s: dict, top: int) -> list[dict]:
    """The ``top`` op kinds of a step by bytes."""
    ops = sorted(s["ops"].items(), key=lambda kv: -kv[1]["bytes"])[:top]
    return [dict(op=op, calls=a["calls"], launches=a["launches"], MB=a["bytes"] / 1e6,
                 pct_bytes=100 * a["bytes"] / s["bytes"], GFLOP=a["flops"] / 1e9) for op, a in ops]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="qwen3-8b", help=f"one of {', '.join(MODELS)}")
    p.add_argument("--draft", default="dflash", help=f"draft kind, one of {', '.join(DRAFTS)} (default dflash)")
    p.add_argument("--batch", default="1", help="comma list (default 1)")
    p.add_argument("--context", default="2k", help="cached rows per request, comma list, k = 1024 (default 2k)")
    p.add_argument("--capacity", default="32k", help="engine capacity in tokens (default 32k)")
    p.add_argument("--block", type=int, default=16, help="block size (default 16)")
    p.add_argument("--tree-budget", default=None, help="tree rounds (DDTree) of these node budgets, comma list "
                   "(1..64); default: chain rounds")
    p.add_argument("--eager", action="store_true", help="eager steps (attend up to context + block, 4 us per "
                   "launch); default: captured steps as on a GPU (attend over the whole capacity, 1.5 us per launch)")
    p.add_argument("--json", action="store_true", help="one JSON object per step, nothing else")
    p.add_argument("--top", type=int, default=12, help="op kinds in the per-op table (default 12)")
    p.add_argument("--out", help="also write <stem>.csv and <stem>.md into this folder")
    p.add_argument("--tag", default=None, help="file stem for --out (default traffic-<model>)")
    args = p.parse_args(argv)
    check_args(args)
    t0 = time.perf_counter()
    results = []
    budgets = [None] if args.tree_budget is None else common.parse_ints(args.tree_budget)
    for batch, context, budget in itertools.product(common.parse_ints(args.batch), common.parse_ints(args.context),
                                                    budgets):
        for s in measure(args.model, batch, context, common.parse_ints(args.capacity)[0], args.block,
                         graphs=not args.eager, tree_budget=budget, draft=args.draft):
            results.append(s)
            if args.json:
                print(json.dumps(s))
            else:
                print_human(s, args.top)
    if not args.json:
        print(f"\n{common.table([row_of(s) for s in results], COLUMNS)}")
        print(f"# {time.perf_counter() - t0:.1f} s on this CPU (meta tensors: nothing computed or allocated)")
    if args.out:
        out = common.out_dir(args.out)
        stem = args.tag or f"traffic-{args.model}"
        common.write_csv(out / f"{stem}.csv", [row_of(s) for s in results])
        with open(out / f"{stem}.md", "w") as f:
            f.write(f"# Traffic and launches per step: {args.model} (model, not a measurement)\n\n")
            f.write("Goals (issue 12): " + "; ".join(f"{k}: {goal_text(k)[6:]}" for k in ("draft", "verify")) + "\n\n")
            f.write(common.table([row_of(s) for s in results], COLUMNS, markdown=True) + "\n")
            for s in results:
                f.write(f"\n## {s['step']}, batch {s['batch']}, context {s['context']}: top ops by bytes\n\n")
                f.write(common.table(op_rows(s, args.top), OP_COLUMNS, markdown=True) + "\n")
        if not args.json:
            print(f"# wrote {out / stem}.csv and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())

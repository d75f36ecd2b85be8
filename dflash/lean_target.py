"""A lean LLaMA/Qwen3 decoder forward over a Hugging Face model's own weights (no copies), with a
static, preallocated KV cache and per-request lengths read from device memory.

Why not HF's forward: a ragged batch whose requests accept different numbers of tokens needs
per-request cache lengths, rollback by simply not advancing a length, static shapes for CUDA-graph
capture, and the tapped layers written straight into a buffer. And the verify step must run at its
memory floor, so each layer is seven kernels on the GPU:

  add_rms_norm (previous residual add + input norm) -> merged QKV GEMM -> verify_attention (q/k norm,
  RoPE, cache write, attention over the live rows; split-KV merged in-kernel) -> o_proj -> add_rms_norm ->
  gate_up_silu (merged gate/up GEMM, silu·mul in its epilogue) -> down_proj

On the "cpu" backend the projections take ``cpu_linear`` (q/k/v and gate/up as row blocks of one call, with no
merged copy) and the activation stays a ``silu_mul`` after the gate/up GEMM (``gate_up_act``). Where the kernel
library has a whole forward for the model and shape (``dflash_kernels.cpu.forward``: on the CPU, up to a prefill
chunk's rows a request, one native call for the layers; the same kernels and bits, without the ops' per-call Python)
it runs that, else the layer loop below.

The residual add of each sub-block is fused into the next norm; off the "cpu" backend ``merged_weight``
re-points the HF modules' q/k/v and gate/up parameters at views of one buffer per layer, so the model itself keeps
working unchanged. Numerics follow HF's modules (the kernels' torch references are HF's formulas).
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
import torch.nn.functional as F

from dflash_kernels.cpu import linear as cpu_linear
from dflash_kernels.cpu.forward import NativeForward
from dflash.merged_linear import merged_weight, row_blocks
from dflash.target import check_target
from dflash_kernels import add_rms_norm, gate_up_silu, silu_mul, unobserved_eager, verify_attention

LEAN_MODEL_TYPES = ("llama", "qwen3")
# Blocks of more rows (prefill chunks) take the attention reference on the Triton backend: the kernel's tile holds
# B x G query rows ("cpu" runs any block).
MAX_KERNEL_ROWS = 64
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
NATIVE_SHAPES = 4  # native forwards kept per target (decode, verify, tree, a prefill tail)


def check_lean_target(model) -> None:
    check_target(model)
    cfg = model.config
    if cfg.model_type not in LEAN_MODEL_TYPES:
        raise TypeError(
            f"target: backend='fast' supports {LEAN_MODEL_TYPES} targets, got model_type {cfg.model_type!r}; "
            "use backend='reference'"
        )
    if getattr(cfg, "use_sliding_window", False) and getattr(cfg, "sliding_window", None):
        raise TypeError("target: sliding-window targets are not supported by backend='fast'; use backend='reference'")
    rope_type = getattr(model.model.rotary_emb, "rope_type", "default")
    if rope_type not in STATIC_ROPE_TYPES:
        raise TypeError(f"target: rope_type {rope_type!r} changes its frequencies with the length; backend='fast' "
                        f"supports {STATIC_ROPE_TYPES}; use backend='reference'")


def linear_for(backend: str):
    """The linear layer of the lean steps for a kernel backend: the CPU skinny-GEMM kernel with "cpu", else
    ``F.linear`` (the references' own, so compiled and eager steps stay bit-equal)."""
    return cpu_linear.linear if backend == "cpu" else F.linear


def gate_up_act(x, weight, bias, *, backend: str, linear, validate: bool = True) -> torch.Tensor:
    """``silu(gate) * up`` of a merged ``[gate; up]`` projection: one ``gate_up_silu`` launch (GEMM with the
    activation in its epilogue) where it applies, else the GEMM (``linear``) then ``silu_mul``: with a bias,
    and on the "cpu" backend, whose GEMM is ``cpu_linear`` (``weight``, ``bias``: the gate and up row blocks
    there). ``validate``: the kernels' argument checks."""
    if backend == "cpu" or bias is not None:
        return silu_mul(linear(x, weight, bias), backend=backend, validate=validate)
    return gate_up_silu(x, weight, backend=backend)


class _LayerParams(NamedTuple):
    """One decoder layer's tensors and constants as the forward reads them (module attribute lookups cost
    about 1 us each, ~15 per layer per step on the CPU). The tensors are the modules' own parameters: in-place
    updates are seen; a parameter replaced by another object is not (as with ``merged_weight``)."""

    input_norm: torch.Tensor
    input_eps: float
    q_norm: torch.Tensor | None  # Qwen3: per-head RMSNorm before RoPE
    k_norm: torch.Tensor | None
    qk_norm_eps: float
    scale: float
    o_weight: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    post_eps: float
    down_weight: torch.Tensor
    down_bias: torch.Tensor | None


def _layer_params(layer) -> _LayerParams:
    attn, down = layer.self_attn, layer.mlp.down_proj
    qn, kn = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    return _LayerParams(layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon,
                        None if qn is None else qn.weight, None if kn is None else kn.weight,
                        qn.variance_epsilon if qn is not None else 1e-6, attn.scaling, attn.o_proj.weight,
                        attn.o_proj.bias, layer.post_attention_layernorm.weight,
                        layer.post_attention_layernorm.variance_epsilon, down.weight, down.bias)


class LeanTarget:
    """Static-cache forward of a causal LM for ``batch`` requests of at most ``capacity`` tokens."""

    def __init__(self, model, layer_ids: Sequence[int], *, batch: int, capacity: int, backend: str = "torch"):
        check_lean_target(model)
        self.model = model
        self.layer_ids = list(layer_ids)
        self.taps: dict[int, list[int]] = {}  # layer -> its feature slots (a layer may be tapped twice)
        for t, li in enumerate(self.layer_ids):
            self.taps.setdefault(li, []).append(t)
        self.backend = backend
        self.linear = linear_for(backend)
        cfg = model.config
        first = model.model.layers[0].self_attn
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = first.head_dim
        rotary = model.model.rotary_emb
        self.inv_freq = rotary.inv_freq.float()
        self.attention_scaling = float(rotary.attention_scaling)
        # The q/k/v and gate/up projections of a layer as one GEMM each: over a merged copy of their weights
        # (merged_weight), or on the "cpu" backend over their row blocks where they are (cpu_linear reads up to
        # three as one weight: no copy, which would cost ~0.25 s of a first call for SmolLM2).
        def stacked(linears, owner, name):
            return row_blocks(linears, name) if backend == "cpu" else merged_weight(linears, owner, name)

        self.qkv = [stacked([l.self_attn.q_proj, l.self_attn.k_proj, l.self_attn.v_proj], l.self_attn, "_dflash_qkv")
                    for l in model.model.layers]
        self.gate_up = [stacked([l.mlp.gate_proj, l.mlp.up_proj], l.mlp, "_dflash_gate_up")
                        for l in model.model.layers]
        self.layers = [_layer_params(l) for l in model.model.layers]
        weight = model.lm_head.weight
        shape = (len(model.model.layers), batch, capacity, self.num_kv_heads, self.head_dim)
        self.k_cache = torch.zeros(shape, dtype=weight.dtype, device=weight.device)
        self.v_cache = torch.zeros_like(self.k_cache)
        self.capacity = capacity
        self._natives: dict[tuple[int, int], NativeForward] = {}  # (requests, rows) -> its native forward
        self._native_ok: bool | None = None  # NativeForward.supports(self), on first use

    def forward(self, input_ids: torch.Tensor, start: torch.Tensor, kv_bound: int,
                rows: torch.Tensor | None = None, tree: tuple[torch.Tensor, torch.Tensor] | None = None,
                last_logits_only: bool = False, argmax: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run ``q`` new tokens per request.

        Args:
            input_ids: [N, q] tokens at positions ``start[n] + 0..q-1``.
            start: [N] int64 on the device: cached tokens per request (= position of the first new token).
            kv_bound: host-side upper bound on ``start + q`` over requests (static per call site, no sync).
            rows: [N] int64 cache rows of the requests (default 0..N-1).
            tree: None (the q tokens are a causal chain) or a draft tree ``(depths [N, q], ancestor bitmask
                [N, q, ceil(q/64)])`` (``build_tree``, ``tree_ancestor_mask``): token i sits at position
                ``start[n] + depths[n, i]``, its K/V at cache row ``start[n] + i``, and it attends to the
                cached rows and its ancestors.
            last_logits_only: the LM head of the last token only (a prefill chunk, whose other logits nobody
                reads: a 50-token prompt's head would be ~3 GFLOP).
            argmax: return the logits' argmax (int64 [N, q], or [N, 1]), exactly ``logits.argmax(-1)`` of this
                forward; on the "cpu" backend without computing most logits (``cpu_linear.linear_argmax``).
        Returns:
            logits [N, q, V] ([N, 1, V] with ``last_logits_only``; their argmax with ``argmax``) and the tapped
            features [N, q, T*H] (None when there are no taps).
        """
        model, linear = self.model, self.linear
        n, q = input_ids.shape
        # On the CPU, in plain eager calls (not traced or recorded), the host read is free.
        if start.device.type == "cpu" and n and q and unobserved_eager() and int(start.max()) + q > self.capacity:
            raise ValueError(f"LeanTarget.forward: start + {q} rows reaches cache row {int(start.max()) + q}, past the "
                             f"{self.capacity} rows of the cache (capacity); build the target with a larger capacity "
                             "or pass fewer rows")
        native = self._native_forward(n, q)  # the kernel library's whole forward, where it has one for this shape
        out = None if native is None else native.forward(self, input_ids, start, rows, tree, last_logits_only, argmax)
        if out is not None:
            return out
        nh, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        attn_backend = self.backend if q <= MAX_KERNEL_ROWS or self.backend == "cpu" else "torch"
        h = F.embedding(input_ids, model.model.embed_tokens.weight)  # the residual stream, updated in place
        hidden = h.shape[-1]
        features = h.new_empty((n, q, len(self.layer_ids) * hidden)) if self.layer_ids else None
        taps = self.taps
        delta = None
        for li, p in enumerate(self.layers):
            # The kernels check their arguments in the first layer; the layers after it pass the same shapes,
            # dtypes and devices (one config for every layer), and on the CPU the checks cost milliseconds a step.
            first = li == 0
            x = add_rms_norm(h if delta is None else delta, p.input_norm, p.input_eps,
                             residual=None if delta is None else h, backend=self.backend, validate=first)
            self.copy_taps(features, taps, li - 1, h)
            w, b = self.qkv[li]
            qkv = linear(x, w, b)
            qh = qkv[..., :nh * d].view(n, q, nh, d)
            kh = qkv[..., nh * d:(nh + kvh) * d].view(n, q, kvh, d)
            vh = qkv[..., (nh + kvh) * d:].view(n, q, kvh, d)
            o = verify_attention(qh, kh, vh, self.k_cache[li], self.v_cache[li], start, p.q_norm, p.k_norm,
                                 inv_freq=self.inv_freq, attention_scaling=self.attention_scaling,
                                 eps=p.qk_norm_eps, scale=p.scale, cache_batch_idx=rows, max_context_len=kv_bound,
                                 backend=attn_backend, tree_depths=None if tree is None else tree[0],
                                 tree_mask=None if tree is None else tree[1], validate=first)
            delta = linear(o.view(n, q, nh * d), p.o_weight, p.o_bias)
            x = add_rms_norm(delta, p.post_norm, p.post_eps, residual=h, backend=self.backend, validate=first)
            w, b = self.gate_up[li]
            act = gate_up_act(x, w, b, backend=self.backend, linear=linear, validate=first)
            delta = linear(act, p.down_weight, p.down_bias)
        norm = model.model.norm
        x = add_rms_norm(delta, norm.weight, norm.variance_epsilon, residual=h, backend=self.backend)
        self.copy_taps(features, taps, len(self.layers) - 1, h)
        if last_logits_only:
            x = x[:, -1:]
        return self.head(x, argmax), features

    def head(self, x: torch.Tensor, argmax: bool) -> torch.Tensor:
        """The LM head of the final-normed rows ``x [..., H]``: logits ``[..., V]``, or their argmax ``[...]``
        (int64; on the "cpu" backend without computing most logits: ``cpu_linear.linear_argmax``)."""
        lm_head = self.model.lm_head
        if not argmax:
            return self.linear(x, lm_head.weight, lm_head.bias)
        if self.backend == "cpu":
            return cpu_linear.linear_argmax(x, lm_head.weight, lm_head.bias)
        return self.linear(x, lm_head.weight, lm_head.bias).argmax(-1)

    def _native_forward(self, n: int, q: int) -> NativeForward | None:
        """The native forward of this shape, or None where the kernel library has none (it decides: backend,
        dtypes, layout, rows); built on first use, the last few shapes kept."""
        if self._native_ok is None:
            self._native_ok = NativeForward.supports(self)
        if not (self._native_ok and NativeForward.available(n, q)):
            return None
        native = self._natives.pop((n, q), None) or NativeForward(self, n, q)
        self._natives[(n, q)] = native  # most recent last
        while len(self._natives) > NATIVE_SHAPES:
            self._natives.pop(next(iter(self._natives)))
        return native

    @staticmethod
    def copy_taps(features, taps: dict[int, list[int]], li: int, h: torch.Tensor) -> None:
        """Copy layer ``li``'s output (the residual stream once its last add is done) into its feature slots."""
        hidden = h.shape[-1]
        for t in taps.get(li, ()):
            features[..., t * hidden:(t + 1) * hidden].copy_(h)

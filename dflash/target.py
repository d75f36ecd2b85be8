"""Target adapter: a Hugging Face LLaMA/Qwen3 causal LM that also returns the tapped features.

Features are the outputs of decoder layers ``target_layer_ids`` (0-based; HF
``hidden_states[id + 1]``), captured with forward hooks and concatenated in list order, so the
other layers' hidden states are never materialised.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

SUPPORTED_MODEL_TYPES = ("llama", "qwen3", "qwen2", "mistral")


@dataclass
class TargetOutput:
    logits: torch.Tensor  # [b, n_logits, V]
    features: torch.Tensor | None  # [b, n, T*H], None when no taps were requested


def extract_context_feature(hidden_states: Sequence[torch.Tensor], layer_ids: Sequence[int]) -> torch.Tensor:
    """z-lab helper: concatenate HF ``hidden_states[id + 1]`` for each tapped layer id."""
    offset = 1
    return torch.cat([hidden_states[i + offset] for i in layer_ids], dim=-1)


def check_target(model, *, what: str = "target") -> None:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise TypeError(
            f"{what}: model_type {model_type!r} is not supported; pass a Hugging Face causal LM of the "
            f"LLaMA/Qwen3 family ({', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    for attr in ("model", "lm_head"):
        if not hasattr(model, attr):
            raise TypeError(f"{what}: {type(model).__name__} has no .{attr}; pass an *ForCausalLM model")


class TargetAdapter:
    """Runs the target with a KV cache and returns logits plus tapped features."""

    def __init__(self, model, target_layer_ids: Sequence[int]):
        check_target(model)
        self.model = model
        self.layer_ids = list(target_layer_ids)
        layers = model.model.layers
        for i in self.layer_ids:
            if not 0 <= i < len(layers):
                raise ValueError(
                    f"target_layer_ids: layer {i} is out of range for a target with {len(layers)} decoder layers"
                )

    @property
    def config(self):
        return self.model.config

    @property
    def device(self) -> torch.device:
        return self.model.lm_head.weight.device

    @property
    def embed_weight(self) -> torch.Tensor:
        return self.model.get_input_embeddings().weight

    @property
    def lm_head(self):
        return self.model.lm_head

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        past_key_values,
        *,
        with_features: bool,
        logits_to_keep: int = 0,
        attention_mask: torch.Tensor | None = None,
    ) -> TargetOutput:
        """input_ids/position_ids [b, n]; appends to ``past_key_values`` (a ``DynamicCache``).

        ``logits_to_keep=0`` returns logits for every row, k > 0 for the last k rows. ``attention_mask``:
        None = causal, or an additive [b, 1, n, cached + n] mask (tree verification)."""
        captured: dict[int, torch.Tensor] = {}
        handles = []
        if with_features:
            layers = self.model.model.layers

            def hook(idx):
                def fn(_module, _args, output):
                    captured[idx] = output[0] if isinstance(output, tuple) else output

                return fn

            handles = [layers[i].register_forward_hook(hook(i)) for i in sorted(set(self.layer_ids))]
        try:
            out = self.model(
                input_ids=input_ids,
                position_ids=position_ids,
                past_key_values=past_key_values,
                attention_mask=attention_mask,
                use_cache=True,
                logits_to_keep=logits_to_keep,
            )
        finally:
            for h in handles:
                h.remove()
        features = torch.cat([captured[i] for i in self.layer_ids], dim=-1) if with_features else None
        return TargetOutput(logits=out.logits, features=features)

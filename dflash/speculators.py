"""DFlash checkpoints of vLLM's ``speculators`` training library, mapped to the z-lab form.

Schema read from vllm-project/speculators ``src/speculators/models/dflash/{config,core}.py``,
``src/speculators/model.py`` (``DraftVocabMixin``), ``src/speculators/train/vocab_mapping.py`` and
``src/speculators/convert/dflash/converter.py``, releases v0.5.0 to v0.7.0.1 (commit c05b95b).
A speculators DFlash ``config.json`` has ``speculators_model_type: "dflash"`` and:

* ``transformer_layer_config``: the draft layers' Qwen3 config, saved as a diff against the
  transformers class defaults (so missing keys take *that class's* defaults, filled here the same way);
* ``aux_hidden_state_layer_ids``: tapped target layers counted from the embedding output, i.e. z-lab's
  ``target_layer_ids`` + 1 (z-lab reads ``hidden_states[i + 1]``);
* ``draft_vocab_size``: rows of the draft's LM head; below the target vocabulary the checkpoint holds
  ``d2t`` (int64 offsets: target id = draft index + ``d2t[index]``) and ``t2d`` (bool mask over the
  target vocabulary) — mapped to this project's ``draft_token_ids`` (absolute target ids);
* ``block_size``, ``mask_token_id``, ``target_hidden_size`` (must equal the draft width here),
  ``sliding_window_non_causal`` (v0.6: sliding layers attend non-causally inside the block; mapped to
  ``is_causal: false``), ``sample_from_anchor`` (v0.7: the anchor row predicts the next token);
  ``max_anchors`` (v0.5) and ``speculators_config`` (proposal/verifier metadata) are training or
  serving settings and are not needed to run the draft.

Weights: the draft body has z-lab's names (``fc``, ``hidden_norm``, ``norm``, ``layers.*``);
``embed_tokens``, ``lm_head`` (the verifier's head rows ``t2d`` selects), ``verifier_lm_head`` and
``verifier_norm`` are frozen copies of the target's own tensors, so the target's are used instead.

DFlash2 (``speculators_model_type: "dflash2"``, ``src/speculators/models/dflash2/``): the same schema plus
``conv_kernel_size``, ``conv_group_size``, ``selector_rank``, ``selector_top_k`` at the top level (defaults 2,
16, 256, 16), mapped to ``architectures: ["DFlash2DraftModel"]`` and the z-lab ``dflash_config`` keys; its
convolution and selector tensors already have the z-lab names (see :mod:`dflash.dflash2`). It needs the full
target vocabulary and ``sample_from_anchor`` false, as speculators itself requires.
"""
from __future__ import annotations

from typing import Any

import torch

MODEL_TYPE_KEY = "speculators_model_type"
# DFlash2SpeculatorConfig's fields (flat at the top level) and their defaults.
DFLASH2_DEFAULTS = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16}
# Frozen copies of target tensors that speculators saves beside the draft body.
_TARGET_COPIES = ("embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight")
_DRAFT_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
               "intermediate_size", "hidden_act", "rms_norm_eps", "max_position_embeddings", "attention_bias",
               "sliding_window", "use_sliding_window", "layer_types", "vocab_size", "rope_parameters",
               "rope_theta", "rope_scaling")


def is_speculators_config(raw: dict[str, Any]) -> bool:
    return MODEL_TYPE_KEY in raw


def _layer_config(layer_cfg: dict[str, Any], source: str) -> dict[str, Any]:
    """``transformer_layer_config`` with the transformers class defaults filled in, as speculators does."""
    from transformers import AutoConfig

    model_type = layer_cfg.get("model_type", "qwen3")
    try:
        config_class = type(AutoConfig.for_model(model_type=model_type))
    except ValueError as exc:
        raise ValueError(f"{source}: transformer_layer_config.model_type {model_type!r} is unknown to "
                         f"transformers ({exc})") from None
    full = config_class(**layer_cfg).to_dict()
    return {key: full[key] for key in _DRAFT_KEYS if key in full}


def zlab_config(raw: dict[str, Any], *, source: str) -> dict[str, Any]:
    """A speculators DFlash ``config.json`` -> the equivalent z-lab ``config.json`` dict."""
    kind = raw.get(MODEL_TYPE_KEY)
    if kind not in ("dflash", "dflash2"):
        raise ValueError(f"{source}: speculators checkpoint of type {kind!r}; dflash-kernels loads speculators "
                         "'dflash' and 'dflash2' drafts only (EAGLE-3, DSpark, MTP and other speculators models are "
                         "other methods)")
    layer_cfg = raw.get("transformer_layer_config")
    if not isinstance(layer_cfg, dict):
        raise ValueError(f"{source}: speculators config has no transformer_layer_config object")
    out = _layer_config(layer_cfg, source)
    hidden = out["hidden_size"]
    target_hidden = raw.get("target_hidden_size")
    if target_hidden is not None and target_hidden != hidden:
        raise ValueError(f"{source}: target_hidden_size={target_hidden} != draft hidden_size={hidden}; a DFlash "
                         "draft here shares the target's embedding and LM head, so the widths must be equal")
    aux = raw.get("aux_hidden_state_layer_ids")
    if not aux:
        raise ValueError(f"{source}: aux_hidden_state_layer_ids is missing; it lists the tapped target layers "
                         "(speculators saves it at training time)")
    if any(not isinstance(i, int) or i < 1 for i in aux):
        raise ValueError(f"{source}: aux_hidden_state_layer_ids {aux} must be integers >= 1 (they count from the "
                         "embedding output, so layer i of the target is i + 1)")
    vocab = out.get("vocab_size")
    draft_vocab = raw.get("draft_vocab_size", vocab)
    dflash_config = {
        "block_size": raw.get("block_size", 8),  # speculators' default
        "mask_token_id": raw.get("mask_token_id"),
        "target_layer_ids": [i - 1 for i in aux],
        "draft_vocab_size": None if draft_vocab == vocab else draft_vocab,
        "sample_from_anchor": bool(raw.get("sample_from_anchor", False)),
    }
    if raw.get("sliding_window_non_causal"):
        out["is_causal"] = False  # full-attention layers are non-causal either way
    out.update(architectures=["DFlashDraftModel"], model_type="qwen3", dflash_config=dflash_config)
    if kind == "dflash2":
        out["architectures"] = ["DFlash2DraftModel"]
        dflash_config.update({key: raw.get(key, default) for key, default in DFLASH2_DEFAULTS.items()})
    return out


def zlab_state_dict(state: dict[str, torch.Tensor], config, *,
                    source: str) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """Speculators tensors -> (the draft body under z-lab names, the draft vocabulary's target token ids or
    None for the full vocabulary); ``d2t`` and ``t2d`` are checked against each other and the LM head."""
    state = dict(state)
    head = state.get("lm_head.weight")
    for name in _TARGET_COPIES:
        state.pop(name, None)
    d2t, t2d = state.pop("d2t", None), state.pop("t2d", None)
    draft_vocab = config.draft_vocab_size
    if draft_vocab is None:
        return state, None  # full vocabulary: mappings, if any, are identities (speculators ignores them too)
    if head is not None and head.shape[0] != draft_vocab:
        raise ValueError(f"{source}: lm_head.weight has {head.shape[0]} rows but draft_vocab_size is {draft_vocab}; "
                         "the checkpoint's head and config.json disagree")
    if d2t is None:
        raise ValueError(f"{source}: draft_vocab_size={draft_vocab} < vocab_size={config.vocab_size} but the "
                         "checkpoint has no d2t tensor (the draft-to-target token map)")
    if tuple(d2t.shape) != (draft_vocab,) or d2t.dtype.is_floating_point:
        raise ValueError(f"{source}: d2t must be an integer tensor of shape [{draft_vocab}] (draft_vocab_size), "
                         f"got {d2t.dtype} {list(d2t.shape)}")
    token_ids = torch.arange(draft_vocab, dtype=torch.long) + d2t.long()
    if t2d is not None:
        vocab = config.vocab_size
        if t2d.dim() != 1 or (vocab is not None and t2d.shape[0] != vocab):
            raise ValueError(f"{source}: t2d has shape {list(t2d.shape)}, expected [{vocab}] (vocab_size)")
        inside = (token_ids >= 0) & (token_ids < t2d.shape[0])
        if int(t2d.bool().sum()) != draft_vocab or not bool(inside.all()) or not bool(t2d.bool()[token_ids].all()):
            raise ValueError(f"{source}: d2t and t2d describe different draft vocabularies (t2d marks "
                             f"{int(t2d.bool().sum())} tokens, draft_vocab_size is {draft_vocab}); re-export the "
                             "checkpoint's vocabulary mapping")
    return state, token_ids


def vocab_subset_tensors(token_ids: torch.Tensor, head_rows: torch.Tensor) -> dict[str, torch.Tensor]:
    """A draft vocabulary subset as speculators and vLLM store it: the draft's own LM head (``lm_head.weight``,
    the target head's rows for ``token_ids``) and ``d2t`` (int64 offsets, target id = draft index + offset);
    :func:`zlab_state_dict` reads it back."""
    if head_rows.dim() != 2 or head_rows.shape[0] != token_ids.numel():
        raise ValueError(f"head_rows: expected [{token_ids.numel()}, hidden] (one LM head row per draft token id), "
                         f"got {list(head_rows.shape)}")
    offsets = token_ids.long() - torch.arange(token_ids.numel(), dtype=torch.long, device=token_ids.device)
    return {"lm_head.weight": head_rows.detach().contiguous(), "d2t": offsets.contiguous()}

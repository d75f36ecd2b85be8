"""Draft configuration: parses z-lab DFlash ``config.json`` files (both schemas) into one object.

Older checkpoints keep ``block_size`` and ``rope_theta`` at the top level; newer ones move
``block_size`` into ``dflash_config`` and ``rope_theta`` into ``rope_parameters``. Either way the
resolved values land on :class:`DFlashConfig`; keys this project does not interpret are kept in
``extra`` and written back unchanged by :meth:`DFlashConfig.to_dict`.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Sequence

from dflash import speculators
from dflash_kernels.rope import rope_parameters

CONFIG_NAME = "config.json"
DFLASH2_ARCHITECTURE = "DFlash2DraftModel"
# Checkpoint tensor of a draft with a vocabulary subset: the target token id of each draft logit.
DRAFT_TOKEN_IDS = "draft_token_ids"

# Fields read from the top level of config.json, with the official (Qwen3Config) defaults.
_TOP_LEVEL_DEFAULTS: dict[str, Any] = {
    "hidden_size": None,
    "num_hidden_layers": None,
    "num_attention_heads": None,
    "num_key_value_heads": None,
    "head_dim": None,
    "intermediate_size": None,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 32768,
    "attention_bias": False,
    "sliding_window": None,
    "layer_types": None,
    "is_causal": None,
    "num_target_layers": None,
    "vocab_size": None,
    "tie_word_embeddings": False,
}
_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
# Fields that live in dflash_config in the newer schema (top level accepted as a fallback).
_DFLASH_DEFAULTS: dict[str, Any] = {
    "block_size": 16,
    "mask_token_id": None,
    "target_layer_ids": None,
    "input_embedding_scale": 1.0,
    "output_multiplier": 1.0,
    "final_logit_softcapping": None,
    # Draft vocabulary subset (speculators / EAGLE-3 style): the draft's LM head scores only these
    # target token ids, stored as the ``draft_token_ids`` tensor of the checkpoint. None = full vocabulary.
    "draft_vocab_size": None,
    # speculators ``sample_from_anchor``: block row i predicts the token at position start+i+1, so the
    # proposals come from rows 0..B-2 instead of z-lab's rows 1..B-1 (row i predicts position start+i).
    "sample_from_anchor": False,
}
# DFlash2 (``architectures: ["DFlash2DraftModel"]``): required dflash_config keys, no defaults (as the official code).
DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


@dataclasses.dataclass(frozen=True)
class DFlash2Settings:
    """The DFlash2 part of a draft config: the grouped dynamic causal convolution around each sublayer
    (``conv_kernel_size`` taps, one dynamic kernel per ``conv_group_size`` channels) and the candidate
    selector (codebooks of rank ``selector_rank``, reranking the ``selector_top_k`` best draft logits)."""

    conv_kernel_size: int
    conv_group_size: int
    selector_rank: int
    selector_top_k: int


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Default tapped target layers (0-based): ``[N//2]`` for one draft layer, else evenly
    spaced from 1 to N-3, e.g. N=36, L=5 -> [1, 9, 17, 25, 33]."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [int(round(start + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


@dataclasses.dataclass
class DFlashConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    attention_bias: bool = False
    rope_parameters: dict[str, Any] = dataclasses.field(
        default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0}
    )
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    is_causal: bool | None = None
    num_target_layers: int | None = None
    vocab_size: int | None = None
    tie_word_embeddings: bool = False
    block_size: int = 16
    mask_token_id: int | None = None
    target_layer_ids: list[int] | None = None
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    draft_vocab_size: int | None = None
    sample_from_anchor: bool = False
    dflash2: DFlash2Settings | None = None
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.layer_types is None:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        if self.target_layer_ids is None:
            if self.num_target_layers is None:
                raise ValueError(
                    "config: neither dflash_config.target_layer_ids nor num_target_layers is set; "
                    "add one of them so the tapped target layers are known"
                )
            self.target_layer_ids = build_target_layer_ids(self.num_target_layers, self.num_hidden_layers)
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        self.validate()

    def validate(self) -> None:
        def fail(msg: str) -> None:
            raise ValueError(f"config: {msg}")

        for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                     "head_dim", "intermediate_size", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                fail(f"{name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            fail(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                 f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            fail(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if len(self.layer_types) != self.num_hidden_layers:
            fail(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        for kind in self.layer_types:
            if kind not in ("full_attention", "sliding_attention"):
                fail(f"unknown layer type {kind!r} (expected 'full_attention' or 'sliding_attention')")
        if "sliding_attention" in self.layer_types and not (self.sliding_window and self.sliding_window > 0):
            fail("layer_types has sliding_attention layers but sliding_window is not a positive integer")
        if not self.target_layer_ids:
            fail("target_layer_ids is empty")
        if self.draft_vocab_size is not None and (
                isinstance(self.draft_vocab_size, bool) or not isinstance(self.draft_vocab_size, int)
                or self.draft_vocab_size < 1):
            fail(f"draft_vocab_size must be a positive integer or null (full vocabulary), got {self.draft_vocab_size!r}")
        if not isinstance(self.sample_from_anchor, bool):
            fail(f"sample_from_anchor must be true or false, got {self.sample_from_anchor!r}")
        if self.hidden_act != "silu":
            fail(f"hidden_act={self.hidden_act!r} is not supported (DFlash drafts use 'silu')")
        if self.dflash2 is not None:
            self._validate_dflash2(fail)

    def _validate_dflash2(self, fail) -> None:
        d2 = self.dflash2
        for name in DFLASH2_KEYS:
            value = getattr(d2, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                fail(f"dflash_config.{name} must be a positive integer, got {value!r}")
        if self.hidden_size % d2.conv_group_size:
            fail(f"dflash_config.conv_group_size={d2.conv_group_size} must divide hidden_size={self.hidden_size}")
        if self.vocab_size is None:
            fail("a DFlash2 draft needs vocab_size (its selector codebooks have one row per target token)")
        if d2.selector_top_k > self.vocab_size:
            fail(f"dflash_config.selector_top_k={d2.selector_top_k} exceeds vocab_size={self.vocab_size}")
        if self.draft_vocab_size is not None:
            fail("a DFlash2 draft scores the full target vocabulary; set draft_vocab_size to null")
        if self.sample_from_anchor:
            fail("a DFlash2 draft proposes from block rows 1..B-1; set sample_from_anchor to false")

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    def layer_is_causal(self, layer: int) -> bool:
        """PyPI semantics: ``is_causal`` overrides; else sliding layers are causal in the block."""
        if self.is_causal is not None:
            return bool(self.is_causal)
        return self.layer_types[layer] == "sliding_attention"

    def layer_window(self, layer: int) -> int | None:
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    def expected_weight_shapes(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """Every tensor of a draft checkpoint (z-lab state-dict names) -> (shape, the config fields
        that imply it). The one statement of the draft's weight shapes that loading checks against."""
        H, T, I, D = self.hidden_size, self.num_taps, self.intermediate_size, self.head_dim
        nh, nkv = self.num_attention_heads, self.num_key_value_heads
        hid = f"hidden_size={H}"
        q_out = f"num_attention_heads={nh} × head_dim={D}"
        kv_out = f"num_key_value_heads={nkv} × head_dim={D}"
        inter = f"intermediate_size={I}"
        shapes = {
            "fc.weight": ((H, T * H), f"{hid}, len(target_layer_ids)={T} × {hid}"),
            "hidden_norm.weight": ((H,), hid),
            "norm.weight": ((H,), hid),
        }
        for i in range(self.num_hidden_layers):
            p = f"layers.{i}."
            layer = {
                "input_layernorm.weight": ((H,), hid),
                "post_attention_layernorm.weight": ((H,), hid),
                "self_attn.q_proj.weight": ((nh * D, H), f"{q_out}, {hid}"),
                "self_attn.k_proj.weight": ((nkv * D, H), f"{kv_out}, {hid}"),
                "self_attn.v_proj.weight": ((nkv * D, H), f"{kv_out}, {hid}"),
                "self_attn.o_proj.weight": ((H, nh * D), f"{hid}, {q_out}"),
                "self_attn.q_norm.weight": ((D,), f"head_dim={D}"),
                "self_attn.k_norm.weight": ((D,), f"head_dim={D}"),
                "mlp.gate_proj.weight": ((I, H), f"{inter}, {hid}"),
                "mlp.up_proj.weight": ((I, H), f"{inter}, {hid}"),
                "mlp.down_proj.weight": ((H, I), f"{hid}, {inter}"),
            }
            if self.attention_bias:
                layer.update({
                    "self_attn.q_proj.bias": ((nh * D,), f"{q_out}, attention_bias=true"),
                    "self_attn.k_proj.bias": ((nkv * D,), f"{kv_out}, attention_bias=true"),
                    "self_attn.v_proj.bias": ((nkv * D,), f"{kv_out}, attention_bias=true"),
                    "self_attn.o_proj.bias": ((H,), f"{hid}, attention_bias=true"),
                })
            shapes.update({p + name: v for name, v in layer.items()})
        if self.dflash2 is not None:
            shapes.update(self._dflash2_weight_shapes())
        if self.draft_vocab_size is not None:
            shapes[DRAFT_TOKEN_IDS] = ((self.draft_vocab_size,), f"draft_vocab_size={self.draft_vocab_size}")
        return shapes

    def _dflash2_weight_shapes(self) -> dict[str, tuple[tuple[int, ...], str]]:
        H, V, d2 = self.hidden_size, self.vocab_size, self.dflash2
        K, r = d2.conv_kernel_size, d2.selector_rank
        groups = H // d2.conv_group_size
        taps = f"conv_kernel_size={K}, hidden_size={H}"
        proj = f"2 × conv_kernel_size={K} × hidden_size={H} / conv_group_size={d2.conv_group_size}, hidden_size={H}"
        codebook = ((V, r), f"vocab_size={V}, selector_rank={r}")
        shapes = {
            "candidate_selector.predecessor_codebook": codebook,
            "candidate_selector.successor_codebook": codebook,
            "candidate_selector.hidden_projection.weight": ((r, H), f"selector_rank={r}, hidden_size={H}"),
        }
        for i in range(self.num_hidden_layers):
            for conv in ("attention_conv", "mlp_conv"):
                shapes[f"layers.{i}.{conv}.base_kernel"] = ((2, K, H), taps)
                shapes[f"layers.{i}.{conv}.kernel_projection.weight"] = ((2 * K * groups, H), proj)
        return shapes

    def check_weight_shapes(self, shapes: dict[str, Sequence[int]], *, source: str = "checkpoint") -> None:
        """Raises ValueError unless ``shapes`` (tensor name -> shape, as read from a checkpoint) has
        exactly the tensors and shapes of :meth:`expected_weight_shapes`; names every offender."""
        expected = self.expected_weight_shapes()
        fix = "the weights and config.json must come from the same draft"
        missing = [n for n in expected if n not in shapes]
        unexpected = sorted(n for n in shapes if n not in expected)
        if missing or unexpected:
            parts = []
            if missing:
                parts.append(f"missing tensors {missing[:8]}" + (f" (+{len(missing) - 8} more)" if len(missing) > 8 else ""))
            if unexpected:
                parts.append(f"unexpected tensors {unexpected[:8]}"
                             + (f" (+{len(unexpected) - 8} more)" if len(unexpected) > 8 else ""))
            kind = "DFlash2" if self.dflash2 is not None else "DFlash"
            if self.dflash2 is None and any(n.startswith("candidate_selector.") for n in unexpected):
                fix = (f"these are DFlash2 tensors: set architectures to [\"{DFLASH2_ARCHITECTURE}\"] and the "
                       f"dflash_config keys {list(DFLASH2_KEYS)}")
            raise ValueError(f"{source}: {'; '.join(parts)}: config.json describes a {kind} draft with "
                             f"num_hidden_layers={self.num_hidden_layers}, "
                             f"attention_bias={str(self.attention_bias).lower()}; {fix}")
        wrong = [f"{n}: checkpoint {list(shapes[n])}, config implies {list(shape)} ({why})"
                 for n, (shape, why) in expected.items() if tuple(shapes[n]) != shape]
        if wrong:
            more = f"; +{len(wrong) - 8} more" if len(wrong) > 8 else ""
            raise ValueError(f"{source}: {len(wrong)} tensor shape(s) disagree with config.json: "
                             + "; ".join(wrong[:8]) + more + f"; {fix}")

    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, source: str = "config") -> "DFlashConfig":
        """A z-lab ``config.json`` (either schema) or a speculators DFlash one (see :mod:`dflash.speculators`)."""
        if speculators.is_speculators_config(raw):
            raw = speculators.zlab_config(raw, source=source)
        raw = dict(raw)
        architectures = raw.get("architectures") or []
        missing = [k for k in _REQUIRED if raw.get(k) is None]
        if missing:
            raise ValueError(f"{source}: missing required key(s) {missing}")
        dflash_cfg = dict(raw.pop("dflash_config", None) or {})
        dflash2 = _pop_dflash2(raw, dflash_cfg, source) if DFLASH2_ARCHITECTURE in architectures else None
        values: dict[str, Any] = {}
        for key, default in _TOP_LEVEL_DEFAULTS.items():
            values[key] = raw.pop(key, default)
        for key, default in _DFLASH_DEFAULTS.items():
            top = raw.pop(key, None)
            values[key] = dflash_cfg.pop(key, top if top is not None else default)
        if values["sliding_window"] is not None and not raw.get("use_sliding_window", True):
            # Qwen3Config drops the window when use_sliding_window is false; keep it only if a layer uses it.
            if "sliding_attention" not in (values["layer_types"] or []):
                values["sliding_window"] = None
        values["dflash2"] = dflash2
        values["rope_parameters"] = rope_parameters(raw)
        values["extra"] = {"dflash_config": dflash_cfg, **raw} if dflash_cfg else raw
        try:
            return cls(**values)
        except TypeError as exc:  # pragma: no cover - defensive
            raise ValueError(f"{source}: {exc}") from exc

    @classmethod
    def from_json_file(cls, path: str | os.PathLike) -> "DFlashConfig":
        path, raw = read_config_json(path)
        return cls.from_dict(raw, source=path)

    def to_dict(self) -> dict[str, Any]:
        """z-lab (newer) schema; ``block_size`` is also kept at the top level so that the
        GitHub version of the official code, which reads ``config.block_size``, loads it."""
        extra = dict(self.extra)
        dflash_extra = dict(extra.pop("dflash_config", {}) or {})
        out: dict[str, Any] = {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            **extra,
        }
        for key in _TOP_LEVEL_DEFAULTS:
            out[key] = getattr(self, key)
        out["rope_parameters"] = dict(self.rope_parameters)
        out["rope_theta"] = self.rope_parameters.get("rope_theta")
        out["use_sliding_window"] = self.sliding_window is not None
        out["block_size"] = self.block_size
        if self.draft_vocab_size is not None:
            out["draft_vocab_size"] = self.draft_vocab_size  # where vLLM and speculators read it
        out["dflash_config"] = {
            **dflash_extra,
            **{key: getattr(self, key) for key in _DFLASH_DEFAULTS},
        }
        if self.dflash2 is not None:
            out["architectures"] = [DFLASH2_ARCHITECTURE]
            out["dflash_config"].update(dataclasses.asdict(self.dflash2))
        return out

    def to_json_file(self, path: str | os.PathLike) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=2, sort_keys=True)
            f.write("\n")


def read_config_json(path: str | os.PathLike) -> tuple[str, dict[str, Any]]:
    """(path of the file, its JSON object) for a draft folder or a ``config.json`` path."""
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, CONFIG_NAME)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"draft config not found: {path} (a z-lab draft folder holds config.json)")
    try:
        with open(path, encoding="utf-8") as f:
            return path, json.load(f)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from exc


def _pop_dflash2(raw: dict[str, Any], dflash_cfg: dict[str, Any], source: str) -> DFlash2Settings:
    """The four DFlash2 keys, from ``dflash_config`` or else the top level (as the official ``_draft_value``),
    removed from both."""
    values = {key: dflash_cfg.pop(key, None) for key in DFLASH2_KEYS}
    for key in DFLASH2_KEYS:
        top = raw.pop(key, None)
        if values[key] is None:
            values[key] = top
    absent = [key for key, value in values.items() if value is None]
    if absent:
        raise ValueError(f"{source}: a {DFLASH2_ARCHITECTURE} config needs dflash_config keys {list(DFLASH2_KEYS)}; "
                         f"missing {absent}")
    return DFlash2Settings(**values)

"""The DFlash draft network in pure PyTorch (z-lab ``DFlashDraftModel`` semantics and state-dict keys)
and its checkpoint I/O. The runtimes build on :class:`DraftModel`; :mod:`dflash.model` adds z-lab's
``spec_generate`` on top.

One draft call sees C new context rows (the target's tapped hidden states, fused by ``fc`` and
``hidden_norm``) and q block rows (embeddings of ``[anchor, MASK, ...]``). Every layer projects
both with the same k/v weights, applies per-head RMSNorm then RoPE at absolute positions, and lets
the block queries attend over [cached context, new context, block] — non-causally on full-attention
layers, causally inside the block and within a sliding window on sliding layers.
"""
from __future__ import annotations

import json
import os

import torch
import torch.nn.functional as F
from torch import nn

from dflash import speculators
from dflash.config import CONFIG_NAME, DRAFT_TOKEN_IDS, DFlashConfig, read_config_json
from dflash_kernels.rope import rope_inv_freq as kernel_rope_inv_freq

WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"


class UnreadableWeightsError(ValueError):
    """A weights file of a checkpoint that is not a readable safetensors file (truncated or corrupt): the
    message names the file and the fix. A ValueError, told apart so that a CLI can report it as a bad path
    argument."""


class RMSNorm(nn.Module):
    """Qwen3/LLaMA RMSNorm: fp32 statistics, cast back, then scale by the weight."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(config: DFlashConfig) -> tuple[torch.Tensor, float]:
    """``(inv_freq [D/2] fp32, attention_scaling)`` of the config's RoPE (:func:`dflash_kernels.rope.rope_inv_freq`)."""
    return kernel_rope_inv_freq(config.rope_parameters, head_dim=config.head_dim, hidden_size=config.hidden_size,
                                num_attention_heads=config.num_attention_heads,
                                max_position_embeddings=config.max_position_embeddings)


class RotaryEmbedding(nn.Module):
    """cos/sin of the draft's RoPE: fp32 frequencies and angles in every model dtype (the official rule, HF
    Qwen3's rotary embedding), cast to the model's dtype at the end."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        inv_freq, self.attention_scaling = rope_inv_freq(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def _apply(self, fn, recurse=True):
        """A module cast (``.to(dtype)``, ``.bfloat16()``, ``from_pretrained(dtype=...)``) moves ``inv_freq`` but
        keeps its fp32 values: in bf16 the angle at position 32768 would be off by radians."""
        inv_freq = self.inv_freq
        super()._apply(fn, recurse)
        if self.inv_freq.dtype != inv_freq.dtype:
            self.inv_freq = inv_freq.to(self.inv_freq.device)
        return self

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids [b, n] -> cos, sin [b, n, D] in ``dtype`` (computed in fp32, like HF)."""
        freqs = position_ids.float()[..., None] * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, heads, n, D]; cos/sin [b, n, D]."""
    cos, sin = cos[:, None], sin[:, None]
    return x * cos + rotate_half(x) * sin


class DraftKVCache:
    """Per-layer K/V of the draft's context rows, ``[b, kv_heads, S, D]`` each.

    Same methods as transformers' ``DynamicCache`` that the draft uses (``update``,
    ``get_seq_length``, ``crop``), so either can be passed as ``past_key_values``.
    """

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        if layer_idx == len(self.keys):
            self.keys.append(key)
            self.values.append(value)
        else:
            self.keys[layer_idx] = torch.cat([self.keys[layer_idx], key], dim=-2)
            self.values[layer_idx] = torch.cat([self.values[layer_idx], value], dim=-2)
        return self.keys[layer_idx], self.values[layer_idx]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.keys[layer_idx].shape[-2] if len(self.keys) > layer_idx else 0

    def crop(self, max_length: int) -> None:
        """Keep the first ``max_length`` positions (negative: drop that many from the end)."""
        if max_length < 0:
            max_length = self.get_seq_length() + max_length
        self.keys = [k[..., :max_length, :] for k in self.keys]
        self.values = [v[..., :max_length, :] for v in self.values]


def layer_attention_mask(
    q_len: int, k_len: int, *, causal: bool, window: int | None, device: torch.device
) -> torch.Tensor | None:
    """Boolean [q_len, k_len] mask (True = attend) of the PyPI draft: query i sits at key index
    ``k_len - q_len + i``; causal keeps keys at or before it, a window W keeps keys closer than W
    (on both sides when not causal). ``None`` means attend to everything."""
    if not causal and window is None:
        return None
    q_idx = torch.arange(k_len - q_len, k_len, device=device)[:, None]
    k_idx = torch.arange(k_len, device=device)[None, :]
    mask = torch.ones(q_len, k_len, dtype=torch.bool, device=device)
    if causal:
        mask &= k_idx <= q_idx
    if window is not None:
        mask &= (q_idx - k_idx) < window
        if not causal:
            mask &= (k_idx - q_idx) < window
    return mask


class DFlashAttention(nn.Module):
    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.causal = config.layer_is_causal(layer_idx)
        self.window = config.layer_window(layer_idx)
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def _heads(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        b, n, _ = x.shape
        return x.view(b, n, heads, self.head_dim).transpose(1, 2)

    def project_qkv(self, hidden: torch.Tensor, context: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Queries of the block rows [b, nH, q, D]; keys/values of [context ++ block] rows
        [b, kvH, C+q, D]: shared projections, per-head RMSNorm, then RoPE at the rows' positions."""
        q_len = hidden.shape[1]
        rows = torch.cat([context, hidden], dim=1)
        q = self.q_norm(self._heads(self.q_proj(hidden), self.num_heads))
        k = self.k_norm(self._heads(self.k_proj(rows), self.num_kv_heads))
        v = self._heads(self.v_proj(rows), self.num_kv_heads)
        return apply_rope(q, cos[:, -q_len:], sin[:, -q_len:]), apply_rope(k, cos, sin), v

    def forward(
        self,
        hidden: torch.Tensor,
        context: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        past_key_values=None,
        attention_mask: torch.Tensor | None = None,
        attention_fn=None,
    ) -> torch.Tensor:
        """hidden [b, q, H] block rows; context [b, C, H] fused context rows; cos/sin [b, C+q, D]."""
        b, q_len, _ = hidden.shape
        q, k, v = self.project_qkv(hidden, context, cos, sin)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
        if attention_fn is not None:
            out = attention_fn(q, k, v)
            return self.o_proj(out.transpose(1, 2).reshape(b, q_len, self.num_heads * self.head_dim))
        groups = self.num_heads // self.num_kv_heads
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
        if attention_mask is None:
            attention_mask = layer_attention_mask(
                q_len, k.shape[-2], causal=self.causal, window=self.window, device=hidden.device
            )
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, scale=self.head_dim**-0.5)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, self.num_heads * self.head_dim))


class DFlashMLP(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DFlashAttention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DFlashMLP(config)

    def forward(self, hidden, context, cos, sin, past_key_values=None, attention_mask=None, attention_fn=None):
        # Only the block rows are normed per layer; every layer projects the same fused context.
        attn_in = self.input_layernorm(hidden)
        hidden = hidden + self.self_attn(attn_in, context, cos, sin, past_key_values, attention_mask, attention_fn)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DraftModel(nn.Module):
    """Block-diffusion draft conditioned on target features (the network of z-lab's ``DFlashDraftModel``).

    The draft owns no embedding or LM head: callers embed block tokens with the target's
    embedding table and score the returned hidden states with the target's LM head
    (:meth:`compute_logits`).
    """

    layer_class = DFlashDecoderLayer  # the decoder layer of this kind of draft
    runs_dflash2 = False  # whether this class runs DFlash2 configs (config.dflash2) rather than DFlash ones

    def __init__(self, config: DFlashConfig):
        if (config.dflash2 is not None) != self.runs_dflash2:
            kind, fix = (("a DFlash2", "dflash.DFlash2DraftModel") if config.dflash2 is not None
                         else ("a DFlash", "dflash.DFlashDraftModel"))
            raise ValueError(f"config describes {kind} draft, which {type(self).__name__} does not run; build it "
                             f"with {fix}")
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.fc = nn.Linear(config.num_taps * hidden, hidden, bias=False)
        self.hidden_norm = RMSNorm(hidden, config.rms_norm_eps)
        self.layers = nn.ModuleList(self.layer_class(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)
        if config.draft_vocab_size is not None:
            # Target id of each draft logit; a checkpoint tensor. Set with set_draft_vocab.
            self.register_buffer(DRAFT_TOKEN_IDS, torch.arange(config.draft_vocab_size))
        self._head_rows: tuple[tuple, torch.Tensor] | None = None  # (key, target LM head rows of the subset)
        self.reset_parameters()

    # z-lab attribute names
    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def mask_token_id(self) -> int | None:
        return self.config.mask_token_id

    @property
    def target_layer_ids(self) -> list[int]:
        return self.config.target_layer_ids

    def reset_parameters(self, std: float = 0.02) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def fuse_context(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """[..., T*H] concatenated taps -> [..., H] = hidden_norm(fc(taps))."""
        return self.hidden_norm(self.fc(target_hidden))

    def forward(
        self,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        noise_embedding: torch.Tensor | None = None,
        target_hidden: torch.Tensor | None = None,
        past_key_values=None,
        use_cache: bool = False,
        attention_fn=None,
        **kwargs,
    ) -> torch.Tensor:
        """One draft pass.

        Args:
            position_ids: [b, C+q] int64, absolute positions of the C new context rows then the q block rows.
            attention_mask: optional bool [b or 1, 1, q, K] (True = attend) over all K keys
                ([cached context, new context, block]); overrides the per-layer default masks
                (used by training to pack many blocks into one pass).
            noise_embedding: [b, q, H], target embeddings of the block tokens (× input_embedding_scale).
            target_hidden: [b, C, T*H], the target's tapped hidden states of the new context rows (C may be 0).
            past_key_values: a :class:`DraftKVCache` (or HF ``DynamicCache``) holding earlier context
                K/V; the new rows (context and block) are appended, so crop the block rows off after the call.
            attention_fn: optional ``(q [b, nH, q, D], k [b, kvH, K, D], v) -> [b, nH, q, D]`` replacing
                the masked SDPA of every layer (training passes FlexAttention with a block mask).
        Returns:
            [b, q, H] final-normed hidden states of the block rows.
        """
        if noise_embedding is None or target_hidden is None:
            raise ValueError("forward: noise_embedding and target_hidden are required")
        b, q_len, hidden = noise_embedding.shape
        if hidden != self.config.hidden_size:
            raise ValueError(f"noise_embedding: hidden size {hidden} != draft hidden_size {self.config.hidden_size}")
        if target_hidden.shape[-1] != self.fc.in_features:
            raise ValueError(
                f"target_hidden: last dim {target_hidden.shape[-1]} != {self.config.num_taps} taps × "
                f"{self.config.hidden_size}; concatenate the outputs of target_layer_ids {self.config.target_layer_ids}"
            )
        if position_ids.shape[-1] != target_hidden.shape[1] + q_len:
            raise ValueError(
                f"position_ids: {position_ids.shape[-1]} positions for {target_hidden.shape[1]} context + {q_len} block rows"
            )
        position_ids = position_ids.expand(b, -1)
        context = self.fuse_context(target_hidden)
        cos, sin = self.rotary_emb(position_ids, noise_embedding.dtype)
        h = noise_embedding
        for layer in self.layers:
            h = layer(h, context, cos, sin, past_key_values, attention_mask, attention_fn)
        return self.norm(h)

    # ---------------------------------------------------------------- draft vocabulary
    def set_draft_vocab(self, token_ids) -> None:
        """Set the target token ids the draft's LM head scores (``config.draft_vocab_size`` of them)."""
        ids = torch.as_tensor(token_ids)
        check_draft_vocab(ids, self.config.draft_vocab_size, source="set_draft_vocab")
        getattr(self, DRAFT_TOKEN_IDS).copy_(ids)
        self._head_rows = None

    def head_rows(self, output_head) -> torch.Tensor:
        """The rows of the target's LM head that the draft vocabulary selects, in the draft's dtype:
        gathered on the first call for a given head and kept (so captured steps only read them)."""
        ids = getattr(self, DRAFT_TOKEN_IDS)
        weight = getattr(output_head, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            raise TypeError("a draft with a vocabulary subset needs an LM head module with a [vocab, hidden] .weight")
        dtype = self.fc.weight.dtype
        key = (weight.data_ptr(), tuple(weight.shape), weight.dtype, dtype, ids.device)
        if self._head_rows is None or self._head_rows[0] != key:
            check_draft_vocab(ids, self.config.draft_vocab_size, vocab=weight.shape[0], source="draft_token_ids")
            self._head_rows = (key, weight.detach().index_select(0, ids.to(weight.device)).to(dtype))
        return self._head_rows[1]

    def compute_logits(self, hidden: torch.Tensor, output_head, linear=F.linear) -> torch.Tensor:
        """Target LM head on draft hidden states (only its draft-vocabulary rows when the draft has a
        vocabulary subset: logits then index ``draft_token_ids``), × output_multiplier, optional soft-cap.
        ``linear``: the GEMM for a plain ``nn.Linear`` head or the subset's rows (the engine passes its own,
        ``cpu_linear`` on the "cpu" backend)."""
        if self.config.draft_vocab_size is not None:
            rows = self.head_rows(output_head)
            logits = linear(hidden.to(rows.dtype), rows)
        elif type(output_head) is nn.Linear:
            logits = linear(hidden, output_head.weight, output_head.bias)
        else:
            logits = output_head(hidden)
        if self.config.output_multiplier != 1.0:
            logits = logits * self.config.output_multiplier
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = cap * torch.tanh(logits / cap)
        return logits

    @property
    def vocab_ids(self) -> torch.Tensor | None:
        """Target token id of each draft logit ([V'] int64) for a draft vocabulary subset, else None."""
        return getattr(self, DRAFT_TOKEN_IDS) if self.config.draft_vocab_size is not None else None

    def block_logits(self, hidden: torch.Tensor, output_head, linear=F.linear) -> torch.Tensor:
        """The draft's logits [b, q-1, V'] for block positions 1..q-1 from the final-normed hidden states of
        all q block rows: rows 1..q-1 (z-lab: row i predicts position start+i), or rows 0..q-2 for
        ``sample_from_anchor`` drafts (row i predicts position start+i+1). With a draft vocabulary subset,
        logit j scores target token ``vocab_ids[j]``. Chain decoding takes their argmax (:meth:`propose`);
        tree decoding builds its tree from all of them (``dflash_kernels.build_tree``)."""
        rows = hidden[:, :-1] if self.config.sample_from_anchor else hidden[:, 1:]
        if self.config.draft_vocab_size is None:
            rows = rows.to(output_head.weight.dtype)
        return self.compute_logits(rows, output_head, linear)

    def propose(self, hidden: torch.Tensor, output_head, out: torch.Tensor | None = None,
                linear=F.linear) -> torch.Tensor:
        """Greedy proposals as target token ids [b, q-1]: the argmax of :meth:`block_logits`. ``out``: an
        int64 [b, q-1] tensor to write them into (no extra copy) and return."""
        logits = self.block_logits(hidden, output_head, linear)
        if self.config.draft_vocab_size is None:
            return torch.argmax(logits, dim=-1, out=out)
        ids = torch.argmax(logits, dim=-1)
        table = self.vocab_ids
        if out is None:
            return table[ids]
        return torch.index_select(table, 0, ids.view(-1), out=out.view(-1)).view(out.shape)

    # ---------------------------------------------------------------- checkpoints
    def save_pretrained(self, save_directory: str | os.PathLike, *, max_shard_size: int | None = None,
                        output_head=None) -> None:
        """Write ``config.json`` and ``model.safetensors`` (sharded with an index when the
        weights exceed ``max_shard_size`` bytes), in the z-lab layout.

        A draft with a vocabulary subset stores it as ``draft_token_ids``, or, given the target's LM head
        (``output_head``), as vLLM and speculators read it: the head's rows for the subset as the draft's
        ``lm_head.weight`` plus ``d2t`` offsets, so that vLLM serves the folder as it is. Both load here."""
        from safetensors.torch import save_file

        state = {k: v.detach().contiguous() for k, v in self.state_dict().items()}
        if self.config.draft_vocab_size is not None and output_head is not None:
            state.update(speculators.vocab_subset_tensors(state.pop(DRAFT_TOKEN_IDS), self.head_rows(output_head)))
        os.makedirs(save_directory, exist_ok=True)
        self.config.to_json_file(os.path.join(save_directory, CONFIG_NAME))
        total = sum(t.numel() * t.element_size() for t in state.values())
        if max_shard_size is None or total <= max_shard_size:
            save_file(state, os.path.join(save_directory, WEIGHTS_NAME), metadata={"format": "pt"})
            return
        shards: list[dict[str, torch.Tensor]] = [{}]
        size = 0
        for name, tensor in state.items():
            nbytes = tensor.numel() * tensor.element_size()
            if shards[-1] and size + nbytes > max_shard_size:
                shards.append({})
                size = 0
            shards[-1][name] = tensor
            size += nbytes
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, os.path.join(save_directory, fname), metadata={"format": "pt"})
            weight_map.update({name: fname for name in shard})
        with open(os.path.join(save_directory, WEIGHTS_INDEX_NAME), "w", encoding="utf-8") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)

    @classmethod
    def class_for(cls, config: DFlashConfig, *, source: str) -> type["DraftModel"]:
        """The class that runs a checkpoint of ``config`` when loaded through ``cls`` (``DFlashDraftModel``
        picks ``DFlash2DraftModel`` for a DFlash2 config); a DFlash config loaded through a DFlash2 class fails in
        the constructor."""
        if config.dflash2 is not None and not cls.runs_dflash2:
            raise ValueError(f"{source}: a DFlash2 checkpoint cannot load into {cls.__name__}; load it with "
                             "dflash.DFlash2DraftModel.from_pretrained")
        return cls

    @classmethod
    def checkpoint_state(cls, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Checkpoint tensors under the names of this class's state dict (DFlash's are stored as they are)."""
        return state

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike, *, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"
    ) -> "DraftModel":
        """Load a draft folder (``config.json`` + ``model.safetensors`` or a sharded index): z-lab's layout
        (either config schema, a vocabulary subset as ``draft_token_ids`` or as vLLM's ``lm_head`` + ``d2t``)
        or a speculators DFlash checkpoint (:mod:`dflash.speculators`)."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        config_path, raw = read_config_json(path)
        config = DFlashConfig.from_dict(raw, source=config_path)
        path = os.path.dirname(config_path)
        single = os.path.join(path, WEIGHTS_NAME)
        index = os.path.join(path, WEIGHTS_INDEX_NAME)
        if os.path.isfile(single):
            files = [weight_file(path, WEIGHTS_NAME, source=path)]
        elif os.path.isfile(index):
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"{index}: missing key 'weight_map'")
            names = set(weight_map.values())
            if not all(isinstance(name, str) for name in names):
                raise ValueError(f"{index}: weight_map values must be shard file names")
            files = [weight_file(path, name, source=index) for name in sorted(names)]
        else:
            raise FileNotFoundError(f"no weights in {path}: expected {WEIGHTS_NAME} or {WEIGHTS_INDEX_NAME}")
        state: dict[str, torch.Tensor] = {}
        for file in files:
            if not os.path.isfile(file):
                raise FileNotFoundError(f"weight shard listed in the index is missing: {file}")
            try:
                state.update(load_file(file))
            except SafetensorError as exc:
                raise UnreadableWeightsError(f"{file}: not a readable safetensors file ({exc}); the download is "
                                             "likely truncated or corrupt: fetch this file again") from exc
        if speculators.is_speculators_config(raw) or "d2t" in state:  # the speculators / vLLM vocabulary form
            if DRAFT_TOKEN_IDS in state:
                raise ValueError(f"{path}: the checkpoint holds both {DRAFT_TOKEN_IDS} and d2t; keep one "
                                 "draft vocabulary (re-save the draft with save_pretrained)")
            state, token_ids = speculators.zlab_state_dict(state, config, source=path)
            if token_ids is not None:
                state[DRAFT_TOKEN_IDS] = token_ids
        model_class = cls.class_for(config, source=path)
        state = model_class.checkpoint_state(state)
        config.check_weight_shapes({name: tuple(t.shape) for name, t in state.items()}, source=path)
        if config.draft_vocab_size is not None:
            check_draft_vocab(state[DRAFT_TOKEN_IDS], config.draft_vocab_size, source=f"{path}: {DRAFT_TOKEN_IDS}")
        with torch.device("meta"):
            model = model_class(config)
        model.load_state_dict(state, assign=True)
        model.rotary_emb = RotaryEmbedding(config)
        if dtype is None:
            dtype = state["fc.weight"].dtype
        return model.to(device=device, dtype=dtype).eval()


def weight_file(folder: str, name: str, *, source: str) -> str:
    """The weight file ``name`` of a draft folder (from its index, or ``model.safetensors``), refused unless it
    lies inside the folder: no absolute names, no ``..``, no symlink out of it. A Hugging Face cache snapshot
    (``<repo>/snapshots/<rev>/``) links its files into ``<repo>/blobs/``, which is allowed too."""
    parts = name.replace("\\", "/").split("/")
    if not name or os.path.isabs(name) or ".." in parts:
        raise ValueError(f"{source}: weight file {name!r} is not a file name inside the draft folder "
                         "(absolute or '..' names are refused)")
    file = os.path.join(folder, name)
    real, root = os.path.realpath(file), os.path.realpath(folder)
    roots = [root]
    if os.path.basename(os.path.dirname(root)) == "snapshots":
        roots.append(os.path.join(os.path.dirname(os.path.dirname(root)), "blobs"))
    if not any(os.path.commonpath([real, r]) == r for r in roots):
        raise ValueError(f"{source}: weight file {name!r} resolves to {real}, outside the draft folder {root} "
                         "(a symlink out of the folder is refused)")
    return file


def check_draft_vocab(token_ids: torch.Tensor, size: int | None, *, vocab: int | None = None,
                      source: str) -> None:
    """A draft vocabulary: ``size`` distinct integer target ids, each inside ``[0, vocab)`` when known."""
    if size is None:
        raise ValueError(f"{source}: this draft has the full target vocabulary (config draft_vocab_size is null); "
                         "set dflash_config.draft_vocab_size to give it a vocabulary subset")
    if token_ids.dtype.is_floating_point or token_ids.dtype == torch.bool or token_ids.dim() != 1:
        raise ValueError(f"{source}: expected a 1-D integer tensor of target token ids, got {token_ids.dtype} "
                         f"{list(token_ids.shape)}")
    if token_ids.numel() != size:
        raise ValueError(f"{source}: {token_ids.numel()} token ids for draft_vocab_size={size}; the draft's LM head "
                         "has one row per id")
    low, high = int(token_ids.min()), int(token_ids.max())
    if low < 0 or (vocab is not None and high >= vocab):
        bound = f"[0, {vocab})" if vocab is not None else "[0, vocab)"
        raise ValueError(f"{source}: token ids must lie in the target vocabulary {bound}, found {low}..{high}; "
                         "the draft vocabulary was built for a different target")
    if torch.unique(token_ids).numel() != size:
        raise ValueError(f"{source}: token ids contain duplicates; each target token may appear once")

"""The DFlash2 parts of a draft (z-lab ``DFlash2DraftModel`` of the ``dflash`` 0.1.0 wheel; the class itself is
:class:`dflash.model.DFlash2DraftModel`): a grouped dynamic causal convolution around every sublayer and a
candidate selector that picks the proposals.

Differences from DFlash, all over the block rows of one draft call (the context rows are unchanged):

* **Grouped dynamic causal convolution** (:class:`GroupedDynamicCausalConv`), around attention and around the
  MLP of every layer. ``prepare`` (on the normed sublayer input x [b, q, H]) predicts two dynamic kernels
  ``kernel_projection(x) -> [b, q, 2, K, H/G]`` (G = ``conv_group_size`` channels share one value), convolves
  x causally over the block with ``base_kernel[0] + dynamic[0]`` and hands ``dynamic[1]`` to ``finish``, which
  convolves the sublayer output with ``base_kernel[1] + dynamic[1]``:
  ``y[t, c] = sum_o (base[o, c] + d[t, o, c // G]) * x[t - o, c]``, rows before the block's first row are zero.
* **Candidate selector** (:class:`CandidateSelector`). The proposals of block positions 1..q-1 are a path
  walked left to right from the anchor: at position i the candidates are the ``selector_top_k`` best draft
  logits, each scored ``logit + <predecessor[prev] * hidden_projection(h_i), successor[candidate]>`` (rank
  ``selector_rank`` codebooks over the full target vocabulary); temperature 0 takes the best score (the first
  candidate on ties), T > 0 samples from ``softmax(score / T)``; ``prev`` becomes the chosen token.
* **Sampled verification**: the draft distribution of position i is sparse, q_i over its k candidates, so the
  rejection test uses ``q_i(d_i)`` and the residual ``max(p - q_i, 0)`` (``dflash_kernels.verify_sample`` with
  ``draft_probs`` / ``draft_indices``).

Checkpoint format (z-lab layout; H hidden, K taps, G group, V vocabulary, r rank), beside DFlash's tensors::

    layers.{i}.attention_conv.base_kernel               [2, K, H]      side 0 before, side 1 after the sublayer
    layers.{i}.attention_conv.kernel_projection.weight  [2*K*H/G, H]
    layers.{i}.mlp_conv.base_kernel                     [2, K, H]
    layers.{i}.mlp_conv.kernel_projection.weight        [2*K*H/G, H]
    candidate_selector.predecessor_codebook             [V, r]   published without a ".weight" suffix
    candidate_selector.successor_codebook               [V, r]   (a ".weight" suffix is accepted on load)
    candidate_selector.hidden_projection.weight         [r, H]

``kernel_projection`` rows are ordered [side, tap, group] (row ``(side * K + tap) * H/G + group``).
``config.json``: ``architectures: ["DFlash2DraftModel"]`` and, in ``dflash_config`` (or the top level),
``conv_kernel_size``, ``conv_group_size``, ``selector_rank``, ``selector_top_k`` (all required).

speculators (vllm-project/speculators, ``src/speculators/models/dflash2/``) has a DFlash2 schema:
``speculators_model_type: "dflash2"`` with the four keys flat at the top level, the same tensor names (its
codebooks are parameters without ``.weight``), the full target vocabulary and ``sample_from_anchor`` false;
:mod:`dflash.speculators` maps it to this form.
"""
from __future__ import annotations

import torch
from torch import nn

from dflash.config import DFlashConfig
from dflash.draft import DFlashDecoderLayer
from dflash_kernels.conv_prepare import dynamic_conv_prepare_reference
from dflash_kernels.dynamic_conv import grouped_dynamic_conv_reference

CODEBOOKS = ("predecessor_codebook", "successor_codebook")


class GroupedDynamicCausalConv(nn.Module):
    """The two convolutions around one sublayer: ``prepare`` before it, ``finish`` after it."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size = kernel_size
        self.group_size = group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * (hidden_size // group_size), bias=False)

    def reset_base_kernel(self) -> None:
        """Identity convolutions (tap 0 = 1, the others 0): with a zero projection the layer is a DFlash layer."""
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [b, q, H] (normed sublayer input) -> (convolved x, the dynamic kernel [b, q, K, H/G] of ``finish``):
        :func:`dflash_kernels.conv_prepare.dynamic_conv_prepare_reference` (the projection, then side 0's
        convolution)."""
        convolved, dynamic = dynamic_conv_prepare_reference(x, self.kernel_projection.weight, self.base_kernel[0])
        return convolved, dynamic[:, :, 1]

    def finish(self, y: torch.Tensor, dynamic: torch.Tensor) -> torch.Tensor:
        return grouped_dynamic_conv_reference(y, dynamic, self.base_kernel[1])


class DFlash2DecoderLayer(DFlashDecoderLayer):
    """A DFlash layer whose attention and MLP are each wrapped by a grouped dynamic causal convolution; the
    block's queries and its own keys/values come from the convolved rows.

    The q block rows are one block, or, when an ``attention_mask`` or ``attention_fn`` packs many blocks into one
    call (as ``dflash train`` does), q / ``block_size`` blocks of ``block_size`` rows each: every block is
    convolved on its own, so no row reads a neighbouring block's."""

    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        d2 = config.dflash2
        self.block_size = config.block_size
        self.attention_conv = GroupedDynamicCausalConv(config.hidden_size, d2.conv_kernel_size, d2.conv_group_size)
        self.mlp_conv = GroupedDynamicCausalConv(config.hidden_size, d2.conv_kernel_size, d2.conv_group_size)

    def forward(self, hidden, context, cos, sin, past_key_values=None, attention_mask=None, attention_fn=None):
        rows = hidden.shape
        if attention_mask is not None or attention_fn is not None:
            if rows[1] % self.block_size:
                raise ValueError(f"packed blocks (attention_mask or attention_fn given): {rows[1]} block rows are "
                                 f"not a whole number of blocks of block_size={self.block_size}; pass "
                                 f"block_size rows per packed block")

            def blocks(x):
                return x.reshape(-1, self.block_size, rows[-1])
        else:
            def blocks(x):
                return x
        attn_in, kernel = self.attention_conv.prepare(blocks(self.input_layernorm(hidden)))
        attn_out = self.self_attn(attn_in.reshape(rows), context, cos, sin, past_key_values, attention_mask,
                                  attention_fn)
        hidden = hidden + self.attention_conv.finish(blocks(attn_out), kernel).reshape(rows)
        mlp_in, kernel = self.mlp_conv.prepare(blocks(self.post_attention_layernorm(hidden)))
        return hidden + self.mlp_conv.finish(self.mlp(mlp_in), kernel).reshape(rows)


class CandidateSelector(nn.Module):
    """Reranks the draft's top-k candidates of each block position along a left-to-right path."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        d2 = config.dflash2
        self.top_k = d2.selector_top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(config.vocab_size, d2.selector_rank))
        self.successor_codebook = nn.Parameter(torch.empty(config.vocab_size, d2.selector_rank))
        self.hidden_projection = nn.Linear(config.hidden_size, d2.selector_rank, bias=False)

    def transition_scores(self, projected: torch.Tensor, prev: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """``<predecessor[prev] * projected, successor[candidate]>`` for ``projected`` [..., r] (``hidden_projection``
        of the rows), ``prev`` [...] and ``candidates`` [..., k] token ids -> [..., k]; training scores every row
        at once with it (teacher-forced ``prev``)."""
        return torch.einsum("...r,...kr->...k", self.predecessor_codebook[prev] * projected,
                            self.successor_codebook[candidates])

    def select(self, hidden: torch.Tensor, logits: torch.Tensor, anchor: torch.Tensor, temperature: float = 0.0,
               generator: torch.Generator | None = None):
        """hidden [b, n, H] and logits [b, n, V] of the n proposal rows, anchor [b] -> ``(path [b, n] int64,
        candidates [b, n, k] int64, q [b, n, k] fp32 or None)``: the walk's tokens, each position's candidates
        (``torch.topk`` order, unsorted), and at temperature > 0 the selector's distribution over them."""
        unary, candidates = torch.topk(logits, self.top_k, dim=-1, sorted=False)
        projected = self.hidden_projection(hidden)
        prev = anchor
        path, q_rows = [], []
        for i in range(hidden.shape[1]):
            scores = unary[:, i] + self.transition_scores(projected[:, i], prev, candidates[:, i])
            if temperature > 0:
                q = torch.softmax(scores.float() / temperature, dim=-1)
                index = torch.multinomial(q, 1, generator=generator)[:, 0]
                q_rows.append(q)
            else:
                index = torch.argmax(scores, dim=-1)
            prev = candidates[:, i].gather(-1, index[:, None])[:, 0]
            path.append(prev)
        return torch.stack(path, dim=1), candidates, torch.stack(q_rows, dim=1) if q_rows else None

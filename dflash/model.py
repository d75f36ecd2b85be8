"""z-lab's ``dflash.model`` surface: ``DFlashDraftModel`` and ``DFlash2DraftModel`` with ``spec_generate``,
and the helpers z-lab exports beside it.

The network and its checkpoint I/O are :class:`dflash.draft.DraftModel` (DFlash2's extra layers:
:mod:`dflash.dflash2`); this module adds the z-lab classes and generation entry point on top, so the draft
itself never depends on the runtime.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from dflash.api import generate
from dflash.config import DFlashConfig, build_target_layer_ids
from dflash.dflash2 import CODEBOOKS, CandidateSelector, DFlash2DecoderLayer, GroupedDynamicCausalConv
from dflash.draft import DraftKVCache, DraftModel
from dflash.sampling import sample
from dflash.target import extract_context_feature

__all__ = ["DFlash2DraftModel", "DFlashDraftModel", "DraftKVCache", "build_target_layer_ids", "extract_context_feature",
           "sample"]


class DFlashDraftModel(DraftModel):
    """Block-diffusion draft conditioned on target features (z-lab ``DFlashDraftModel``).

    The draft owns no embedding or LM head: callers embed block tokens with the target's
    embedding table and score the returned hidden states with the target's LM head
    (:meth:`compute_logits`). Load z-lab checkpoints with :meth:`from_pretrained`.
    """

    @torch.inference_mode()
    def spec_generate(
        self,
        target,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        stop_token_ids: Sequence[int] | None = None,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
    ) -> torch.Tensor:
        """Speculative generation with this draft (z-lab contract): returns prompt + generated ids [1, n]."""
        return generate(
            target, self, input_ids, max_new_tokens, stop_token_ids=stop_token_ids,
            temperature=temperature, top_p=top_p, top_k=top_k,
        ).sequences

    @classmethod
    def class_for(cls, config: DFlashConfig, *, source: str) -> type[DraftModel]:
        """A DFlash2 config loads as :class:`DFlash2DraftModel` (when that is a kind of ``cls``)."""
        if config.dflash2 is not None and issubclass(DFlash2DraftModel, cls):
            return DFlash2DraftModel
        return super().class_for(config, source=source)


class DFlash2DraftModel(DFlashDraftModel):
    """DFlash2 draft (z-lab ``DFlash2DraftModel``; the network and checkpoint format are described in
    :mod:`dflash.dflash2`): load official checkpoints with :meth:`from_pretrained`; :meth:`select_block` turns a
    draft pass into the block's proposals."""

    layer_class = DFlash2DecoderLayer
    runs_dflash2 = True

    def __init__(self, config: DFlashConfig):
        super().__init__(config)
        self.candidate_selector = CandidateSelector(config)
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        """Linear weights N(0, std) as DFlash; identity base kernels; codebooks N(0, std)."""
        super().reset_parameters(std)
        for module in self.modules():
            if isinstance(module, GroupedDynamicCausalConv):
                module.reset_base_kernel()
        if hasattr(self, "candidate_selector"):  # absent while DraftModel.__init__ calls this
            for name in CODEBOOKS:
                nn.init.normal_(getattr(self.candidate_selector, name), std=std)

    @classmethod
    def checkpoint_state(cls, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Codebooks saved as ``nn.Embedding`` weights (``...codebook.weight``) under their published names."""
        renamed = {f"candidate_selector.{name}.weight": f"candidate_selector.{name}" for name in CODEBOOKS}
        return {renamed.get(key, key): value for key, value in state.items()}

    def propose(self, hidden, output_head, out=None, linear=F.linear):
        raise TypeError("DFlash2 proposals depend on the anchor token and the temperature: call "
                        "select_block(hidden, output_head, anchor, temperature)")

    def select_block(self, hidden: torch.Tensor, output_head, anchor: torch.Tensor, temperature: float = 0.0,
                     generator: torch.Generator | None = None, linear=F.linear):
        """The proposals of one draft pass: ``hidden`` [b, q, H] (all block rows, as returned by ``forward``),
        ``anchor`` [b] the verified token of row 0 -> :meth:`CandidateSelector.select` over rows 1..q-1.
        ``linear``: the LM head's GEMM (as in :meth:`compute_logits`)."""
        logits = self.block_logits(hidden, output_head, linear)
        return self.candidate_selector.select(hidden[:, 1:], logits, anchor, temperature, generator)

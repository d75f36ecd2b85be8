"""z-lab's ``dflash.model`` surface: ``DFlashDraftModel`` with ``spec_generate``, and the helpers
z-lab exports beside it.

The network and its checkpoint I/O are :class:`dflash.draft.DraftModel`; this module only adds the
z-lab generation entry point on top, so the draft itself never depends on the runtime.
"""
from __future__ import annotations

from typing import Sequence

import torch

from dflash.api import generate
from dflash.config import build_target_layer_ids
from dflash.draft import DraftKVCache, DraftModel
from dflash.sampling import sample
from dflash.target import extract_context_feature

__all__ = ["DFlash2DraftModel", "DFlashDraftModel", "DraftKVCache", "build_target_layer_ids", "extract_context_feature", "sample"]


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


def __getattr__(name: str):
    """``DFlash2DraftModel`` lives in :mod:`dflash.dflash2` (it builds on this module); z-lab exports it here."""
    if name == "DFlash2DraftModel":
        from dflash.dflash2 import DFlash2DraftModel

        return DFlash2DraftModel
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

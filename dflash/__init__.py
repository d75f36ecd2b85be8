"""dflash: DFlash speculative decoding runtime (z-lab ``dflash`` compatible API)."""
from dflash.config import DFlashConfig, build_target_layer_ids
from dflash.model import DFlashDraftModel, DraftKVCache
from dflash.target import TargetAdapter, extract_context_feature

__all__ = [
    "DFlashConfig",
    "DFlashDraftModel",
    "DraftKVCache",
    "TargetAdapter",
    "build_target_layer_ids",
    "extract_context_feature",
]

"""dflash: DFlash speculative decoding runtime (z-lab ``dflash`` compatible API)."""
from dflash.config import DFlashConfig, build_target_layer_ids
from dflash.generate import GenerateResult, generate
from dflash.model import DFlashDraftModel, DraftKVCache
from dflash.sampling import sample
from dflash.target import TargetAdapter, extract_context_feature

__all__ = [
    "DFlashConfig",
    "DFlashDraftModel",
    "DraftKVCache",
    "GenerateResult",
    "TargetAdapter",
    "build_target_layer_ids",
    "extract_context_feature",
    "generate",
    "sample",
]

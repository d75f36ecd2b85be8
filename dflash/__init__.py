"""dflash: DFlash speculative decoding runtime (z-lab ``dflash`` compatible API)."""
from dflash.api import generate
from dflash.config import DFlashConfig, build_target_layer_ids
from dflash.draft import DraftKVCache
from dflash.model import DFlash2DraftModel, DFlashDraftModel
from dflash.results import BatchResult, GenerateResult
from dflash.sampling import sample
from dflash.target import TargetAdapter, extract_context_feature

__all__ = [
    "BatchResult",
    "DFlash2DraftModel",
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

"""dflash_kernels: Triton and C++/CUDA kernels for DFlash speculative decoding.

Every op has a pure-PyTorch reference (its definition), a Triton kernel and, where the
extension provides one, a compiled op; the public function takes ``backend=``. The CPU wing
(``dflash_kernels.cpu``) registers the ops' CPU bodies (backend ``"cpu"``) when the package is imported. Importing the
package registers each op as ``torch.ops.dflash.<op>`` (a ``torch.library`` custom op with a fake
kernel); the public functions validate and then make exactly one such call. The compiled extension
(``torch.ops.dflash_ext.*``) is optional and loaded on first use, never here.
"""
from __future__ import annotations

import torch

from dflash_kernels._dispatch import (
    BACKENDS, BackendTraits, backend_status, backend_traits, default_backend, unobserved_eager,
)

__all__ = ["BACKENDS", "BackendTraits", "available_backends", "backend_traits", "default_backend", "unobserved_eager"]


def available_backends(device: str | torch.device = "cpu") -> dict[str, tuple[bool, str]]:
    """Map each backend to ``(usable, reason)`` for tensors on ``device``."""
    device = torch.device(device)
    return {name: backend_status(name, device) for name in BACKENDS if name != "auto"}

from dflash_kernels.draft_attention import draft_attention, verify_attention  # noqa: E402
from dflash_kernels.dynamic_conv import grouped_dynamic_conv  # noqa: E402
from dflash_kernels.candidate_select import candidate_select  # noqa: E402
from dflash_kernels.fused_context import fused_context  # noqa: E402
from dflash_kernels.inject_context_kv import inject_context_kv  # noqa: E402
from dflash_kernels.layer_ops import add_rms_norm, silu_mul  # noqa: E402
from dflash_kernels.conv_prepare import dynamic_conv_prepare  # noqa: E402
from dflash_kernels.gated_mlp import gate_up_silu  # noqa: E402
from dflash_kernels.qkv_proj import qkv_proj  # noqa: E402
from dflash_kernels.verify import verify_greedy, verify_greedy_tokens, verify_sample  # noqa: E402

__all__ += ["fused_context", "inject_context_kv", "draft_attention", "verify_attention", "verify_greedy",
            "verify_greedy_tokens", "verify_sample"]
from dflash_kernels.commit import (  # noqa: E402
    commit_round, commit_round_reference, draft_round_setup, first_token_done,
)

__all__ += ["commit_round", "commit_round_reference", "draft_round_setup", "first_token_done", "add_rms_norm",
            "silu_mul", "gate_up_silu", "qkv_proj", "grouped_dynamic_conv", "dynamic_conv_prepare",
            "candidate_select"]
from dflash_kernels.tree import (  # noqa: E402
    build_tree, distinct_prefixes, tree_accept_greedy, tree_accept_greedy_tokens, tree_accept_sample,
    tree_ancestor_mask, tree_compact, tree_graft_lookup,
)

__all__ += ["build_tree", "distinct_prefixes", "tree_ancestor_mask", "tree_accept_greedy", "tree_accept_greedy_tokens",
            "tree_accept_sample", "tree_compact", "tree_graft_lookup"]

# The CPU wing registers its op bodies and the "cpu" backend's traits (after the ops it implements).
from dflash_kernels.cpu import (  # noqa: E402,F401
    attention as _cpu_attention, backend as _cpu_backend, commit as _cpu_commit,
    inject_context_kv as _cpu_inject_context_kv, layer_ops as _cpu_layer_ops, tree as _cpu_tree, verify as _cpu_verify,
)

"""What the ``"cpu"`` backend offers the runtime's steps (:class:`dflash_kernels.BackendTraits`)."""
from __future__ import annotations

from dflash_kernels._dispatch import BackendTraits, register_traits

# fused_gemm: the skinny-GEMM kernel (``cpu.linear``) beats the fused ops' GEMM, whose CPU path is their
# reference; argmax_head: ``cpu.linear.linear_argmax`` screens most of the vocabulary instead of computing it;
# host_eager: the steps run eagerly on CPU tensors.
register_traits("cpu", BackendTraits(fused_gemm=False, argmax_head=True, host_eager=True))

"""The CPU wing of dflash_kernels: the native CPU kernels (``native``), the fp32/bf16 projections (``linear``) and
the lean target's native forward (``forward``). Nothing here imports the ``dflash`` runtime."""

"""Other runtimes' DFlash paths on this library's ops: :mod:`dflash_kernels.integrations.vllm`."""

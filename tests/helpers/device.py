"""Device the kernel tests run on: the GPU with compiled Triton when there is one, else the CPU interpreter."""
import os

import torch

DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1" else "cpu"

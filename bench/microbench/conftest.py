import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
for sub in ("", "bench"):
    p = str(ROOT / sub) if sub else str(ROOT)
    if p not in sys.path:
        sys.path.insert(0, p)

torch.set_num_threads(1)  # the cores are shared: one thread gives steadier numbers

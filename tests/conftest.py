import os

# Triton's interpreter must be chosen before any @triton.jit decorator runs.
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

# Test shapes are tiny: one thread avoids oversubscription when tests share the two cores.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _deterministic_seed(request):
    """A fresh, logged seed per test: random inputs change between runs but failures replay."""
    seed = int(os.environ.get("DFLASH_TEST_SEED", torch.seed() % (2**31)))
    torch.manual_seed(seed)
    request.node.user_properties.append(("seed", seed))
    yield

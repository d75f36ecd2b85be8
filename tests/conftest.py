import os
import random

# Triton's interpreter must be chosen before any @triton.jit decorator runs.
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from helpers.seeds import node_seed  # noqa: E402

# Test shapes are tiny: one thread avoids oversubscription when tests share the two cores.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def seed(request) -> int:
    """This test's seed (``node_seed`` of its node id, or ``DFLASH_TEST_SEED`` to try another draw): torch,
    ``random`` and numpy are seeded with it before the test runs, and a failure report names it."""
    value = int(os.environ.get("DFLASH_TEST_SEED", node_seed(request.node.nodeid)))
    torch.manual_seed(value)
    random.seed(value)
    np.random.seed(value)
    request.node.user_properties.append(("seed", value))
    return value


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A failing test's report gets a ``seed`` section: the seed its random inputs were drawn with."""
    report = yield
    if report.failed:
        for name, value in item.user_properties:
            if name == "seed":
                report.sections.append(("seed", f"{item.nodeid} ran with seed {value} (DFLASH_TEST_SEED={value})"))
    return report

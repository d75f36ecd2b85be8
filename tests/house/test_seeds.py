"""Every test is seeded from its node id (tests/conftest.py): the same draws on every run and machine, different
draws for different tests, and a failing test's report names its seed."""
from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers.seeds import node_seed

TESTS = Path(__file__).resolve().parents[1]


def test_node_seed_is_a_fixed_function_of_the_id():
    """Fixed values (sha256, not Python's per-process salted hash), in [0, 2^31), distinct per parameter set."""
    assert node_seed("tests/kernels/test_tree.py::test_build_tree[torch]") == 666497974
    assert node_seed("tests/kernels/test_tree.py::test_build_tree[triton]") == 1937424359
    ids = [f"tests/x.py::test_y[{i}]" for i in range(1000)]
    seeds = [node_seed(i) for i in ids]
    assert len(set(seeds)) == len(ids) and all(0 <= s < 2**31 for s in seeds)


@pytest.mark.skipif("DFLASH_TEST_SEED" in os.environ, reason="DFLASH_TEST_SEED replaces the node id's seed")
def test_torch_random_and_numpy_start_from_the_node_seed(seed, request):
    assert seed == node_seed(request.node.nodeid)
    assert ("seed", seed) in request.node.user_properties
    assert torch.equal(torch.rand(5), torch.rand(5, generator=torch.Generator().manual_seed(seed)))
    assert random.random() == random.Random(seed).random()
    assert np.random.random() == np.random.RandomState(seed).random_sample()


def test_a_failure_names_its_seed(tmp_path):
    """A session with this suite's conftest: the failing test's report has a seed section with its node seed; the
    passing test's has none."""
    (tmp_path / "conftest.py").write_text((TESTS / "conftest.py").read_text())
    (tmp_path / "test_example.py").write_text("def test_fails():\n    assert False\n\n\ndef test_passes():\n    pass\n")
    env = {k: v for k, v in os.environ.items() if k != "DFLASH_TEST_SEED"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_example.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    want = node_seed("test_example.py::test_fails")
    assert f"test_example.py::test_fails ran with seed {want}" in done.stdout, done.stdout
    assert done.stdout.count(" ran with seed ") == 1, done.stdout

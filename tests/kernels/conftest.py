"""Run the kernel tests on the GPU when there is one (compiled Triton), else on the CPU interpreter.

Tests create tensors with factory functions and no device argument; the default device decides.
"""
import pytest
import torch

from helpers.device import DEVICE


@pytest.fixture(autouse=True)
def _kernel_test_device():
    previous = torch.get_default_device()
    torch.set_default_device(DEVICE)
    yield
    # CPU is also the default without any device mode: drop the mode rather than leave one pushed for later tests
    torch.set_default_device(None if previous.type == "cpu" else previous)

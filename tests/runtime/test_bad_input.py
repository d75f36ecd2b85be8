"""Bad input raises a clear error naming the argument, before any work."""
from __future__ import annotations

import pytest
import torch

from dflash import TargetAdapter, generate
from helpers.tiny_models import make_draft, make_target


@pytest.fixture(scope="module")
def pair():
    target = make_target("qwen3")
    return target, make_draft(target, layers=1, block_size=4)


def ids(n=5, vocab=48):
    return torch.randint(0, vocab, (1, n))


@pytest.mark.parametrize("kwargs,exc,match", [
    ({"max_new_tokens": 0}, ValueError, "max_new_tokens"),
    ({"max_new_tokens": 2.5}, ValueError, "max_new_tokens"),
    ({"temperature": -1.0}, ValueError, "temperature"),
    ({"temperature": float("nan")}, ValueError, "temperature"),
    ({"top_p": 0.0}, ValueError, "top_p"),
    ({"top_p": 1.5}, ValueError, "top_p"),
    ({"top_k": -2}, ValueError, "top_k"),
    ({"block_size": 0}, ValueError, "block_size"),
    ({"block_size": 65}, ValueError, r"block_size must be an integer in \[1, 64\]"),
    ({"block_size": 100000}, ValueError, r"block_size must be an integer in \[1, 64\]"),
    ({"block_size": 10**9}, ValueError, r"block_size must be an integer in \[1, 64\]"),
    ({"max_new_tokens": 508}, ValueError, "max_position_embeddings 512"),
    ({"backend": "cuda-magic"}, ValueError, "backend"),
])
@pytest.mark.parametrize("backend", ["fast", "reference"])
def test_bad_arguments(pair, kwargs, exc, match, backend):
    """Both runtimes make the same checks, before any work."""
    target, draft = pair
    args = {"max_new_tokens": 4, "backend": backend, **kwargs}
    with pytest.raises(exc, match=match):
        generate(target, draft, ids(), **args)


def test_block_size_limits(pair):
    target, draft = pair
    prompt = ids()
    for backend in ("fast", "reference"):
        # the largest block size and the longest request still run (max_position_embeddings 512)
        assert generate(target, draft, prompt, 6, block_size=64, backend=backend).sequences.shape == (1, 11)
        assert generate(target, draft, prompt, 507, backend=backend).sequences.shape == (1, 512)
    too_big = make_draft(target, layers=1, block_size=65)
    for backend in ("fast", "reference"):
        with pytest.raises(ValueError, match=r"block_size \(the draft config's\) must be an integer in \[1, 64\]"):
            generate(target, too_big, prompt, 4, backend=backend)


@pytest.mark.parametrize("input_ids,exc,match", [
    (torch.zeros(1, 0, dtype=torch.long), ValueError, "empty"),
    (torch.rand(1, 4), TypeError, "integer"),
    (torch.tensor([[1, 2, 48]]), ValueError, "vocabulary"),
    (torch.tensor([[1, -1]]), ValueError, "vocabulary"),
    (torch.randint(0, 48, (2, 4)), ValueError, "batch"),
    (torch.randint(0, 48, (1, 2, 3)), ValueError, "shape"),
    ([1, 2, 3], TypeError, "LongTensor"),
])
def test_bad_input_ids(pair, input_ids, exc, match):
    target, draft = pair
    with pytest.raises(exc, match=match):
        generate(target, draft, input_ids, 4, backend="reference")


def test_mismatched_models():
    target = make_target("qwen3")
    wide = make_target("qwen3", hidden=64)
    with pytest.raises(ValueError, match="hidden_size"):
        generate(wide, make_draft(target), ids(), 4)
    with pytest.raises(ValueError, match="mask_token_id"):
        generate(target, make_draft(target, mask_token_id=48), ids(), 4)
    with pytest.raises(ValueError, match="target_layer_ids"):
        generate(target, make_draft(target, taps=[0, 4]), ids(), 4)
    deeper = make_target("qwen3", layers=6)  # taps 1 and 2 exist in both: only the config tells them apart
    for backend in ("fast", "reference"):
        for model in (target, TargetAdapter(target, [1, 2])):
            with pytest.raises(ValueError, match="num_target_layers=6, but the target has 4 decoder layers"):
                generate(model, make_draft(deeper, taps=[1, 2]), ids(), 4, backend=backend)
            with pytest.raises(ValueError, match="layer 4 is out of range for a target with 4 decoder layers"):
                generate(model, make_draft(target, taps=[1, 4]), ids(), 4, backend=backend)
    with pytest.raises(TypeError, match="draft"):
        generate(target, torch.nn.Linear(2, 2), ids(), 4)


def test_unsupported_target():
    gpt2_like = torch.nn.Module()
    gpt2_like.config = type("Cfg", (), {"model_type": "gpt2"})()
    with pytest.raises(TypeError, match="model_type 'gpt2'"):
        TargetAdapter(gpt2_like, [0])


def test_draft_forward_shape_errors(pair):
    _, draft = pair
    H = draft.config.hidden_size
    with pytest.raises(ValueError, match="target_hidden"):
        draft(position_ids=torch.arange(6)[None], noise_embedding=torch.randn(1, 4, H),
              target_hidden=torch.randn(1, 2, H + 1))
    with pytest.raises(ValueError, match="position_ids"):
        draft(position_ids=torch.arange(5)[None], noise_embedding=torch.randn(1, 4, H),
              target_hidden=torch.randn(1, 2, H * draft.config.num_taps))
    # control: the same call with consistent shapes runs, so the errors above come from the shapes alone
    out = draft(position_ids=torch.arange(6)[None], noise_embedding=torch.randn(1, 4, H),
                target_hidden=torch.randn(1, 2, H * draft.config.num_taps))
    assert out.shape == (1, 4, H) and bool(torch.isfinite(out).all())

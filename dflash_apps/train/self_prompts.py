"""Self-generated user prompts (the Magpie method), no download: the instruct target continues its own chat
template from the start of a user turn, after one of :data:`SYSTEM_PROMPTS`, sampled at temperature about 1, so
the prompts vary in task, register and length the way the target's own training conversations did.

Each sample is filtered (finished before the token limit, length, mostly ASCII text, no looping repetition, no
chat-template markup) and deduplicated (case, punctuation and spacing ignored; prompts of the hand-written natural
evaluation set are dropped too). The ``index``-th sample depends only on the seed, the index, the settings and
the model's probabilities (one ``torch.Generator`` seeded from ``(seed, index)``), so a run resumes where its
prompts file ends and a longer run extends a shorter one. The held-out slice is the eval side of the hash split
(:func:`dflash_apps.train.prompts.split_of` at :data:`EVAL_FRACTION`): :func:`load_self_prompts` with ``split="eval"``,
the ``self`` evaluation set; ``split="train"`` is the training side.

Prompts file (JSON lines): a header ``{"format": "dflash-self-prompts-v1", "seed", "temperature", "top_p",
"max_new_tokens"}``, then one record a sample ``{"index", "system", "prompt", "verdict"}`` with ``verdict``
``"kept"`` or the filter's reason.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import time
from typing import Callable

FORMAT = "dflash-self-prompts-v1"
EVAL_FRACTION = 0.1
MIN_CHARS, MAX_CHARS, MIN_WORDS = 16, 1500, 3
MAX_NON_ASCII = 0.05  # share of non-space characters outside ASCII above which a sample is "not English"
MIN_DISTINCT_TRIGRAMS = 0.6  # distinct word trigrams / trigrams, below which a sample "repeats itself"
SYSTEM_PROMPTS = [
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face",
    "You are a friendly assistant who helps people with everyday questions.",
    "You are an expert Python programmer who helps users write, explain and fix code.",
    "You are a patient maths tutor for school students.",
    "You are a creative writing assistant who writes poems and short stories on request.",
    "You are a helpful assistant for writing e-mails and messages at work.",
    "You are a science teacher who explains how nature works in simple words.",
    "You are a history enthusiast who answers questions about the past.",
    "You are a cooking assistant who suggests recipes and meal plans.",
    "You are a travel guide who helps people plan trips.",
    "You are an editor who summarizes, shortens and rewrites texts.",
    "You are a language tutor who translates and corrects sentences.",
    "You are a career coach who gives practical advice.",
    "You are a health and fitness assistant (not a doctor) who gives general tips.",
    "You are a personal finance assistant who explains money matters plainly.",
    "You are a helpful assistant. Users ask you short questions and you answer them.",
]
_MARKER = "\x00user turn\x00"


def default_path() -> str:
    from dflash_apps.smollm2 import cache_path

    return cache_path("data", "smollm2-self-prompts.jsonl")


def user_turn_prefix(tokenizer, system: str) -> str:
    """The chat template's text up to where the user's words begin, after the system prompt ``system``."""
    text = tokenizer.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": _MARKER}],
                                         tokenize=False, add_generation_prompt=False)
    if _MARKER not in text:
        raise ValueError("tokenizer: its chat template does not place the user's message verbatim")
    return text[:text.index(_MARKER)]


def sample_user_turns(model, tokenizer, systems: list[str], generators, *, max_new_tokens: int, temperature: float,
                      top_p: float, stop_token_ids) -> list[tuple[str, bool]]:
    """User turns the target writes itself, one per system prompt of ``systems``, sampled together in one
    left-padded batch (row ``i`` draws from ``generators[i]`` only, and only while it is unfinished): per row
    ``(text, finished)``, ``finished`` False when it hit ``max_new_tokens`` before a stop token."""
    import torch

    from dflash.sampling import sample

    prefixes = [tokenizer(user_turn_prefix(tokenizer, s), add_special_tokens=False)["input_ids"] for s in systems]
    b, width = len(prefixes), max(len(p) for p in prefixes)
    step_ids = torch.tensor([[0] * (width - len(p)) + p for p in prefixes])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prefixes])
    stops = set(stop_token_ids)
    out: list[list[int]] = [[] for _ in range(b)]
    finished = [False] * b
    past = None
    with torch.no_grad():
        for _ in range(max_new_tokens):
            pos = (mask.cumsum(-1) - 1).clamp(min=0)[:, -step_ids.shape[1]:]
            res = model(input_ids=step_ids, attention_mask=mask, position_ids=pos, past_key_values=past, use_cache=True)
            past = res.past_key_values
            tokens = []
            for i in range(b):
                token = 0
                if not finished[i]:
                    token = int(sample(res.logits[i, -1].float(), temperature, top_p, generator=generators[i]))
                    finished[i] = token in stops
                    if not finished[i]:
                        out[i].append(token)
                tokens.append(token)
            if all(finished):
                break
            step_ids = torch.tensor(tokens)[:, None]
            mask = torch.cat([mask, torch.ones(b, 1, dtype=mask.dtype)], dim=1)
    return [(tokenizer.decode(o, skip_special_tokens=False).strip(), f) for o, f in zip(out, finished)]


def filter_verdict(text: str, finished: bool) -> str:
    """``"kept"`` or why the sample is dropped: ``truncated``, ``too short``, ``too long``, ``template markup``,
    ``not English`` or ``repetition``."""
    if not finished:
        return "truncated"
    words = text.split()
    if len(text) < MIN_CHARS or len(words) < MIN_WORDS:
        return "too short"
    if len(text) > MAX_CHARS:
        return "too long"
    if "<|" in text or "|>" in text:
        return "template markup"
    if not mostly_ascii(text):
        return "not English"
    trigrams = [tuple(w.lower() for w in words[i:i + 3]) for i in range(len(words) - 2)]
    if len(trigrams) >= 6 and len(set(trigrams)) < MIN_DISTINCT_TRIGRAMS * len(trigrams):
        return "repetition"
    return "kept"


def mostly_ascii(text: str) -> bool:
    """Whether at most :data:`MAX_NON_ASCII` of the non-space characters of ``text`` are outside ASCII (the filters'
    test for English text)."""
    visible = [c for c in text if not c.isspace()]
    return sum(not c.isascii() for c in visible) <= MAX_NON_ASCII * len(visible)


def dedup_key(text: str) -> str:
    """What two prompts must share to count as duplicates: their words, lowercased, without punctuation."""
    return " ".join(re.sub(r"[^\w\s]", " ", text.lower()).split())


def sample_seed(seed: int, index: int) -> int:
    """The generator seed of sample ``index`` of a run seeded ``seed`` (independent of every other index)."""
    return int.from_bytes(hashlib.sha256(f"self-prompts-{seed}-{index}".encode()).digest()[:8], "little")


def _read(path: str) -> tuple[dict | None, list[dict]]:
    if not os.path.isfile(path):
        return None, []
    with open(path, encoding="utf-8") as f:
        lines = [json.loads(line) for line in f if line.strip()]
    if not lines or lines[0].get("format") != FORMAT:
        raise ValueError(f"{path}: not a self-prompts file (its first line must be a {FORMAT} header)")
    return lines[0], lines[1:]


def generate_self_prompts(model, tokenizer, path: str, count: int, *, seed: int = 0, temperature: float = 1.0,
                          top_p: float = 1.0, max_new_tokens: int = 96, batch_size: int = 1, stop_token_ids=None,
                          log: Callable[[str], None] = print) -> dict:
    """Sample until ``path`` holds ``count`` samples (kept or dropped), appending one record a sample; a file
    already there is resumed (it must have been made with the same settings). Samples are drawn ``batch_size``
    at a time (:func:`sample_user_turns`), in the fixed batches ``[k * batch_size, (k + 1) * batch_size)`` of
    indices, so that an interrupted or shorter run resumes to the very samples of an uninterrupted one (a batch
    cut by ``count`` is drawn whole again on resume; batching moves the logits by rounding, so the batch size is
    one of the file's settings). Returns counts by verdict, the new samples and their rate in samples and kept
    prompts per minute."""
    import torch

    from dflash.sampling import SamplingParams
    from dflash_apps.train.natural_prompts import natural_eval_prompts

    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"count must be an integer >= 1, got {count!r}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    SamplingParams(temperature, top_p)
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 (self-generated prompts are sampled), got {temperature!r}")
    header = {"format": FORMAT, "seed": seed, "temperature": temperature, "top_p": top_p,
              "max_new_tokens": max_new_tokens} | ({"batch_size": batch_size} if batch_size > 1 else {})
    old_header, records = _read(path)
    if old_header is not None and old_header != header:
        raise ValueError(f"{path} was made with {old_header}, not {header}: pass the same settings to resume, or "
                         f"another --out")
    if stop_token_ids is None:
        from dflash_apps.smollm2 import stop_token_ids as smollm2_stops

        stop_token_ids = smollm2_stops(tokenizer)
    seen = {dedup_key(p) for p in natural_eval_prompts()}
    seen |= {dedup_key(r["prompt"]) for r in records if r["verdict"] == "kept"}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    t0, new, kept_new = time.perf_counter(), 0, 0
    with open(path, "a", encoding="utf-8") as f:
        if old_header is None:
            f.write(json.dumps(header) + "\n")
        done = len(records)
        for first in range(done - done % batch_size, count, batch_size):
            indices = list(range(first, min(first + batch_size, count)))
            systems = [SYSTEM_PROMPTS[i % len(SYSTEM_PROMPTS)] for i in range(first, first + batch_size)]
            gens = [torch.Generator().manual_seed(sample_seed(seed, i)) for i in range(first, first + batch_size)]
            turns = sample_user_turns(model, tokenizer, systems, gens, max_new_tokens=max_new_tokens,
                                      temperature=temperature, top_p=top_p, stop_token_ids=stop_token_ids)
            for index in indices[max(0, done - first):]:
                text, finished = turns[index - first]
                verdict = filter_verdict(text, finished)
                if verdict == "kept" and dedup_key(text) in seen:
                    verdict = "duplicate"
                if verdict == "kept":
                    seen.add(dedup_key(text))
                    kept_new += 1
                record = {"index": index, "system": systems[index - first], "prompt": text, "verdict": verdict}
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
                records.append(record)
                new += 1
            f.flush()
            log(f"[self-prompts] {len(records)}/{count} samples, {kept_new} of {new} new kept")
    minutes = max(time.perf_counter() - t0, 1e-9) / 60
    verdicts: dict[str, int] = {}
    for r in records:
        verdicts[r["verdict"]] = verdicts.get(r["verdict"], 0) + 1
    return {"samples": len(records), "verdicts": verdicts, "new_samples": new,
            "samples_per_min": new / minutes if new else 0.0, "kept_per_min": kept_new / minutes if new else 0.0}


def load_self_prompts(path: str, split: str | None = None) -> list[str]:
    """The kept prompts of a prompts file in sample order; ``split`` "train" or "eval" keeps that side of the
    hash split only (the eval side is never for training)."""
    return [text for _system, text in self_prompt_records(path, split)]


def self_prompt_records(path: str, split: str | None = None) -> list[tuple[str, str]]:
    """:func:`load_self_prompts` with each prompt's system prompt (the one it was sampled after):
    ``(system, prompt)`` pairs."""
    from dflash_apps.train.prompts import split_of

    if split not in (None, "train", "eval"):
        raise ValueError(f"split must be 'train', 'eval' or None, got {split!r}")
    header, records = _read(path)
    if header is None:
        raise ValueError(f"{path}: no such self-prompts file; make one with `dflash train self-prompts --out {path}`")
    kept = [(r["system"], r["prompt"]) for r in records if r["verdict"] == "kept"]
    return [(s, p) for s, p in kept if split is None or split_of(p, EVAL_FRACTION) == split]

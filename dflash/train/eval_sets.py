"""Evaluation prompt sets of the SmolLM2 draft, by name.

* ``natural``: prompts written by hand in the repository (``dflash/assets/natural-eval-prompts.jsonl``), in many
  styles and lengths; a source no training generator shares, so a τ measured on it cannot reflect the training
  templates. See :func:`natural_eval_prompts`.
* ``self``: the held-out side of the target's self-generated prompts (:mod:`dflash.train.self_prompts`), read
  from a prompts file made by ``dflash train self-prompts``.
* ``template``: the held-out side of the template generators that trained the shipped draft
  (:func:`dflash.train.prompts.eval_prompts`).
"""
from __future__ import annotations

import json
import os

NATURAL_EVAL_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets",
                                 "natural-eval-prompts.jsonl")
PROMPT_SETS = ("natural", "self", "template")


def natural_eval_records(path: str = NATURAL_EVAL_PATH) -> list[dict]:
    """The hand-written evaluation prompts as ``{"style": ..., "prompt": ...}`` records, in file order (the styles
    interleaved, so the first ``n`` cover many styles)."""
    records = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            rec = json.loads(line)
            if not isinstance(rec.get("prompt"), str) or not isinstance(rec.get("style"), str):
                raise ValueError(f"{path}:{line_no}: each line must be a JSON object with string 'style' and "
                                 f"'prompt'")
            records.append(rec)
    return records


def natural_eval_prompts(n: int | None = None, path: str = NATURAL_EVAL_PATH) -> list[str]:
    """The first ``n`` (default all) hand-written evaluation prompts: word problems, functions to complete, code
    review, poems and stories, e-mails and how-tos, summaries of a given passage, "why" questions, rewrites and
    translations, lists, short chat turns, multi-sentence instructions and a few long requests.

    Evaluation only: never used to train a draft or to choose a checkpoint (tests check that none of them occurs
    in the training prompt sources), so the figures measured on them say what a user's own prompts get."""
    prompts = [r["prompt"] for r in natural_eval_records(path)]
    return prompts if n is None else prompts[:_check_count(n, len(prompts), "natural")]


def eval_prompt_set(name: str, n: int, self_prompts_path: str | None = None) -> list[str]:
    """``n`` evaluation prompts of the set ``name`` (one of :data:`PROMPT_SETS`); the ``self`` set reads the
    prompts file ``self_prompts_path`` (default :func:`dflash.train.self_prompts.default_path`)."""
    if name == "natural":
        return natural_eval_prompts(n)
    if name == "template":
        from dflash.train.prompts import eval_prompts

        return eval_prompts(n)
    if name == "self":
        from dflash.train.self_prompts import default_path, load_self_prompts

        path = self_prompts_path or default_path()
        held_out = load_self_prompts(path, split="eval")
        return held_out[:_check_count(n, len(held_out), f"self ({path})")]
    raise ValueError(f"prompt set must be one of {', '.join(PROMPT_SETS)}, got {name!r}")


def _check_count(n: int, available: int, name: str) -> int:
    if not 1 <= n <= available:
        raise ValueError(f"number of prompts must be in 1..{available} for the {name} set, got {n}")
    return n

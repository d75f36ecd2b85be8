"""The hand-written natural evaluation prompts (``dflash_apps/assets/natural-eval-prompts.jsonl``): evaluation only,
never training data (tests check that none occurs in the training prompt sources)."""
from __future__ import annotations

import json
import os

NATURAL_EVAL_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets",
                                 "natural-eval-prompts.jsonl")


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
    return prompts if n is None else prompts[:check_prompt_count(n, len(prompts), "natural")]


def check_prompt_count(n: int, available: int, name: str) -> int:
    """``n`` if it is a valid number of prompts to take from a set of ``available``, else a ValueError."""
    if not 1 <= n <= available:
        raise ValueError(f"number of prompts must be in 1..{available} for the {name} set, got {n}")
    return n

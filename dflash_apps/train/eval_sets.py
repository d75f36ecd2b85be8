"""Evaluation prompt sets of the SmolLM2 draft, by name.

* ``natural``: prompts written by hand in the repository (``dflash_apps/assets/natural-eval-prompts.jsonl``), in many
  styles and lengths; a source no training generator shares, so a τ measured on it cannot reflect the training
  templates. See :func:`dflash_apps.train.natural_prompts.natural_eval_prompts`.
* ``self``: the held-out side of the target's self-generated prompts (:mod:`dflash_apps.train.self_prompts`), read
  from a prompts file made by ``dflash train self-prompts``.
* ``template``: the held-out side of the template generators that trained the shipped draft
  (:func:`dflash_apps.train.prompts.eval_prompts`).
"""
from __future__ import annotations

from dflash_apps.train.natural_prompts import check_prompt_count, natural_eval_prompts

PROMPT_SETS = ("natural", "self", "template")


def eval_prompt_set(name: str, n: int, self_prompts_path: str | None = None) -> list[str]:
    """``n`` evaluation prompts of the set ``name`` (one of :data:`PROMPT_SETS`); the ``self`` set reads the
    prompts file ``self_prompts_path`` (default :func:`dflash_apps.train.self_prompts.default_path`)."""
    if name == "natural":
        return natural_eval_prompts(n)
    if name == "template":
        from dflash_apps.train.prompts import eval_prompts

        return eval_prompts(n)
    if name == "self":
        from dflash_apps.train.self_prompts import default_path, load_self_prompts

        path = self_prompts_path or default_path()
        held_out = load_self_prompts(path, split="eval")
        return held_out[:check_prompt_count(n, len(held_out), f"self ({path})")]
    raise ValueError(f"prompt set must be one of {', '.join(PROMPT_SETS)}, got {name!r}")

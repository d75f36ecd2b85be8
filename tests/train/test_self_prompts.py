"""Self-generated (Magpie) prompts: filters, deduplication, determinism from the seed, resuming, the hash split."""
import json
from types import SimpleNamespace

import pytest
import torch

from dflash_apps.train.natural_prompts import natural_eval_prompts
from dflash_apps.train.prompts import split_of
from dflash_apps.train.self_prompts import (EVAL_FRACTION, FORMAT, SYSTEM_PROMPTS, dedup_key, filter_verdict,
                                       generate_self_prompts, load_self_prompts, user_turn_prefix)

from test_train_blocks import V, tiny_target

STOP = 1


class _AsciiTokenizer:
    """Token id = 2 + ASCII code (printable and newline); 1 = end of turn. A ChatML-like template."""
    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        return "".join(f"[{m['role']}]{m['content']}[end]" for m in messages)

    def __call__(self, text, add_special_tokens):
        return {"input_ids": [2 + (ord(c) % (V - 2)) for c in text]}

    def decode(self, ids, skip_special_tokens):
        return "".join(chr(i - 2) if i >= 2 else " " for i in ids)


class _Scripted(torch.nn.Module):
    """Writes ``text`` then the stop token, whatever it is given (the step count rides in the cache)."""
    def __init__(self, text):
        super().__init__()
        self.script = [2 + ord(c) for c in text] + [STOP]

    def forward(self, input_ids, past_key_values=None, use_cache=True, attention_mask=None, position_ids=None):
        step = past_key_values or 0
        logits = torch.full((input_ids.shape[0], input_ids.shape[1], 2 + 128), -1e4)
        logits[:, -1, self.script[min(step, len(self.script) - 1)]] = 0.0
        return SimpleNamespace(logits=logits, past_key_values=step + 1)


def _records(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize("text, finished, verdict", [
    ("How do I keep basil alive on a windowsill?", True, "kept"),
    ("How do I keep basil alive on a windowsill?", False, "truncated"),
    ("Hi there", True, "too short"),
    ("word " * 400, True, "too long"),
    ("Explain <|im_start|> tokens to me please", True, "template markup"),
    ("Как приготовить борщ дома без мяса?", True, "not English"),
    ("tell me tell me tell me tell me tell me tell me tell me a story", True, "repetition"),
])
def test_filter_verdict(text, finished, verdict):
    assert filter_verdict(text, finished) == verdict


def test_dedup_key_ignores_case_punctuation_and_spacing():
    assert dedup_key("What is  a Black hole?") == dedup_key("what is a black hole")
    assert dedup_key("What is a black hole?") != dedup_key("What is a white dwarf?")


def test_duplicates_and_natural_eval_prompts_are_dropped(tmp_path):
    path = str(tmp_path / "p.jsonl")
    text = "Could you suggest three easy dinners for a busy week?"
    res = generate_self_prompts(_Scripted(text), _AsciiTokenizer(), path, 3, stop_token_ids=[STOP],
                                log=lambda m: None)
    assert [r["verdict"] for r in _records(path)[1:]] == ["kept", "duplicate", "duplicate"]
    assert res["verdicts"] == {"kept": 1, "duplicate": 2} and res["new_samples"] == 3 and res["samples_per_min"] > 0
    assert load_self_prompts(path) == [text]
    natural = natural_eval_prompts(1)[0].replace("\n", " ")
    path2 = str(tmp_path / "n.jsonl")
    generate_self_prompts(_Scripted(natural.upper()), _AsciiTokenizer(), path2, 1, max_new_tokens=400,
                          stop_token_ids=[STOP], log=lambda m: None)
    assert _records(path2)[1]["verdict"] == "duplicate"


def test_samples_follow_the_seed_and_resume_exactly(tmp_path):
    """Three then six samples write the same file as six at once; another seed writes other samples; every
    system prompt is used in turn."""
    model, tok = tiny_target(layers=1), _AsciiTokenizer()
    kw = dict(seed=3, max_new_tokens=12, stop_token_ids=[STOP], log=lambda m: None)
    whole, parts, other = (str(tmp_path / n) for n in ("whole.jsonl", "parts.jsonl", "other.jsonl"))
    generate_self_prompts(model, tok, whole, 6, **kw)
    generate_self_prompts(model, tok, parts, 3, **kw)
    torch.manual_seed(123)  # the global generator plays no part
    res = generate_self_prompts(model, tok, parts, 6, **kw)
    assert res["new_samples"] == 3 and res["samples"] == 6
    assert _records(whole) == _records(parts)
    assert _records(whole)[0] == {"format": FORMAT, "seed": 3, "temperature": 1.0, "top_p": 1.0, "max_new_tokens": 12}
    assert [r["system"] for r in _records(whole)[1:]] == SYSTEM_PROMPTS[:6]
    generate_self_prompts(model, tok, other, 6, **{**kw, "seed": 4})
    assert [r["prompt"] for r in _records(other)[1:]] != [r["prompt"] for r in _records(whole)[1:]]


def test_batched_samples_equal_single_ones_and_resume_exactly(tmp_path):
    """Rows of a left-padded batch (system prompts of different lengths) draw the samples one-at-a-time sampling
    draws; a run of 5 then 7 in batches of 3 (the batch cut at 5 drawn again on resume) writes the file of 7 at
    once, its header naming the batch size."""
    model, tok = tiny_target(layers=1), _AsciiTokenizer()
    kw = dict(seed=5, max_new_tokens=10, stop_token_ids=[STOP], log=lambda m: None)
    single, whole, parts = (str(tmp_path / n) for n in ("single.jsonl", "whole.jsonl", "parts.jsonl"))
    generate_self_prompts(model, tok, single, 7, **kw)
    generate_self_prompts(model, tok, whole, 7, batch_size=3, **kw)
    generate_self_prompts(model, tok, parts, 5, batch_size=3, **kw)
    res = generate_self_prompts(model, tok, parts, 7, batch_size=3, **kw)
    assert res["new_samples"] == 2 and res["samples"] == 7
    assert _records(whole) == _records(parts)
    assert _records(whole)[0]["batch_size"] == 3
    assert len({len(r["system"]) for r in _records(whole)[1:]}) > 1  # the rows were padded
    assert _records(whole)[1:] == _records(single)[1:]
    with pytest.raises(ValueError, match="pass the same settings"):
        generate_self_prompts(model, tok, whole, 8, batch_size=2, **kw)
    with pytest.raises(ValueError, match="batch_size must be"):
        generate_self_prompts(model, tok, str(tmp_path / "x.jsonl"), 2, batch_size=0, **kw)


def test_resume_with_other_settings_is_refused_before_sampling(tmp_path):
    path = str(tmp_path / "p.jsonl")
    model = _Scripted("Please explain how a rainbow forms in the sky.")
    generate_self_prompts(model, _AsciiTokenizer(), path, 1, stop_token_ids=[STOP], log=lambda m: None)
    before = open(path).read()
    with pytest.raises(ValueError, match="pass the same settings to resume"):
        generate_self_prompts(model, _AsciiTokenizer(), path, 2, temperature=0.8, stop_token_ids=[STOP])
    for bad, match in [(dict(count=0), "count must be"), (dict(temperature=0.0), "temperature must be > 0"),
                       (dict(top_p=1.5), "top_p must be"), (dict(max_new_tokens=0), "max_new_tokens must be")]:
        args = {"count": 2, **bad}
        count = args.pop("count")
        with pytest.raises(ValueError, match=match):
            generate_self_prompts(model, _AsciiTokenizer(), path, count, stop_token_ids=[STOP], **args)
    assert open(path).read() == before


def test_hash_split_of_kept_prompts(tmp_path):
    path = tmp_path / "p.jsonl"
    prompts = [f"Question number {i}: what should I cook tonight?" for i in range(200)]
    lines = [{"format": FORMAT, "seed": 0, "temperature": 1.0, "top_p": 1.0, "max_new_tokens": 96}]
    lines += [{"index": i, "system": "s", "prompt": p, "verdict": "kept" if i % 7 else "repetition"}
              for i, p in enumerate(prompts)]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    kept = [p for i, p in enumerate(prompts) if i % 7]
    held_out, train = load_self_prompts(str(path), "eval"), load_self_prompts(str(path), "train")
    assert held_out == [p for p in kept if split_of(p, EVAL_FRACTION) == "eval"]
    assert 0 < len(held_out) < len(kept) // 4 and not set(held_out) & set(train)
    assert sorted(held_out + train) == sorted(kept)
    with pytest.raises(ValueError, match="split must be"):
        load_self_prompts(str(path), "test")
    with pytest.raises(ValueError, match="self-prompts --out"):
        load_self_prompts(str(tmp_path / "missing.jsonl"))
    (tmp_path / "bad.jsonl").write_text('{"index": 0}\n')
    with pytest.raises(ValueError, match="not a self-prompts file"):
        load_self_prompts(str(tmp_path / "bad.jsonl"))


def test_user_turn_prefix_ends_where_the_user_writes():
    prefix = user_turn_prefix(_AsciiTokenizer(), "Be brief.")
    assert prefix == "[system]Be brief.[end][user]"

    class Paraphrasing:
        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            return "conversation"
    with pytest.raises(ValueError, match="chat template does not place the user's message"):
        user_turn_prefix(Paraphrasing(), "Be brief.")

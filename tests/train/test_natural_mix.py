"""The natural training mix: deterministic from its seed, deduplicated, varied in kind, length, system prompt and
turns, its train and eval sides disjoint, and free of every hand-written natural evaluation prompt and near copy."""
import json
import re

import pytest

from dflash_apps.train.natural_mix import (MIX, build_natural_mix, check_prompt, is_conversation, near_eval_copy,
                                           prompt_text, user_text)
from dflash_apps.train.natural_prompts import natural_eval_prompts


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


@pytest.fixture(scope="module")
def mix():
    return build_natural_mix(1500, "train", seed=0)


def test_mix_is_deterministic_deduplicated_and_varied(mix):
    assert len(mix) == 1500
    assert build_natural_mix(400, "train", seed=0) == mix[:400]  # a longer mix extends a shorter one
    assert build_natural_mix(400, "train", seed=1) != mix[:400]
    assert len({" ".join(_words(user_text(p))) for _, p in mix}) == len(mix)
    kinds = {k for k, _ in mix}
    assert kinds == {k for k, _ in MIX}
    for kind, share in MIX:  # each kind near its share
        assert abs(sum(k == kind for k, _ in mix) / len(mix) - share) < 0.06
    convs = [p for _, p in mix if is_conversation(p)]
    systems = {p[0]["content"] for p in convs if p[0]["role"] == "system"}
    assert len(systems) >= 10
    assert sum(sum(m["role"] == "user" for m in p) >= 2 for p in convs) > 150  # multi-turn follow-ups
    assert 0.3 < sum(isinstance(p, str) for _, p in mix) / len(mix) < 0.8  # the template's default system prompt too
    lengths = sorted(len(user_text(p)) for _, p in mix)
    assert lengths[0] < 30 and lengths[len(lengths) // 2] > 60 and lengths[-1] > 600
    for i, (_, p) in enumerate(mix):
        check_prompt(p, f"mix[{i}]")


def test_train_and_eval_sides_are_disjoint(mix):
    held_out = build_natural_mix(64, "eval", seed=0)
    assert len(held_out) == 64
    train_keys = {" ".join(_words(user_text(p))) for _, p in mix}
    assert not train_keys & {" ".join(_words(user_text(p))) for _, p in held_out}


def test_no_natural_eval_prompt_nor_near_copy_in_the_mix(mix):
    """Checked independently of the mix's own filter: no eval prompt's words equal a mix prompt's, none is
    contained in one, and no run of 8 words is shared."""
    evals = [_words(p) for p in natural_eval_prompts()]
    eval_keys = {" ".join(w) for w in evals}
    shingles = {tuple(w[i:i + 8]) for w in evals for i in range(len(w) - 7)}
    for _, p in mix + build_natural_mix(200, "eval", seed=0):
        w = _words(user_text(p))
        key = f" {' '.join(w)} "
        assert not any(f" {k} " in key for k in eval_keys), p
        assert not any(tuple(w[i:i + 8]) in shingles for i in range(len(w) - 7)), p


def test_near_eval_copy_catches_copies_and_passes_other_text():
    for p in natural_eval_prompts()[:20]:
        assert near_eval_copy(p)
        assert near_eval_copy(p.upper().replace(".", " ! "))
        assert near_eval_copy("Hey, quick one. " + p + " Thanks!")
    long = max(natural_eval_prompts(), key=len)
    assert near_eval_copy(" ".join(long.split()[3:14]))  # a run of words of a long eval prompt
    assert not near_eval_copy("Write a limerick about a robot learning to dance.")


def test_self_prompts_join_the_mix_on_their_own_side(tmp_path):
    from dflash_apps.train.self_prompts import FORMAT, load_self_prompts

    path = tmp_path / "self.jsonl"
    recs = [{"index": i, "system": f"system {i % 3}", "prompt": f"Self prompt number {i} about gardening tools?",
             "verdict": "kept" if i % 5 else "truncated"} for i in range(60)]
    recs.append({"index": 60, "system": "s", "prompt": natural_eval_prompts()[0], "verdict": "kept"})
    path.write_text("\n".join(json.dumps(r) for r in [{"format": FORMAT}] + recs) + "\n")
    joined = []
    for split in ("train", "eval"):
        both = build_natural_mix(10, split, 0, str(path))
        got = [p for k, p in both if k == "self"]
        assert both[:len(got)] == [("self", p) for p in got] and len(both) == len(got) + 10  # self first
        want = [p for p in load_self_prompts(str(path), split) if p != natural_eval_prompts()[0]]
        assert [user_text(p) for p in got] == want
        assert all(p[0]["role"] == "system" and p[0]["content"] == f"system {int(re.findall(r'[0-9]+', user_text(p))[0]) % 3}"
                   for p in got)
        joined += got
    assert len(joined) == 48  # every kept prompt but the planted eval prompt, each on one side


@pytest.mark.parametrize("bad", ["", [], [{"role": "user"}], [{"role": "assistant", "content": "hi"}],
                                 [{"role": "user", "content": "a"}, {"role": "system", "content": "b"},
                                  {"role": "user", "content": "c"}], 3])
def test_bad_prompts_are_refused_before_any_work(bad, tmp_path):
    from dflash_apps.train.data import generate_dataset

    with pytest.raises(ValueError, match=r"prompts\[1\]"):
        generate_dataset(str(tmp_path / "out"), ["fine", bad], model=None, tokenizer=None)
    assert not (tmp_path / "out").exists()


def test_prompt_keys_keep_user_texts_and_separate_system_prompts():
    assert prompt_text("Why is the sea salty?") == "Why is the sea salty?"  # the template mix's keys are unchanged
    a = [{"role": "system", "content": "A"}, {"role": "user", "content": "Why is the sea salty?"}]
    b = [{"role": "system", "content": "B"}, {"role": "user", "content": "Why is the sea salty?"}]
    assert prompt_text(a) != prompt_text(b) and json.loads(prompt_text(a)) == a


SELF_PROMPTS_ASSET = "dflash_apps/assets/smollm2-135m-self-prompts.jsonl"
# sha256 of the canonical JSON of the first 1,280 train prompts (shards 0-19 of the shipped natural data, the
# order their responses and features were generated in): read from that data's prompts.json.
FIRST_SHARDS_SHA256 = "8b07a74f0b3a60ef1f71f82ff8d31c501f8fa5f5c0cdad870cc1b2feb0bdbfeb"


def test_first_train_shards_keep_their_prompts_and_the_supply_reaches_20k():
    """The mix of the shipped natural data (seed 0, the shipped self-prompts file) keeps the prompt order of its
    first 20 shards of 64 whatever packages are installed (the seed texts are a snapshot in the repository, not
    this environment's docstrings and package metadata), and supplies at least 20,000 distinct train prompts."""
    import hashlib
    import os

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    mix = [p for _, p in build_natural_mix(20000, "train", 0, os.path.join(root, SELF_PROMPTS_ASSET))]
    assert hashlib.sha256(json.dumps(mix[:1280], sort_keys=True).encode()).hexdigest() == FIRST_SHARDS_SHA256
    assert len({" ".join(_words(user_text(p))) for p in mix}) >= 20000


def test_mix_does_not_read_this_environment(monkeypatch, tmp_path):
    """A package installed (or upgraded) after the data was made leaves the mix alone: no installed file is
    read while the mix is built."""
    from dflash_apps.train import natural_mix

    before = build_natural_mix(300, "train", seed=0)
    meta = tmp_path / "aaa_new_pkg-1.0.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text("Name: aaa\n\n" + "A freshly installed package that describes itself at length "
                                   "in plain words so that it reads as prose to the scanner. " * 3)
    monkeypatch.setattr(natural_mix, "_site_packages", lambda: str(tmp_path))
    natural_mix.seed_texts.cache_clear()
    try:
        assert build_natural_mix(300, "train", seed=0) == before
        assert any(name == "aaa_new_pkg" for name, _ in natural_mix.scan_seed_texts()[0])  # the scanner does see it
    finally:
        natural_mix.seed_texts.cache_clear()


def test_seed_texts_round_trip_and_bad_files(tmp_path):
    from dflash_apps.train.natural_mix import load_seed_texts, save_seed_texts

    texts = ((("mod.f", "Some prose. ünïcode"),), (("mod.g", "def g():\n    return 1"), ("m.h", "def h(): pass")))
    path = str(tmp_path / "seeds.json.xz")
    save_seed_texts(path, texts)
    assert load_seed_texts(path) == texts
    import lzma

    for bad in ({"docs": [["a", "b"]]}, {"docs": [["a"]], "functions": []}, {"docs": [], "functions": [[1, "x"]]}, []):
        with lzma.open(path, "wt") as f:
            json.dump(bad, f)
        with pytest.raises(ValueError, match="not a seed-texts file"):
            load_seed_texts(path)

"""Training data: batched greedy generation with captured features, and shard loading."""
import json
import os
from pathlib import Path

import pytest
import torch

from dflash_apps.train.data import compute_features, generate_batch, load_dataset, load_plain

from test_train_blocks import V, tiny_target


def test_generate_batch_matches_greedy_and_feature_pass(seed):
    """Left-padded ragged batch: each response is the target's own greedy continuation (stopping at the
    first stop token), and the features captured while generating equal a clean forward pass over
    ``prompt + response[:-1]``."""
    target = tiny_target(layers=4)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(4, V, (n,), generator=g).tolist() for n in (5, 1, 9)]
    stop = int(target(torch.tensor([prompts[0]])).logits[0, -1].argmax())  # first response token of prompt 0
    taps = (1, 3)
    recs = generate_batch(target, prompts, max_new_tokens=7, stop_ids=[stop], capture_layers=taps)
    assert len(recs) == len(prompts)
    for p, r in zip(prompts, recs):
        assert r["prompt_len"] == len(p) and r["ids"][: len(p)].tolist() == p
        resp = r["ids"][len(p):].tolist()
        ref = target.generate(torch.tensor([p]), max_new_tokens=7, do_sample=False, eos_token_id=stop,
                              pad_token_id=0)[0, len(p):].tolist()
        assert resp == ref
        assert r["finished"] == (resp[-1] == stop)
        assert r["features"].dtype == torch.bfloat16 and r["features"].shape == (len(r["ids"]) - 1, len(taps) * 64)
        clean = compute_features(target, r["ids"], list(taps))
        err = (r["features"].float() - clean).abs().max() / clean.abs().max()
        assert err < 2 ** -7, err  # bf16 storage (2^-8 relative rounding) plus padding-order noise
    assert recs[0]["ids"][len(prompts[0]):].tolist() == [stop]


def test_generate_batch_known_equals_greedy_with_wrong_known_responses():
    """Known responses that are right, wrong in the middle, too short, empty, or another model's greedy
    output are checked by one teacher-forced pass: every stored response is the target's own greedy
    continuation and its features equal the clean feature pass (rows a wrong response left unfinished
    are completed by plain greedy decoding)."""
    import copy

    from dflash_apps.train.data import generate_batch_known

    # Fixed seeds: the draw must hold each case the test names (a perturbed model whose greedy output differs,
    # responses that stop and that do not), which a random draw need not give (the node seed 1413207546 did not).
    torch.manual_seed(3)
    target = tiny_target(layers=4)
    with torch.no_grad():
        for name, w in target.named_parameters():
            if "norm" not in name:
                w.mul_(5.0)  # sharper logits: varied responses instead of one repeated token
    other = copy.deepcopy(target).to(torch.bfloat16)
    with torch.no_grad():
        for w in other.model.layers[2].parameters():
            w.add_(0.1 * torch.randn_like(w) * w.abs().mean())
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(4, V, (n,), generator=g).tolist() for n in (5, 1, 9, 3, 7)]
    stop = 7

    def greedy(model, p):
        return model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=stop,
                              pad_token_id=0)[0, len(p):].tolist()

    ref = [greedy(target, p) for p in prompts]
    wrong_mid = ref[2][:4] + [(ref[2][4] + 1) % V] + ref[2][5:]
    guessed = greedy(other, prompts[1])
    assert guessed != ref[1] and {r[-1] == stop for r in ref} == {True, False}
    known = [ref[0], guessed, wrong_mid, [], ref[4][:3]]
    taps = (1, 3)
    recs = generate_batch_known(target, prompts, known, 12, [stop], taps)
    for p, r, want in zip(prompts, recs, ref):
        assert r["prompt_len"] == len(p) and r["ids"][: len(p)].tolist() == p
        assert r["ids"][len(p):].tolist() == want
        assert r["finished"] == (want[-1] == stop)
        assert r["features"].dtype == torch.bfloat16 and r["features"].shape == (len(r["ids"]) - 1, len(taps) * 64)
        clean = compute_features(target, r["ids"], list(taps))
        err = (r["features"].float() - clean).abs().max() / clean.abs().max()
        assert err < 2 ** -7, err  # bf16 storage (2^-8 relative rounding) plus padding-order noise


def _random_record(n, taps, hidden, gen, prompt_len=4):
    """A shard record of length ``n`` with random ids and random bf16 features of ``taps``."""
    return {"ids": torch.randint(20, 2000, (n,), generator=gen, dtype=torch.int32), "prompt_len": prompt_len,
            "features": torch.randn(n - 1, len(taps) * hidden, generator=gen).to(torch.bfloat16),
            "layer_ids": list(taps), "finished": True}


def test_load_dataset_selects_taps_and_limits_shards(tmp_path, seed):
    g = torch.Generator().manual_seed(seed)
    shards = [[_random_record(n, [1, 5, 9], 4, g) for n in lens] for lens in ((6, 4), (5,), (7,))]
    for i, s in enumerate(shards):
        torch.save(s, os.path.join(tmp_path, f"shard_{i:05d}.pt"))
    assert len(load_dataset(str(tmp_path))) == 4
    two = load_dataset(str(tmp_path), layer_ids=[9, 1], max_shards=2)
    assert len(two) == 3
    for got, want in zip(two, shards[0] + shards[1]):
        f = want["features"]
        assert got["layer_ids"] == [9, 1]
        assert torch.equal(got["features"], torch.cat([f[:, 8:12], f[:, 0:4]], dim=-1))


class _Payload:
    """Pickles as a call to ``Path(marker).touch()``: loading it with plain pickle creates the marker file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return Path.touch, (Path(self.marker),)


def _crafted(path, marker, wrap=lambda payload: payload):
    """Write a .pt file holding a payload; check that an unsafe load would run it (then remove its marker)."""
    torch.save(wrap(_Payload(marker)), path)
    torch.load(path, weights_only=False)
    assert marker.exists()
    marker.unlink()


def test_crafted_shard_is_refused_without_running_its_payload(tmp_path, seed):
    g = torch.Generator().manual_seed(seed)
    torch.save([_random_record(6, [1, 5], 4, g)], tmp_path / "shard_00000.pt")
    marker = tmp_path / "payload_ran"
    _crafted(tmp_path / "shard_00001.pt", marker, wrap=lambda payload: [_random_record(5, [1, 5], 4, g), payload])
    with pytest.raises(ValueError, match="shard_00001.pt: refused"):
        load_dataset(str(tmp_path))
    assert not marker.exists()
    assert len(load_dataset(str(tmp_path), max_shards=1)) == 1  # the project's own shards still load


def _write_shard(folder, n_seqs, seed, taps=(1, 27), hidden=576):
    g = torch.Generator().manual_seed(seed)
    recs = [_random_record(int(torch.randint(14, 22, (1,), generator=g)), taps, hidden, g) for _ in range(n_seqs)]
    os.makedirs(folder, exist_ok=True)
    torch.save(recs, os.path.join(folder, "shard_00000.pt"))


@pytest.mark.slow
def test_fit_resumed_one_step_at_a_time_equals_uninterrupted(tmp_path):
    """`dflash train fit` stopped after every step (``--max-minutes 0``) and resumed each time ends with
    the same weights, bit for bit, as one uninterrupted run: model, optimizer, RNGs and the epoch's
    remaining visit order are all in the checkpoint. Needs SmolLM2 (its embedding and LM head)."""
    from dflash_apps import smollm2
    from dflash_apps.train.cli import main

    if smollm2.unavailable_reason():
        pytest.skip(smollm2.unavailable_reason())
    data = tmp_path / "data"
    _write_shard(str(data / "train"), 5, seed=1)  # 5 sequences, 2 per step: epochs end mid-batch
    _write_shard(str(data / "eval"), 2, seed=2)
    common = ["fit", "--data", str(data), "--steps", "5", "--batch-seqs", "2", "--anchors", "2",
              "--vocab-subset", "data", "--negatives", "64", "--eval-every", "1000", "--eval-seqs", "2",
              "--log-every", "1000", "--threads", "1"]
    assert main(common + ["--out", str(tmp_path / "whole")]) == 0
    for _ in range(5):
        assert main(common + ["--out", str(tmp_path / "pieces"), "--max-minutes", "0"]) == 0
    whole = load_plain(tmp_path / "whole" / "last.pt")
    pieces = load_plain(tmp_path / "pieces" / "last.pt")
    assert whole["step"] == pieces["step"] == 5
    for name, w in whole["draft"].items():
        assert torch.equal(w, pieces["draft"][name]), name


def test_crafted_checkpoint_is_refused_on_resume_and_export(tmp_path, capsys):
    """`fit` resuming from, and `export` reading, a last.pt with a payload refuse it (exit 2, one line, no
    traceback); the payload never runs. Needs SmolLM2 (fit loads it before resuming)."""
    from dflash_apps import smollm2
    from dflash_apps.train.cli import main

    if smollm2.unavailable_reason():
        pytest.skip(smollm2.unavailable_reason())
    data, out, marker = tmp_path / "data", tmp_path / "run", tmp_path / "payload_ran"
    _write_shard(str(data / "train"), 2, seed=1)
    out.mkdir()
    _crafted(out / "last.pt", marker, wrap=lambda payload: {"step": 1, "draft": payload})
    for argv in (["fit", "--data", str(data), "--steps", "1", "--batch-seqs", "1", "--anchors", "2", "--eval-every",
                  "1000", "--threads", "1", "--out", str(out)],
                 ["export", str(out), str(tmp_path / "exported"), "--use-last"]):
        capsys.readouterr()
        assert main(argv) == 2
        err = capsys.readouterr().err.splitlines()
        assert err[-1].startswith(f"dflash train {argv[0]}: error: {out / 'last.pt'}: refused"), err
        assert not any("Traceback" in line for line in err)
    assert not marker.exists()


def test_fit_refuses_a_bad_device_before_any_work(tmp_path, capsys):
    from dflash_apps.train.cli import main

    assert main(["fit", "--device", "foo", "--out", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err == ("dflash train fit: error: --device 'foo' is not a device: pass cpu, cuda, "
                                       "cuda:N or auto\n")
    assert not (tmp_path / "run").exists()


def test_fit_logs_tree_estimates_and_the_decode_walk(tmp_path, capsys):
    """`fit --eval-tree-budgets 2,5`: every eval also logs the teacher-forced τ estimates of draft trees of those
    budgets and (by default) the decode walk's τ (history and log line); best/ is still chosen by the chain's
    estimate. Bad budgets or walk lengths are refused before any work. Needs SmolLM2."""
    from dflash_apps import smollm2
    from dflash_apps.train.cli import main

    if smollm2.unavailable_reason():
        pytest.skip(smollm2.unavailable_reason())
    data = tmp_path / "data"
    _write_shard(str(data / "train"), 4, seed=1)
    _write_shard(str(data / "eval"), 2, seed=2)
    args = ["fit", "--data", str(data), "--steps", "2", "--batch-seqs", "2", "--anchors", "2", "--vocab-subset",
            "data", "--negatives", "64", "--eval-every", "1", "--eval-seqs", "2", "--eval-tree-budgets", "2,5",
            "--log-every", "1000", "--threads", "1", "--out", str(tmp_path / "run")]
    assert main(args) == 0
    history = [json.loads(line) for line in (tmp_path / "run" / "history.jsonl").read_text().splitlines()]
    evals = [h for h in history if "tau_est" in h]
    assert [h["step"] for h in evals] == [1, 2]
    for h in evals:
        trees = h["tree_tau_est"]
        assert list(trees) == ["2", "5"] and 1.0 <= trees["2"] <= trees["5"] <= 8.0
        assert h["walk_rounds"] >= 2 and 1.0 <= h["walk_tau_est"] <= 8.0
    out = capsys.readouterr().out
    assert "trees of 2" in out and "decode walk" in out
    # `train evaluate` prints the same measures of a draft folder
    assert main(["evaluate", str(tmp_path / "run" / "best"), "--data", str(data / "eval"), "--threads", "1",
                 "--walk-tokens", "8"]) == 0
    ev = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert ev["walk_rounds"] >= 2 and 1.0 <= ev["walk_tau_est"] <= 8.0 and "tau_est" in ev
    assert main(["evaluate", str(tmp_path / "run" / "best"), "--data", str(data / "eval"), "--walk-tokens",
                 "-8"]) == 2
    assert "--walk-tokens must be an integer >= 0" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="tree budgets"):
        main(args[:-2] + ["--eval-tree-budgets", "5,x", "--out", str(tmp_path / "bad")])
    assert main(args[:-2] + ["--eval-walk-tokens", "-1", "--out", str(tmp_path / "bad")]) == 2
    assert "--eval-walk-tokens must be an integer >= 0" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()  # refused before any work


class _CharTokenizer:
    """Just enough of a HF tokenizer for generate_dataset: a chat template and character ids."""
    eos_token_id, unk_token_id = 1, 0

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        return "".join(m["content"] for m in messages) + ">"

    def convert_tokens_to_ids(self, name):
        return 0

    def __call__(self, text, add_special_tokens):
        return {"input_ids": [4 + ord(c) % (V - 4) for c in text]}


def test_generate_dataset_max_shards_then_resume(tmp_path):
    """--max-shards stops after the first shards; a later call writes the rest and leaves those alone."""
    from dflash_apps.train.data import generate_dataset

    target = tiny_target(layers=2)
    prompts = [f"q{i}" for i in range(5)]
    kw = dict(model=target, tokenizer=_CharTokenizer(), max_new_tokens=3, batch_size=2, shard_size=2,
              capture_layers=(1,), log=lambda m: None)
    first = generate_dataset(str(tmp_path), prompts, max_shards=2, **kw)
    assert [os.path.basename(p) for p in first] == ["shard_00000.pt", "shard_00001.pt"]
    assert sorted(f for f in os.listdir(tmp_path) if f.startswith("shard")) == ["shard_00000.pt", "shard_00001.pt"]
    before = os.path.getmtime(first[0])
    every = generate_dataset(str(tmp_path), prompts, **kw)
    assert len(every) == 3 and os.path.getmtime(first[0]) == before
    assert len(load_dataset(str(tmp_path))) == 5


def test_responses_file_round_trip_and_reuse(tmp_path):
    """`generate_dataset(responses_path=...)` records every response in the file; a second run from the
    file (one of its responses deliberately corrupted) checks instead of generating and writes the same
    data, and the corrupted response is corrected in the file."""
    from dflash_apps.train.data import generate_dataset
    from dflash_apps.train.responses import load_responses, prompt_key, save_responses

    target = tiny_target(layers=2)
    with torch.no_grad():
        for name, w in target.named_parameters():
            if "norm" not in name:
                w.mul_(5.0)  # varied responses
    prompts = [f"q{i}?" for i in range(5)]
    path = str(tmp_path / "responses.xz")
    kw = dict(model=target, tokenizer=_CharTokenizer(), max_new_tokens=6, batch_size=2, shard_size=3,
              capture_layers=(1,), responses_path=path, log=lambda m: None)
    generate_dataset(str(tmp_path / "a"), prompts, **kw)
    first = load_dataset(str(tmp_path / "a"))
    stored = load_responses(path)
    assert stored == {prompt_key(p): r["ids"][r["prompt_len"]:].tolist() for p, r in zip(prompts, first)}
    key = prompt_key(prompts[3])
    stored[key] = stored[key][:2] + [(stored[key][2] + 1) % V] + stored[key][3:]
    save_responses(path, stored)
    generate_dataset(str(tmp_path / "b"), prompts, **kw)
    for r, want in zip(load_dataset(str(tmp_path / "b")), first):
        assert torch.equal(r["ids"], want["ids"]) and r["finished"] == want["finished"]
        assert (r["features"].float() - want["features"].float()).abs().max() <= 2 ** -7 * want["features"].float().abs().max()
    assert load_responses(path)[key] == first[3]["ids"][first[3]["prompt_len"]:].tolist()


def _raw_responses(path, head, body=b""):
    import lzma

    with lzma.open(path, "wb", preset=0) as f:
        f.write(json.dumps(head).encode() + b"\n" + body)


def test_responses_file_limits(tmp_path):
    """Responses files past the loading limits, or not in the format, fail with a clear error before their
    contents are read into memory; a file at the record-length limit still loads."""
    import struct

    from dflash_apps.train.responses import FORMAT, MAX_BYTES, MAX_RESPONSE_TOKENS, MAX_RESPONSES, load_responses

    path = str(tmp_path / "r.xz")
    head = {"format": FORMAT, "count": 1, "tokens": MAX_RESPONSE_TOKENS + 1}
    body = b"k" * 8 + struct.pack("<H", MAX_RESPONSE_TOKENS + 1) + b"\x07\x00" * (MAX_RESPONSE_TOKENS + 1)
    _raw_responses(path, head, body)
    with pytest.raises(ValueError, match=f"a response of {MAX_RESPONSE_TOKENS + 1} ids; the limit is"):
        load_responses(path)
    head["tokens"] = MAX_RESPONSE_TOKENS
    _raw_responses(path, head, body[:10].replace(struct.pack("<H", MAX_RESPONSE_TOKENS + 1),
                                                 struct.pack("<H", MAX_RESPONSE_TOKENS)) + body[12:])
    assert load_responses(path) == {b"k" * 8: [7] * MAX_RESPONSE_TOKENS}
    _raw_responses(path, {"format": FORMAT, "count": MAX_RESPONSES + 1, "tokens": 0})
    with pytest.raises(ValueError, match=f"count at most {MAX_RESPONSES}"):
        load_responses(path)
    _raw_responses(path, {"format": FORMAT, "count": 0, "tokens": 0}, bytes(MAX_BYTES))  # a decompression bomb
    with pytest.raises(ValueError, match=f"more than {MAX_BYTES} bytes decompressed"):
        load_responses(path)
    (tmp_path / "plain.xz").write_bytes(b"not lzma")
    with pytest.raises(ValueError, match="not lzma-compressed"):
        load_responses(str(tmp_path / "plain.xz"))


def _sharp_tiny_target(layers):
    """:func:`tiny_target` with sharper logits, so that greedy responses vary instead of repeating one token."""
    target = tiny_target(layers=layers)
    with torch.no_grad():
        for name, w in target.named_parameters():
            if "norm" not in name:
                w.mul_(5.0)
    return target


def test_engine_decoder_route_writes_the_hf_route_data(tmp_path):
    """`generate_dataset(decode=engine_decoder(...))` (this project's runtime decodes, the feature pass checks)
    writes the same responses as the HF route (`decode=None`) on a ragged set of prompts, features equal up to
    bf16 storage, and the decoder's responses were the target's greedy ones (none corrected)."""
    from dflash_apps.train.data import engine_decoder, generate_dataset

    from test_train_blocks import tiny_draft

    target = _sharp_tiny_target(layers=3)
    prompts = [f"q{i}?" + "x" * (i * 3 % 7) for i in range(7)]
    logs = []
    kw = dict(model=target, tokenizer=_CharTokenizer(), max_new_tokens=9, batch_size=3, shard_size=4,
              capture_layers=(1, 2), log=logs.append)
    generate_dataset(str(tmp_path / "hf"), prompts, **kw)
    generate_dataset(str(tmp_path / "engine"), prompts, decode=engine_decoder(target, tiny_draft(target)), **kw)
    hf, eng = load_dataset(str(tmp_path / "hf")), load_dataset(str(tmp_path / "engine"))
    assert len(hf) == len(eng) == len(prompts)
    assert len({tuple(r["ids"][r["prompt_len"]:].tolist()) for r in hf}) > 1  # responses vary
    for a, b in zip(hf, eng):
        assert torch.equal(a["ids"], b["ids"]) and a["finished"] == b["finished"] and a["prompt_len"] == b["prompt_len"]
        assert (a["features"].float() - b["features"].float()).abs().max() <= 2 ** -7 * a["features"].float().abs().max()
    assert logs[-1].endswith("0 decoded responses corrected)"), logs[-1]


def test_engine_route_corrects_a_planted_wrong_response(tmp_path):
    """A decoder whose responses are wrong (one token changed mid-response, one response cut short, one
    replaced by another prompt's) never gets its tokens stored: the feature pass checks every token against
    the target's fp32 greedy choice, so the data equals the HF route's and the log counts the corrections."""
    from dflash_apps.train.data import generate_dataset

    target = _sharp_tiny_target(layers=2)
    prompts = [f"p{i}!" for i in range(5)]
    logs = []
    kw = dict(model=target, tokenizer=_CharTokenizer(), max_new_tokens=8, batch_size=5, shard_size=5,
              capture_layers=(1,), log=logs.append)
    generate_dataset(str(tmp_path / "hf"), prompts, **kw)
    hf = load_dataset(str(tmp_path / "hf"))
    want = [r["ids"][r["prompt_len"]:].tolist() for r in hf]
    assert len(want[1]) >= 3 and len(want[2]) >= 3 and want[3] != want[4]
    wrong = [list(w) for w in want]
    wrong[1][2] = (wrong[1][2] + 1) % V  # one token changed mid-response
    wrong[2] = wrong[2][:2]  # cut short
    wrong[3] = want[4]  # another prompt's response
    planted = {tuple(r["ids"][:r["prompt_len"]].tolist()): w for r, w in zip(hf, wrong)}

    def decode(prompt_ids, max_new_tokens, stop_ids):
        return [planted[tuple(p)] for p in prompt_ids]

    generate_dataset(str(tmp_path / "planted"), prompts, decode=decode, **kw)
    got = load_dataset(str(tmp_path / "planted"))
    assert [r["ids"][r["prompt_len"]:].tolist() for r in got] == want
    for a, b in zip(hf, got):
        assert a["finished"] == b["finished"]
        assert (a["features"].float() - b["features"].float()).abs().max() <= 2 ** -7 * a["features"].float().abs().max()
    assert logs[-1].endswith("3 decoded responses corrected)"), logs[-1]


def test_length_groups_pad_little_and_respect_both_limits(seed):
    """Every row lands in exactly one group; groups follow length order, hold at most max_rows rows and at most
    max_tokens padded positions unless a single row is longer than that."""
    import random

    from dflash_apps.train.data import length_groups

    rng = random.Random(seed)
    lengths = {rng.randrange(1000): rng.randint(1, 500) for _ in range(80)}
    lengths[-1] = 900  # longer than max_tokens: alone
    groups = length_groups(lengths, 7, 800)
    assert sorted(i for g in groups for i in g) == sorted(lengths)
    flat = [lengths[i] for g in groups for i in g]
    assert flat == sorted(flat)
    for g in groups:
        assert len(g) <= 7 and (len(g) == 1 or len(g) * max(lengths[i] for i in g) <= 800)
    assert [-1] in groups and length_groups({}, 3, 10) == []

"""Training data: the target's own greedy responses to an offline prompt set, saved as token ids,
plus the target features (outputs of the tapped decoder layers) of the clean prompt+response.

The features are captured with forward hooks while the target generates (left-padded batches,
greedy, KV cache): each generated token is fed through the target exactly once, so the hooked
layer outputs of the prefill plus every decode step are the features of the clean sequence
``prompt + response[:-1]`` (the last response token is never fed; it is only ever a label).
This saves the separate feature pass; :func:`compute_features` does that pass for data without
stored features (and the tests use it to check both agree).

:func:`generate_batch_known` produces the same records for responses already known (a responses file
kept in the repository, :mod:`dflash_apps.train.responses`, ``dflash train data --responses``): one
teacher-forced pass checks every known token against the greedy choice and yields the features, at a
fraction of the decode cost. The same pass checks responses decoded by this project's own runtime
(:func:`engine_decoder`: autoregressive, ragged batches, several times faster than :func:`generate_batch` on
CPU), which ``dflash train data --decoder engine`` uses for new responses.

On disk (``out_dir``): ``shard_XXXXX.pt`` files, each a list of records
``{"ids": int32 [L], "prompt_len": int, "features": bf16 [L-1, T*H], "layer_ids": [...]}``, plus
``prompts.json``. Generation is resumable: existing shards are skipped.
"""
from __future__ import annotations

import json
import os
import pickle
import time
from typing import Sequence

import torch

DEFAULT_CAPTURE_LAYERS = (1, 8, 15, 22, 27)  # superset of taps stored; training slices what it needs


def _fmt_time(s: float) -> str:
    return f"{int(s // 60)}m{int(s % 60):02d}s"


@torch.inference_mode()
def generate_batch(model, prompt_ids: Sequence[Sequence[int]], max_new_tokens: int, stop_ids: Sequence[int],
                   capture_layers: Sequence[int], pad_id: int = 0):
    """Greedy generation for a left-padded batch; returns records (see module docstring)."""
    b = len(prompt_ids)
    plen = [len(p) for p in prompt_ids]
    P = max(plen)
    device = model.lm_head.weight.device
    ids = torch.full((b, P), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros((b, P), dtype=torch.long, device=device)
    for i, p in enumerate(prompt_ids):
        ids[i, P - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, P - len(p):] = 1
    captured: dict[int, list[torch.Tensor]] = {l: [] for l in capture_layers}
    layers = model.model.layers

    def hook(idx):
        def fn(_m, _a, out):
            captured[idx].append((out[0] if isinstance(out, tuple) else out).to(torch.bfloat16))
        return fn

    handles = [layers[l].register_forward_hook(hook(l)) for l in capture_layers]
    from transformers import DynamicCache

    cache = DynamicCache()
    done = torch.zeros(b, dtype=torch.bool, device=device)
    stop = torch.tensor(list(stop_ids), device=device)
    gen: list[torch.Tensor] = []
    cur_ids, cur_mask = ids, mask
    try:
        for step in range(max_new_tokens):
            pos = (cur_mask.cumsum(-1) - 1).clamp(min=0)
            if step > 0:
                pos = pos[:, -1:]
                inp = gen[-1][:, None]
            else:
                inp = cur_ids
            out = model(input_ids=inp, attention_mask=cur_mask, position_ids=pos, past_key_values=cache,
                        use_cache=True, logits_to_keep=1)
            nxt = out.logits[:, -1].argmax(-1)
            nxt = torch.where(done, torch.full_like(nxt, pad_id), nxt)
            gen.append(nxt)
            done |= torch.isin(nxt, stop)
            if bool(done.all()):
                break
            cur_mask = torch.cat([cur_mask, (~done).long()[:, None] | 1], dim=1)
    finally:
        for h in handles:
            h.remove()
    gen_t = torch.stack(gen, dim=1)  # [b, n_gen]
    feats = torch.cat([torch.cat(captured[l], dim=1) for l in capture_layers], dim=-1)  # [b, P+n_fed, T*H]
    records = []
    for i in range(b):
        row = gen_t[i].tolist()
        n = len(row)
        for j, t in enumerate(row):
            if t in stop_ids:
                n = j + 1
                break
        resp = row[:n]
        full = list(prompt_ids[i]) + resp
        f = feats[i, P - plen[i]: P - plen[i] + len(full) - 1].contiguous().clone()
        records.append({"ids": torch.tensor(full, dtype=torch.int32), "prompt_len": plen[i], "features": f,
                        "layer_ids": list(capture_layers), "finished": bool(resp and resp[-1] in stop_ids)})
    return records


@torch.inference_mode()
def forced_pass(model, seqs: Sequence[Sequence[int]], first: Sequence[int], capture_layers: Sequence[int],
                pad_id: int = 0) -> tuple[list[torch.Tensor], list[list[int]]]:
    """One forward of ``model`` over the right-padded batch ``seqs`` (causal: a row never sees the padding
    after it). Returns per row the features (bf16 [len, T*H], the hooked layer outputs at every position)
    and the greedy next token at each position ``first[i] .. len - 1`` (the LM head runs on those rows only)."""
    b, L = len(seqs), max(len(q) for q in seqs)
    device = model.lm_head.weight.device
    ids = torch.full((b, L), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros((b, L), dtype=torch.long, device=device)
    for i, q in enumerate(seqs):
        ids[i, :len(q)] = torch.tensor(list(q), dtype=torch.long)
        mask[i, :len(q)] = 1
    captured: dict[int, torch.Tensor] = {}
    layers = model.model.layers

    def hook(idx):
        def fn(_m, _a, out):
            captured[idx] = (out[0] if isinstance(out, tuple) else out).to(torch.bfloat16)
        return fn

    handles = [layers[l].register_forward_hook(hook(l)) for l in capture_layers]
    try:
        h = model.model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
    finally:
        for hd in handles:
            hd.remove()
    feats = torch.cat([captured[l] for l in capture_layers], dim=-1)
    out_f, out_g = [], []
    for i, q in enumerate(seqs):
        out_f.append(feats[i, :len(q)].contiguous().clone())
        out_g.append(model.lm_head(h[i, first[i]:len(q)]).argmax(-1).tolist())  # per row: [n, vocab] stays small
    return out_f, out_g


def generate_batch_known(model, prompt_ids: Sequence[Sequence[int]], known: Sequence[Sequence[int]],
                         max_new_tokens: int, stop_ids: Sequence[int], capture_layers: Sequence[int],
                         pad_id: int = 0) -> list[dict]:
    """:func:`generate_batch`'s records (``model``'s greedy responses and features) for prompts whose
    responses are probably ``known`` (e.g. from a responses file): one teacher-forced pass of ``model``
    (:func:`forced_pass`) checks every known token against ``model``'s greedy choice and yields the
    features. A row keeps its known response up to the first disagreement plus ``model``'s own token there
    (or the token after a fully confirmed unfinished response), so every kept token is ``model``'s greedy
    choice; rows left unfinished that way are completed by :func:`generate_batch`."""
    stops = set(stop_ids)
    b = len(prompt_ids)
    cands = [list(k)[:max_new_tokens] for k in known]
    seqs = [list(p) + c for p, c in zip(prompt_ids, cands)]
    f_rows, greedy = forced_pass(model, seqs, [len(p) - 1 for p in prompt_ids], capture_layers, pad_id=pad_id)
    records: list[dict | None] = [None] * b
    todo = []
    resp: list[list[int]] = [[] for _ in range(b)]
    for i, (c, f, want) in enumerate(zip(cands, f_rows, greedy)):
        for j, t in enumerate(want):  # want[j]: model's token at response position j
            resp[i].append(t)
            if t in stops or len(resp[i]) == max_new_tokens or j == len(c) or c[j] != t:
                break
        if resp[i][-1] in stops or len(resp[i]) == max_new_tokens:
            full = list(prompt_ids[i]) + resp[i]
            # features of prompt + response[:-1], all on the checked path (a copy: no rows past it are saved)
            records[i] = {"ids": torch.tensor(full, dtype=torch.int32), "prompt_len": len(prompt_ids[i]),
                          "features": f[:len(full) - 1].clone(), "layer_ids": list(capture_layers),
                          "finished": resp[i][-1] in stops}
        else:
            todo.append(i)
    if todo:  # plain greedy decoding from the checked prefixes (features of the whole sequence)
        budget = max(max_new_tokens - len(resp[i]) for i in todo)
        rest = generate_batch(model, [list(prompt_ids[i]) + resp[i] for i in todo], budget, stop_ids, capture_layers,
                              pad_id=pad_id)
        for i, r in zip(todo, rest):
            keep = min(len(r["ids"]), len(prompt_ids[i]) + max_new_tokens)
            full = r["ids"][:keep]
            records[i] = {"ids": full.clone(), "prompt_len": len(prompt_ids[i]), "features": r["features"][:keep - 1].clone(),
                          "layer_ids": list(capture_layers), "finished": int(full[-1]) in stops}
    return records


def engine_decoder(model, draft, kernel_backend: str = "cpu"):
    """``decode(prompt_ids, max_new_tokens, stop_ids) -> responses``: greedy autoregressive decoding of a ragged
    batch with this project's runtime (:func:`dflash.generate`, backend "fast", ``block_size=1``, so ``draft`` is
    never run: the engine only needs one to build; kernel backend ``kernel_backend``, on CPU "cpu", whose
    bf16-packed weights keep fp32 results for bf16-exact weights such as SmolLM2's). Several times faster than
    :func:`generate_batch` on CPU; its responses are candidates that :func:`generate_batch_known` then checks
    token by token against ``model``'s own greedy choice (kernels that sum in another order may break a near
    tie the other way: such a token is corrected, never trusted) while it captures the features."""
    from dflash import generate

    def decode(prompt_ids: Sequence[Sequence[int]], max_new_tokens: int, stop_ids: Sequence[int]) -> list[list[int]]:
        out = generate(model, draft, [torch.tensor(list(p), dtype=torch.long) for p in prompt_ids], max_new_tokens,
                       stop_token_ids=list(stop_ids), backend="fast", block_size=1, kernel_backend=kernel_backend)
        return [seq[len(p):].tolist() for seq, p in zip(out.sequences, prompt_ids)]

    return decode


@torch.no_grad()
def compute_features(model, ids: torch.Tensor, layer_ids: Sequence[int]) -> torch.Tensor:
    """Features [L-1, T*H] (float32) of one clean sequence ``ids`` [L] with a plain forward pass."""
    from dflash.target import TargetAdapter
    from transformers import DynamicCache

    ad = TargetAdapter(model, layer_ids)
    x = ids[None, :-1].long()
    pos = torch.arange(x.shape[1])[None]
    return ad.forward(x, pos, DynamicCache(), with_features=True, logits_to_keep=1).features[0].float()


CHECK_TOKENS = 4096  # padded positions per checking pass of decoded responses (length_groups)


def length_groups(lengths: dict[int, int], max_rows: int, max_tokens: int) -> list[list[int]]:
    """The keys of ``lengths`` (row -> sequence length) in length order, cut into padded batches of at most
    ``max_rows`` rows and ``max_tokens`` padded positions (rows x the longest; a row longer than that alone), so
    that a batch pads little: a response's length is known only after decoding, and varies far more than the
    prompts' the decoding batches were formed by."""
    groups: list[list[int]] = []
    for i in sorted(lengths, key=lengths.__getitem__):
        if groups and len(groups[-1]) < max_rows and (len(groups[-1]) + 1) * lengths[i] <= max_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def generate_dataset(out_dir: str, prompts: Sequence, *, model, tokenizer, max_new_tokens: int = 192,
                     batch_size: int = 16, shard_size: int = 64, capture_layers=DEFAULT_CAPTURE_LAYERS,
                     max_shards: int | None = None, first_shard: int = 0, responses_path: str | None = None,
                     decode=None, log=print) -> list[str]:
    """Generate (resumably) the dataset for ``prompts`` (user texts or conversations,
    :mod:`dflash_apps.train.natural_mix`) into ``out_dir``; returns the shard paths.
    ``max_shards``: stop after the first that many shards (the rest can be generated by a later call);
    ``first_shard``: start there (shards of the same prompt set; earlier ones can be generated later).

    ``responses_path``: a responses file (:mod:`dflash_apps.train.responses`); its known responses are checked
    (:func:`generate_batch_known`) instead of generated, and every new shard's responses are added to it.
    ``decode``: how new responses are decoded. None: :func:`generate_batch` (HF-style batched decoding, features
    captured in the same pass); else a ``decode(prompt_ids, max_new_tokens, stop_ids) -> responses`` such as
    :func:`engine_decoder`'s, whose responses are then checked like known ones (:func:`generate_batch_known`, in
    batches of like total length: :func:`length_groups`).
    Either way the stored responses are ``model``'s greedy responses and the features ``model``'s."""
    from dflash_apps.smollm2 import stop_token_ids
    from dflash_apps.train.natural_mix import check_prompt, encode_prompt, prompt_text
    from dflash_apps.train.responses import load_responses, prompt_key, save_responses

    for i, p in enumerate(prompts):
        check_prompt(p, f"prompts[{i}]")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "prompts.json"), "w", encoding="utf-8") as f:
        json.dump({"prompts": list(prompts), "max_new_tokens": max_new_tokens,
                   "capture_layers": list(capture_layers)}, f)
    stops = stop_token_ids(tokenizer)
    known = load_responses(responses_path) if responses_path else {}
    paths = []
    t0 = time.perf_counter()
    n_shards = (len(prompts) + shard_size - 1) // shard_size
    tokens_done = tokens_known = responses_corrected = 0
    decode_s = 0.0  # seconds spent decoding new responses (with decode=None: generate_batch, features included)
    for s in range(first_shard, n_shards if max_shards is None else min(n_shards, max_shards)):
        path = os.path.join(out_dir, f"shard_{s:05d}.pt")
        paths.append(path)
        if os.path.exists(path):
            continue
        chunk = prompts[s * shard_size:(s + 1) * shard_size]
        keys = [prompt_key(prompt_text(p)) for p in chunk]
        enc = [encode_prompt(tokenizer, p) for p in chunk]
        recs: list[dict | None] = [None] * len(enc)
        known_rows = [i for i in range(len(enc)) if keys[i] in known]
        new_rows = [i for i in range(len(enc)) if keys[i] not in known]
        # known responses first (one checking pass each), then the rest; each group in length order
        for group in (known_rows, new_rows):
            order = sorted(group, key=lambda i: len(enc[i]))
            batches = [order[k:k + batch_size] for k in range(0, len(order), batch_size)]
            decoded: dict[int, list[int]] = {}
            if group is new_rows and decode is not None:  # decode them all, then check them in batches of like length
                td = time.perf_counter()
                for idx in batches:
                    decoded.update(zip(idx, decode([enc[i] for i in idx], max_new_tokens, stops)))
                decode_s += time.perf_counter() - td
                batches = length_groups({i: len(enc[i]) + len(decoded[i]) for i in order}, batch_size, CHECK_TOKENS)
            for idx in batches:
                prompt_ids = [enc[i] for i in idx]
                if group is known_rows:
                    out = generate_batch_known(model, prompt_ids, [known[keys[i]] for i in idx], max_new_tokens,
                                               stops, capture_layers)
                elif decode is None:
                    td = time.perf_counter()
                    out = generate_batch(model, prompt_ids, max_new_tokens, stops, capture_layers)
                    decode_s += time.perf_counter() - td
                else:
                    out = generate_batch_known(model, prompt_ids, [decoded[i] for i in idx], max_new_tokens, stops,
                                               capture_layers)
                    responses_corrected += sum(r["ids"][r["prompt_len"]:].tolist() != decoded[i]
                                               for i, r in zip(idx, out))
                for i, r in zip(idx, out):
                    recs[i] = r
                    n = len(r["ids"]) - r["prompt_len"]
                    tokens_done += n
                    tokens_known += n if keys[i] in known else 0
        tmp = path + ".tmp"
        torch.save(recs, tmp)
        os.replace(tmp, path)
        if responses_path:
            known.update({k: r["ids"][r["prompt_len"]:].tolist() for k, r in zip(keys, recs)})
            save_responses(responses_path, known)
        el = time.perf_counter() - t0
        tokens_new = tokens_done - tokens_known
        log(f"[data] shard {s + 1}/{n_shards} written ({tokens_done} response tokens this run, {tokens_known} of "
            f"them known from the responses file, {tokens_done / max(el, 1e-9):.0f} tok/s, elapsed {_fmt_time(el)}; "
            f"decoding the {tokens_new} new: {tokens_new / max(decode_s, 1e-9):.0f} tok/s, "
            f"{responses_corrected} decoded responses corrected)")
    return paths


def load_plain(path: str, map_location=None):
    """A ``.pt`` file this package wrote (data shards, training checkpoints): tensors and plain Python values,
    loaded with ``weights_only=True``, so a crafted pickle cannot run code; anything else is refused."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise ValueError(f"{path}: refused, it holds more than tensors and plain values (weights_only load: "
                         f"{str(exc).splitlines()[0]}); only load .pt files written by dflash train") from None


def load_dataset(out_dir: str, layer_ids: Sequence[int] | None = None, max_shards: int | None = None) -> list[dict]:
    """Load all complete shards; ``layer_ids`` selects (in order) which captured taps to keep."""
    import glob

    files = sorted(glob.glob(os.path.join(out_dir, "shard_*.pt")))
    if max_shards is not None:
        files = files[:max_shards]
    out = []
    for path in files:
        for r in load_plain(path):
            if layer_ids is not None and list(layer_ids) != r["layer_ids"]:
                H = r["features"].shape[-1] // len(r["layer_ids"])
                cols = []
                for l in layer_ids:
                    if l not in r["layer_ids"]:
                        raise ValueError(f"{path}: tap {l} was not captured (have {r['layer_ids']})")
                    j = r["layer_ids"].index(l)
                    cols.append(r["features"][:, j * H:(j + 1) * H])
                r["features"] = torch.cat(cols, dim=-1).contiguous()
                r["layer_ids"] = list(layer_ids)
            out.append(r)
    return out

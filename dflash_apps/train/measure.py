"""Measure a SmolLM2 draft end to end with :func:`dflash.generate`: τ (mean acceptance
length), decode tokens/s of DFlash vs autoregressive decoding through the same machinery
(``block_size=1``), and greedy equality, on an evaluation prompt set (``--prompt-set``, hand-written natural
prompts by default; :mod:`dflash_apps.train.eval_sets`). ``--against OTHER_DRAFT``
measures other drafts in the same run, each prompt's runs back to back (draft, others, autoregressive),
so a new and an old draft see the same machine state.

    python -m dflash_apps.train.measure DRAFT_DIR [--against OLD_DIR] [--prompt-set natural|self|template]
        [--num-prompts 8] [--prompt TEXT]
        [--max-new-tokens 128] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import sys

from dflash_apps.train.eval_sets import PROMPT_SETS, eval_prompt_set


def measure(draft_dir: str, prompts, *, max_new_tokens: int = 128, block_size: int | None = None,
            backend: str = "auto", baseline: bool = True, target=None, tokenizer=None, log=None,
            against=()) -> dict:
    """Summary + per-prompt rows for ``draft_dir``; with ``against`` (other draft folders) also
    ``out["against"][folder]``, the same summary for each, measured prompt by prompt in the same loop."""
    import torch

    from dflash import generate
    from dflash.model import DFlashDraftModel
    from dflash_apps import smollm2

    if target is None:
        target, tokenizer = smollm2.load(verbose=False)
    dirs = [draft_dir, *against]
    drafts = [DFlashDraftModel.from_pretrained(d, dtype=torch.float32) for d in dirs]
    stops = smollm2.stop_token_ids(tokenizer)
    rows: list[list[dict]] = [[] for _ in dirs]
    for i, p in enumerate(prompts):
        ids = torch.tensor([tokenizer(smollm2.chat_prompt(tokenizer, p), add_special_tokens=False)["input_ids"]])
        runs = [generate(target, d, ids, max_new_tokens, stop_token_ids=stops, block_size=block_size, backend=backend)
                for d in drafts]
        b = (generate(target, drafts[0], ids, max_new_tokens, stop_token_ids=stops, block_size=1, backend=backend)
             if baseline else None)
        for k, r in enumerate(runs):
            row = {"prompt": p[:80], "tokens": r.num_generated_tokens, "tau": r.tau, "rounds": len(r.acceptance_lengths),
                   "dflash_decode_s": r.decode_time, "dflash_total_s": r.total_time}
            if b is not None:
                row.update({"ar_tokens": b.num_generated_tokens, "ar_decode_s": b.decode_time, "ar_total_s": b.total_time,
                            "identical": bool(torch.equal(r.sequences, b.sequences))})
            rows[k].append(row)
        if log:
            log(f"[measure] {i + 1}/{len(prompts)} "
                + " ".join(f"τ={row[-1]['tau']:.2f}" for row in rows) + f" tokens={rows[0][-1]['tokens']}"
                + (f" identical={all(row[-1]['identical'] for row in rows)}" if baseline else ""))
    out = _summary(draft_dir, rows[0], max_new_tokens, baseline)
    if against:
        out["against"] = {d: _summary(d, r, max_new_tokens, baseline) for d, r in zip(dirs[1:], rows[1:])}
    return out


def _summary(draft_dir: str, rows: list[dict], max_new_tokens: int, baseline: bool) -> dict:
    tok = sum(r["tokens"] for r in rows)
    rounds = sum(r["rounds"] for r in rows)
    out = {"draft": draft_dir, "max_new_tokens": max_new_tokens, "num_prompts": len(rows),
           "tau_mean_over_prompts": sum(r["tau"] for r in rows) / max(1, len(rows)),
           "tau_pooled": tok / max(1, rounds), "rows": rows}
    if baseline:
        d = sum(r["dflash_decode_s"] for r in rows)
        a = sum(r["ar_decode_s"] for r in rows)
        out.update({"dflash_decode_tok_s": tok / max(d, 1e-9),
                    "ar_decode_tok_s": sum(r["ar_tokens"] for r in rows) / max(a, 1e-9),
                    "all_identical": all(r["identical"] for r in rows)})
        out["decode_speedup"] = out["dflash_decode_tok_s"] / max(out["ar_decode_tok_s"], 1e-9)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dflash_apps.train.measure")
    ap.add_argument("draft")
    ap.add_argument("--against", action="append", default=[], help="another draft folder to measure in the same run")
    ap.add_argument("--prompt-set", default="natural", choices=PROMPT_SETS,
                    help="evaluation prompts (dflash_apps.train.eval_sets): hand-written (natural, default), held-out "
                         "self-generated (self) or held-out template prompts (template)")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--prompt", action="append", default=[], help="an extra user prompt (after the set's)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import torch

    prompts = eval_prompt_set(args.prompt_set, args.num_prompts) + args.prompt
    if args.threads:
        torch.set_num_threads(args.threads)
    res = measure(args.draft, prompts, max_new_tokens=args.max_new_tokens,
                  block_size=args.block_size, backend=args.backend, baseline=not args.no_baseline,
                  log=lambda m: print(m, file=sys.stderr, flush=True), against=args.against)
    res["prompt_set"] = args.prompt_set
    summary = {k: v for k, v in res.items() if k not in ("rows", "against")}
    if args.against:
        summary["against"] = {d: {k: v for k, v in r.items() if k != "rows"} for d, r in res["against"].items()}
    print(json.dumps(summary, indent=2))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

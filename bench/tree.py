"""HF ``generate`` vs chain vs tree DFlash on the SmolLM2 demo pair: τ and tokens/s, one run.

Target SmolLM2-135M-Instruct and the shipped draft (dflash_apps/assets/smollm2-135m-dflash, B = 8; ``--draft``
another folder, or several: each runs the chain and every budget in the same rotation, to choose a draft by
end-to-end speed), fp32, greedy (or sampled: ``--temperature``, ``--top-p``), ``dflash.generate`` with the default backend (the
engine); the baseline is the target's own ``generate`` (what a user runs without speculation). Prompts
(``--prompt-set``, :func:`dflash_apps.train.eval_sets.eval_prompt_set`): ``natural`` (default) the hand-written evaluation
prompts no training generator shares, ``self`` the held-out slice of the target's self-generated prompts, ``template``
the held-out prompts of the template generators that trained the shipped draft (the eval side of their hash split);
chat template applied, the demo's stop tokens.

A DFlash2 draft (``--draft`` a DFlash2 folder) runs the chain only: it proposes one path, its candidate selector's walk,
and the runtimes build no trees from it.

Every configuration (HF ``generate``, then per draft the chain and ``tree_budget`` = each budget) decodes
every prompt once per rep; per prompt the configurations run back to back in an order rotated by prompt and rep, so a slow spell
of a shared machine hits all of them alike. Reported per configuration: τ pooled over the prompts
and reps (generated tokens / rounds; greedy, so the same in every rep), tokens/s end to end (prefill included)
over all prompts, median and range over reps, its ratios to HF ``generate``'s and the chain's, the per-round
draft and verify milliseconds (medians over reps), and whether every output equals HF ``generate``'s (greedy: it
must, DFlash is lossless; sampled outputs differ by draw, their losslessness is the sampling tests' to show: "n/a").
Sampled runs seed every call by its prompt and rep, so each configuration draws afresh. One warm-up call per
configuration first.

Usage: python bench/tree.py [--prompt-set natural|self|template] [--self-prompts FILE] [--budgets 4,8,16,32,64]
       [--prompts 6] [--prompt TEXT] [--max-new-tokens 96] [--temperature 0.7 --top-p 0.9]
       [--reps 2] [--threads 2] [--draft DIR [--draft DIR2 ...]] [--without-native] [--without-amx] [--op-path]
       [--full-head] [--lookup-depth K] [--out FILE.md]
(``dflash bench tree`` runs this file)
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

import torch  # noqa: E402

from dflash_apps.train.eval_sets import PROMPT_SETS, eval_prompt_set  # noqa: E402

DRAFT = Path(__file__).resolve().parents[1] / "dflash_apps" / "assets" / "smollm2-135m-dflash"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budgets", default="4,8,16,32,64", help="tree budgets, comma-separated")
    ap.add_argument("--prompt-set", default="natural", choices=PROMPT_SETS,
                    help="evaluation prompts: hand-written (natural), the held-out self-generated ones (self), or "
                         "the held-out template prompts the shipped draft was trained beside (template)")
    ap.add_argument("--self-prompts", default=None, help="prompts file of the self set (default: dflash train "
                                                         "self-prompts' --out default)")
    ap.add_argument("--prompts", type=int, default=6, help="the first N prompts of the set")
    ap.add_argument("--prompt", action="append", default=[], help="an extra user prompt (after the set's)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); > 0: sample")
    ap.add_argument("--top-p", type=float, default=1.0, help="nucleus of sampled runs")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=None, help="B (default: the draft's)")
    ap.add_argument("--draft", action="append", default=[],
                    help="draft folder (default: the shipped draft); repeat to compare drafts in one run")
    ap.add_argument("--lookup-depth", type=int, default=0,
                    help="also run every tree budget with a prompt-lookup path of up to K tokens grafted in "
                         "(generate's lookup_depth), in the same rotation")
    ap.add_argument("--out", default=None, help="also write the markdown table to this file")
    ap.add_argument("--without-native", action="store_true",
                    help="also run every DFlash configuration with the native CPU kernels off (DFLASH_CPU_NATIVE=0: "
                         "the \"cpu\" backend's torch formulas), in the same rotation")
    ap.add_argument("--op-path", action="store_true",
                    help="also run every DFlash configuration with the lean target's native forward off (its forward "
                         "through the ops), in the same rotation")
    ap.add_argument("--without-amx", action="store_true",
                    help="also run every DFlash configuration with cpu_linear's AMX path off (its fp32 kernel), in "
                         "the same rotation")
    ap.add_argument("--full-head", action="store_true",
                    help="also run every DFlash configuration with the greedy verify's whole LM head (cpu_linear's "
                         "argmax screen off), in the same rotation")
    ap.add_argument("--without-int8-screen", action="store_true",
                    help="also run every DFlash configuration with cpu_linear's int8 argmax screens off (the AMX "
                         "route's hi-part screen, the bf16-packed route's whole head), in the same rotation")
    args = ap.parse_args(argv)

    from dflash import generate
    from dflash.model import DFlashDraftModel
    from dflash.sampling import SamplingParams
    from dflash_apps import smollm2

    sampling = SamplingParams(args.temperature, args.top_p)
    prompts = eval_prompt_set(args.prompt_set, args.prompts, args.self_prompts) + args.prompt
    if common.smollm2_unavailable("tree.py"):
        return 1
    torch.set_num_threads(args.threads)
    target, tok = smollm2.load(verbose=False)
    paths = [Path(d) for d in args.draft] or [DRAFT]
    labels = [_label(d) for d in paths]
    if len(set(labels)) != len(labels):
        raise SystemExit(f"bench/tree.py: --draft folders must have different names, got {labels}")
    drafts = {lab: DFlashDraftModel.from_pretrained(str(d), dtype=torch.float32) for lab, d in zip(labels, paths)}
    stops = smollm2.stop_token_ids(tok)
    inputs = [torch.tensor([tok(smollm2.chat_prompt(tok, p), add_special_tokens=False)["input_ids"]]) for p in prompts]
    HF = "hf"
    # a configuration: HF, or (draft label, tree budget or None for the chain, what is turned off: "" nothing,
    # "torch formulas" the native CPU kernels, "fp32 GEMM" cpu_linear's AMX path, "op path" the native forward,
    # "full LM head" the argmax screen, "no int8 screen" the argmax's int8 screens)
    variants = ([""] + ["torch formulas"] * args.without_native + ["fp32 GEMM"] * args.without_amx
                + ["op path"] * args.op_path + ["full LM head"] * args.full_head
                + ["no int8 screen"] * args.without_int8_screen)
    budgets = common.parse_ints(args.budgets)
    lookups = [None] + ([args.lookup_depth] if args.lookup_depth else [])
    configs: list = [HF] + [(lab, b, var, k) for var in variants for lab in labels
                            for b in [None] + (budgets if drafts[lab].config.dflash2 is None else [])
                            for k in (lookups if b is not None else [None])]

    def name(c) -> str:
        if c == HF:
            return "HF generate"
        mode = "chain" if c[1] is None else f"tree {c[1]}" + (f" + lookup {c[3]}" if c[3] else "")
        mode = mode if len(labels) == 1 else f"{c[0]}: {mode}"
        return f"{mode} ({c[2]})" if c[2] else mode

    def run(ids, config, max_new, seed=0):
        if config == HF:
            torch.manual_seed(seed)
            seqs, secs = common.hf_greedy(target, ids, max_new, stops, sampling.temperature, sampling.top_p)
            return SimpleNamespace(sequences=seqs, num_generated_tokens=seqs.shape[1] - ids.shape[1],
                                   acceptance_lengths=(), total_time=secs, draft_time=0.0, verify_time=0.0)
        lab, budget, off, lookup = config
        with common.cpu_kernels(native=off != "torch formulas", amx=off != "fp32 GEMM",
                                native_forward=off != "op path", argmax_screen=off != "full LM head",
                                int8_screen=off != "no int8 screen"):
            return generate(target, drafts[lab], ids, max_new, stop_token_ids=stops, block_size=args.block_size,
                            tree_budget=budget, lookup_depth=lookup, temperature=sampling.temperature,
                            top_p=sampling.top_p, seed=seed)

    for c in configs:  # warm-up: engine buffers, first-call costs
        run(inputs[0], c, 8)
    # stats[config][rep] = [tokens, rounds, total s, draft s, verify s]
    stats = {c: [[0, 0, 0.0, 0.0, 0.0] for _ in range(args.reps)] for c in configs}
    outputs: dict = {}
    t_start = time.perf_counter()
    for rep in range(args.reps):
        for i, ids in enumerate(inputs):
            shift = (rep + i) % len(configs)
            for c in configs[shift:] + configs[:shift]:
                res = run(ids, c, args.max_new_tokens, seed=1000 * rep + i)
                s = stats[c][rep]
                s[0] += res.num_generated_tokens
                s[1] += len(res.acceptance_lengths)
                s[2] += res.total_time
                s[3] += res.draft_time
                s[4] += res.verify_time
                outputs.setdefault((c, i), res.sequences)
                if sampling.greedy and not torch.equal(outputs[(c, i)], res.sequences):
                    raise AssertionError(f"{name(c)}: prompt {i} decoded differently in rep {rep}")
            print(f"[tree bench] rep {rep + 1}/{args.reps} prompt {i + 1}/{len(inputs)} "
                  f"({time.perf_counter() - t_start:.0f} s)", file=sys.stderr, flush=True)

    rows = []
    med_tps = {c: statistics.median(r[0] / r[2] for r in stats[c]) for c in configs}
    for c in configs:
        reps = stats[c]
        tokens, rounds = reps[0][0], reps[0][1]
        all_tokens, all_rounds = sum(r[0] for r in reps), sum(r[1] for r in reps)
        tps = [r[0] / r[2] for r in reps]
        identical = all(torch.equal(outputs[(c, i)], outputs[(HF, i)]) for i in range(len(inputs)))
        rows.append({
            "decoding": name(c), "tokens": tokens, "rounds": rounds if c != HF else "",
            "tau": round(all_tokens / all_rounds, 3) if c != HF else "",
            "tok_s": f"{med_tps[c]:.2f} ({min(tps):.2f}-{max(tps):.2f})", "vs_hf": f"{med_tps[c] / med_tps[HF]:.2f}x",
            "vs_chain": f"{med_tps[c] / med_tps[(c[0], None, c[2], None)]:.2f}x" if c != HF else "",
            "draft_ms_round": round(statistics.median(1e3 * r[3] / r[1] for r in reps), 1) if c != HF else "",
            "verify_ms_round": round(statistics.median(1e3 * r[4] / r[1] for r in reps), 1) if c != HF else "",
            "identical_to_hf": "n/a" if not sampling.greedy else "yes" if identical else "NO",
        })
    columns = ["decoding", "tokens", "rounds", "tau", "tok_s", "vs_hf", "vs_chain", "draft_ms_round",
               "verify_ms_round", "identical_to_hf"]
    env = common.environment(torch.device("cpu"))
    which = ", ".join(f"{lab} ({'DFlash2, ' if drafts[lab].config.dflash2 is not None else ''}"
                      f"{drafts[lab].config.num_hidden_layers} layers, B = "
                      f"{args.block_size or drafts[lab].config.block_size})" for lab in labels)
    decoding = "greedy" if sampling.greedy else f"temperature {sampling.temperature}, top-p {sampling.top_p}"
    head = (f"SmolLM2-135M + {which}, {decoding}, "
            f"{args.prompts} {args.prompt_set}-set prompts" + (f" + {len(args.prompt)} given" if args.prompt else "")
            + f", max {args.max_new_tokens} new tokens, {args.reps} reps, "
            f"{args.threads} threads; {env['hardware']}, torch {env['torch']}, commit {env['commit']}, {env['date']}")
    common.report(head, rows, columns, args.out)
    return 0 if all(r["identical_to_hf"] != "NO" for r in rows) else 3


def _label(path: Path) -> str:
    return "shipped draft" if path.resolve() == DRAFT else path.name


if __name__ == "__main__":
    sys.exit(main())

"""Argument parsing for ``dflash train`` (see :mod:`dflash_apps.train`)."""
from __future__ import annotations

import argparse
import os
import sys

from dflash_apps.smollm2 import cache_path


def _cmd_data(args) -> int:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from dflash_apps import smollm2
    from dflash_apps.train.data import generate_dataset
    from dflash_apps.train.prompts import build_prompts

    if args.mix == "natural":
        from dflash_apps.train.natural_mix import build_natural_mix

        def prompt_set(n, split):
            return [p for _kind, p in build_natural_mix(n, split, args.seed, args.self_prompts)]
    else:
        if args.self_prompts:
            raise ValueError("--self-prompts goes with --mix natural")

        def prompt_set(n, split):
            return build_prompts(n, split, seed=args.seed + (1000 if split == "eval" else 0))
    model, tok = smollm2.load()
    decode = None
    if args.decoder == "engine":
        from dflash import DFlashDraftModel
        from dflash_apps.demo import DEFAULT_DRAFT
        from dflash_apps.train.data import engine_decoder

        decode = engine_decoder(model, DFlashDraftModel.from_pretrained(DEFAULT_DRAFT, dtype=torch.float32))
    log = lambda m: print(m, flush=True)  # noqa: E731
    common = dict(model=model, tokenizer=tok, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                  shard_size=args.shard_size, responses_path=args.responses, decode=decode,
                  log=log)
    if args.num_eval:
        generate_dataset(os.path.join(args.out, "eval"), prompt_set(args.num_eval, "eval"), **common)
    tr = prompt_set(args.num_prompts, "train")
    generate_dataset(os.path.join(args.out, "train"), tr, max_shards=args.max_shards, first_shard=args.first_shard,
                     **common)
    return 0


def _cmd_self_prompts(args) -> int:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from dflash_apps import smollm2
    from dflash_apps.train.self_prompts import generate_self_prompts

    model, tok = smollm2.load()
    res = generate_self_prompts(model, tok, args.out, args.count, seed=args.seed, temperature=args.temperature,
                                top_p=args.top_p, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size)
    print(f"[self-prompts] {args.out}: {res['samples']} samples {res['verdicts']}; this run {res['new_samples']} "
          f"samples at {res['samples_per_min']:.1f}/min ({res['kept_per_min']:.1f} kept/min)", flush=True)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dflash train", description="Train a DFlash draft (paper recipe) on CPU or GPU.")
    sub = p.add_subparsers(dest="cmd", required=True)

    d = sub.add_parser("data", help="generate target responses + features for the offline prompt set")
    d.add_argument("--out", default=cache_path("data", "smollm2"), help="data folder (default: %(default)s)")
    d.add_argument("--mix", choices=["template", "natural"], default="template",
                   help="prompt source: the template generators (dflash_apps.train.prompts) or the natural mix "
                        "(dflash_apps.train.natural_mix: seeded tasks in many styles, plus --self-prompts)")
    d.add_argument("--self-prompts", default=None,
                   help="with --mix natural: also the kept prompts of this self-prompts file (its split's side), "
                        "before the --num-prompts / --num-eval seeded ones")
    d.add_argument("--num-prompts", type=int, default=2048)
    d.add_argument("--num-eval", type=int, default=32)
    d.add_argument("--max-new-tokens", type=int, default=128)
    d.add_argument("--batch-size", type=int, default=32)
    d.add_argument("--shard-size", type=int, default=64)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--max-shards", type=int, default=None,
                   help="generate only the first N train shards of the prompt set (rerun with more to continue)")
    d.add_argument("--first-shard", type=int, default=0,
                   help="start at this train shard (e.g. new prompts first; earlier shards can be generated later)")
    d.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's, i.e. all cores)")
    d.add_argument("--responses", default=None,
                   help="responses file (e.g. dflash_apps/assets/smollm2-135m-responses.xz): its responses are checked "
                        "instead of generated, and new shards' responses are added to it")
    d.add_argument("--decoder", choices=["engine", "hf"], default="engine",
                   help="how new responses are decoded: engine = this project's runtime, autoregressive, kernel "
                        "backend cpu, every token then checked against the fp32 greedy choice by the feature pass "
                        "(1.3-1.5x hf end to end on 2 cores: bench/results/2026-12-05-cpu-smollm2-data-engine.md); "
                        "hf = HF-style batched fp32 decoding that captures the features in the same pass")
    d.set_defaults(func=_cmd_data)

    from dflash_apps.train.self_prompts import default_path

    s = sub.add_parser("self-prompts", help="the target writes user prompts itself (Magpie); resumable")
    s.add_argument("--out", default=default_path(), help="prompts file, JSON lines (default: %(default)s)")
    s.add_argument("--count", type=int, required=True, help="samples the file should hold (kept or dropped)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--temperature", type=float, default=1.0)
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--max-new-tokens", type=int, default=96, help="longest user turn; longer samples are dropped")
    s.add_argument("--batch-size", type=int, default=1,
                   help="samples drawn together in one padded batch (a setting of the file: resume with the same)")
    s.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's, i.e. all cores)")
    s.set_defaults(func=_cmd_self_prompts)

    try:
        from dflash_apps.train.trainer import add_fit_args, add_export_args, add_evaluate_args
        from dflash_apps.train.vocab import add_vocab_args
    except ImportError:  # pragma: no cover - during bootstrap
        pass
    else:
        add_fit_args(sub)
        add_export_args(sub)
        add_evaluate_args(sub)
        add_vocab_args(sub)
    return p


def main(argv=None) -> int:
    """Run a subcommand; its ValueErrors (bad arguments, refused files) exit 2 with one line, no traceback."""
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return int(args.func(args) or 0)
    except ValueError as exc:
        print(f"dflash train {args.cmd}: error: {exc}", file=sys.stderr)
        return 2

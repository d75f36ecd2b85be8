"""z-lab's ``dflash generate`` and ``dflash benchmark`` commands, on this project's runtime.

``dflash generate transformers --model M --draft D [options] PROMPT`` and ``dflash benchmark
transformers --model M --draft D --dataset NAME [options]`` take z-lab's arguments; ``M``/``D`` are
local folders, or ``smollm2`` for the embedded SmolLM2-135M pair (offline). z-lab's other backends
(``mlx``, ``openai``) and the serving engines (``sglang``, ``vllm``) are not part of this project: they
are refused with what to use instead, before anything is loaded or printed.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

EMBEDDED = "smollm2"
ASSETS = Path(__file__).resolve().parent / "assets"
EMBEDDED_DRAFT = ASSETS / "smollm2-135m-dflash"
PROMPT_SETS = ASSETS / "prompts"
DATASETS = ("gsm8k", "math500", "humaneval", "mbpp", "mt-bench")
RUNTIMES = ("auto", "fast", "reference")
OTHER_BACKENDS = {
    "mlx": "z-lab's MLX backend (Apple Silicon) is not part of dflash-kernels; on Apple hardware use z-lab's "
           "dflash package (pip install dflash)",
    "openai": "dflash-kernels does not talk to servers; to use an OpenAI-compatible DFlash server, use z-lab's "
              "dflash package (dflash generate openai --base-url ...)",
    "sglang": "SGLang serves DFlash itself: python -m sglang.launch_server --speculative-algorithm DFLASH ...",
    "vllm": "vLLM serves DFlash itself: vllm serve M --speculative-config "
            "'{\"method\": \"dflash\", \"model\": D, ...}'",
}


class UsageError(Exception):
    """A bad argument, reported before any work with exit status 2."""


def _backend_or_error(prog: str, argv: list[str]) -> None:
    """z-lab's first positional is the backend: only ``transformers`` runs here."""
    first = next((a for a in argv if not a.startswith("-")), None)
    if first in OTHER_BACKENDS:
        raise UsageError(f"backend {first!r} is not supported by dflash-kernels: {OTHER_BACKENDS[first]}; "
                         f"here use: {prog} transformers --model M --draft D ...")


def _common_parser(prog: str, description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("backend", choices=["transformers"],
                   help="z-lab backend name; only 'transformers' runs here (mlx, openai, sglang, vllm are refused "
                        "with what to use instead)")
    p.add_argument("--model", required=True, help=f"target model: a local Hugging Face folder, or '{EMBEDDED}'")
    p.add_argument("--draft", help=f"DFlash draft folder (z-lab or speculators format), or '{EMBEDDED}' "
                                   f"(default with --model {EMBEDDED})")
    p.add_argument("--block-size", type=int, default=None, help="draft block size B (default: the draft's)")
    p.add_argument("--max-new-tokens", type=int, default=2048)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--system", default=None, help="system message (needs a tokenizer with a chat template)")
    p.add_argument("--backend", dest="runtime", choices=RUNTIMES, default="auto",
                   help="this project's decode loop (see dflash.generate): auto, fast or reference")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (temperature > 0)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N (default: cuda when available)")
    return p


def _check_numbers(args) -> None:
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.block_size is not None and args.block_size < 1:
        raise UsageError(f"--block-size must be >= 1, got {args.block_size}")
    if args.temperature < 0:
        raise UsageError(f"--temperature must be >= 0, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise UsageError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.top_k < 0:
        raise UsageError(f"--top-k must be >= 0 (0 = off), got {args.top_k}")


def _device(name: str):
    """``--device`` (:func:`dflash_apps.cli.device_arg`); a bad value is a usage error."""
    from dflash_apps.cli import device_arg

    try:
        return device_arg(name)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _resolve_paths(args) -> tuple[str, str]:
    """(model, draft) as EMBEDDED or existing folders; checked before anything is loaded."""
    model = args.model
    draft = args.draft or (EMBEDDED if model == EMBEDDED else None)
    if draft is None:
        raise UsageError("--draft is required: the folder of the DFlash draft trained for --model")
    if model != EMBEDDED and not os.path.isfile(os.path.join(model, "config.json")):
        raise UsageError(f"--model {model!r}: no config.json there; pass a local model folder (dflash-kernels does "
                         f"not download) or '{EMBEDDED}' for the embedded SmolLM2-135M target")
    if draft == EMBEDDED:
        draft = str(EMBEDDED_DRAFT)
    elif not os.path.isfile(os.path.join(draft, "config.json")):
        raise UsageError(f"--draft {draft!r}: no config.json there; pass a local draft folder or '{EMBEDDED}'")
    return model, draft


def _load(model: str, draft_path: str, device, *, system: str | None):
    """(target, tokenizer, draft, device), the draft in the target's dtype; ``device`` from :func:`_device`.
    The draft loads first (it is the smaller), so a weights file that cannot be read (corrupt safetensors) is
    reported, as a usage error naming --draft or --model, before the target's loading starts."""
    import torch
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash.draft import UnreadableWeightsError
    from dflash.model import DFlashDraftModel
    from dflash_apps import smollm2

    device = torch.device(device)
    dtype = torch.bfloat16 if device.type == "cuda" and model != EMBEDDED else torch.float32  # the target's
    try:
        draft = DFlashDraftModel.from_pretrained(draft_path, dtype=dtype, device=device)
    except UnreadableWeightsError as exc:
        raise UsageError(f"--draft {draft_path!r}: {exc}") from None
    try:
        if model == EMBEDDED:
            target, tok = smollm2.load(dtype=dtype, verbose=False)
        else:
            target = AutoModelForCausalLM.from_pretrained(model, dtype=dtype).eval()
            tok = AutoTokenizer.from_pretrained(model)
    except SafetensorError as exc:
        raise UsageError(f"--model {model!r}: cannot read its weights ({exc})") from None
    if system is not None and not getattr(tok, "chat_template", None):
        raise UsageError("--system needs a tokenizer with a chat template; this model's tokenizer has none")
    return target.to(device), tok, draft, device


def _encode(tok, turns: list[dict], device):
    """Token ids [1, P] of a conversation; the chat template when the tokenizer has one, else plain text."""
    import torch

    if getattr(tok, "chat_template", None):
        text = tok.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False)["input_ids"]
    else:
        ids = tok("\n".join(t["content"] for t in turns))["input_ids"]
    if not ids:
        raise UsageError("the prompt is empty")
    return torch.tensor([ids], device=device)


def _stop_ids(target, tok) -> list[int]:
    ids = {tok.eos_token_id}
    eos = getattr(target.generation_config, "eos_token_id", None)
    ids.update(eos if isinstance(eos, (list, tuple)) else [eos])
    return sorted(i for i in ids if i is not None)


def _messages(system: str | None, user: str) -> list[dict]:
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]


def _summary(n: int, rounds: list[int], decode_s: float, total_s: float, runtime: str, block: int) -> str:
    tau = sum(rounds) / max(1, len(rounds))
    return (f"[dflash] {n} tokens, tau {tau:.2f} over {len(rounds)} rounds, {n / max(decode_s, 1e-9):.1f} tokens/s "
            f"decode, {n / max(total_s, 1e-9):.1f} tokens/s end to end (backend {runtime}, B={block})")


def _run(prog: str, command, argv: list[str]) -> int:
    """Usage errors exit 2, errors of the models or checkpoints exit 1: one line on stderr, no traceback."""
    from dflash_apps.smollm2 import SmolLM2NotInstalled

    try:
        return command(argv)
    except UsageError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except (ValueError, OSError, SmolLM2NotInstalled) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 1


# ---------------------------------------------------------------------------------------------- generate
class TextStreamer:
    """``generate``'s ``on_tokens`` callback for one request: prints the text of the tokens committed so far
    as it grows (decoding the whole completion each time, so multi-token characters and merged spaces
    come out as the final decode has them; text that ends in an incomplete character waits)."""

    def __init__(self, tokenizer, out=None):
        self.tokenizer, self.out = tokenizer, out or sys.stdout
        self.ids: list[int] = []
        self.printed = 0

    def __call__(self, request: int, ids: list[int]) -> None:
        self.ids += ids
        text = self._text()
        if not text.endswith("\ufffd"):
            self._emit(text)

    def _text(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def _emit(self, text: str) -> None:
        self.out.write(text[self.printed:])
        self.out.flush()
        self.printed = len(text)

    def finish(self) -> None:
        self._emit(self._text())
        self.out.write("\n")
        self.out.flush()


def generate_main(argv: list[str]) -> int:
    """``dflash generate``."""
    return _run("dflash generate", _generate, argv)


def _generate(argv: list[str]) -> int:
    _backend_or_error("dflash generate", argv)
    p = _common_parser("dflash generate", "Generate with a target model and its DFlash draft. The output is "
                       "streamed to stdout as each round commits tokens (with --batch-file: one JSON line per "
                       "prompt when it ends); a one-line summary (tau, tokens/s) goes to stderr.")
    p.add_argument("prompt", nargs="?", default=None,
                   help="user message; '-' or omitted: read it from stdin")
    p.add_argument("--batch-file", help="a text file with one prompt per line; prints one JSON object per prompt "
                                        "({prompt, completion, tokens, tau})")
    args = p.parse_intermixed_args(argv)
    _check_numbers(args)
    model, draft_path = _resolve_paths(args)
    device = _device(args.device)
    if args.batch_file and args.prompt not in (None, "-"):
        raise UsageError("give either a PROMPT or --batch-file, not both")
    if args.batch_file:
        try:
            prompts = [line for line in Path(args.batch_file).read_text(encoding="utf-8").splitlines() if line.strip()]
        except OSError as exc:
            raise UsageError(f"--batch-file: cannot read {args.batch_file!r} ({exc.strerror})") from None
        if not prompts:
            raise UsageError(f"--batch-file {args.batch_file!r} has no prompts (one per line)")
    else:
        if args.prompt in (None, "-"):
            if sys.stdin is None or sys.stdin.isatty():
                raise UsageError("no prompt: pass PROMPT, pipe it on stdin, or use --batch-file")
            prompts = [sys.stdin.read().strip()]
            if not prompts[0]:
                raise UsageError("no prompt on stdin: pass PROMPT, pipe it on stdin, or use --batch-file")
        else:
            prompts = [args.prompt]
            if not prompts[0].strip():
                raise UsageError("PROMPT is empty")

    from dflash import generate

    target, tok, draft, device = _load(model, draft_path, device, system=args.system)
    encoded = [_encode(tok, _messages(args.system, text), device) for text in prompts]
    block = args.block_size or draft.config.block_size
    options = dict(stop_token_ids=_stop_ids(target, tok), temperature=args.temperature, top_p=args.top_p,
                   top_k=args.top_k, block_size=block, backend=args.runtime, seed=args.seed)
    total_tokens, rounds, decode_s, total_s = 0, [], 0.0, 0.0
    for text, ids in zip(prompts, encoded):
        streamer = None if args.batch_file else TextStreamer(tok)
        res = generate(target, draft, ids, args.max_new_tokens, on_tokens=streamer, **options)
        new = res.sequences[0, res.num_prompt_tokens:]
        if args.batch_file:
            completion = tok.decode(new, skip_special_tokens=True, clean_up_tokenization_spaces=False)
            print(json.dumps({"prompt": text, "completion": completion, "tokens": int(new.numel()),
                              "tau": round(res.tau, 4)}), flush=True)
        else:
            streamer.finish()
        total_tokens += int(new.numel())
        rounds += res.acceptance_lengths
        decode_s += res.decode_time
        total_s += res.total_time
    print(_summary(total_tokens, rounds, decode_s, total_s, args.runtime, block), file=sys.stderr)
    return 0


# --------------------------------------------------------------------------------------------- benchmark
def load_prompt_set(name: str, max_samples: int | None) -> list[list[str]]:
    """The shipped prompt set ``name`` (each item: its user turns), in file order, first ``max_samples``."""
    with open(PROMPT_SETS / f"{name}.jsonl", encoding="utf-8") as f:
        items = [json.loads(line)["turns"] for line in f if line.strip()]
    return items[:max_samples] if max_samples else items


def benchmark_main(argv: list[str]) -> int:
    """``dflash benchmark``."""
    return _run("dflash benchmark", _benchmark, argv)


def _benchmark(argv: list[str]) -> int:
    _backend_or_error("dflash benchmark", argv)
    p = _common_parser("dflash benchmark", "z-lab's benchmark on small prompt sets shipped in the package "
                       "(offline stand-ins for the named datasets, see dflash_apps/assets/prompts/README.md): every "
                       "prompt is decoded autoregressively (block size 1, same machinery) and with DFlash; "
                       "prints time per output token, speedup, tau and the acceptance histogram.")
    p.add_argument("--dataset", required=True, choices=DATASETS)
    p.add_argument("--max-samples", type=int, default=None, help="first N prompts of the set")
    p.add_argument("--output", help="also write per-request results as JSON lines to this file")
    args = p.parse_intermixed_args(argv)
    _check_numbers(args)
    if args.max_samples is not None and args.max_samples < 1:
        raise UsageError(f"--max-samples must be >= 1, got {args.max_samples}")
    model, draft_path = _resolve_paths(args)
    device = _device(args.device)
    items = load_prompt_set(args.dataset, args.max_samples)

    from dflash import generate

    target, tok, draft, device = _load(model, draft_path, device, system=args.system)
    block = args.block_size or draft.config.block_size
    options = dict(stop_token_ids=_stop_ids(target, tok), temperature=args.temperature, top_p=args.top_p,
                   top_k=args.top_k, backend=args.runtime, seed=args.seed)
    # Warm-up (caches, first-call overheads) on the first prompt, not counted.
    warm = _encode(tok, _messages(args.system, items[0][0]), device)
    for b in (1, block):
        generate(target, draft, warm, 4, block_size=b, **options)
    records = []
    for i, turns in enumerate(items):
        history = [{"role": "system", "content": args.system}] if args.system else []
        for t, user in enumerate(turns):
            history.append({"role": "user", "content": user})
            ids = _encode(tok, history, device)
            row = {"sample": i, "turn": t}
            for name, b in (("baseline", 1), ("dflash", block)):
                res = generate(target, draft, ids, args.max_new_tokens, block_size=b, **options)
                n = res.num_generated_tokens
                row[name] = {"tokens": n, "tpot": res.decode_time / max(n, 1), "tau": res.tau,
                             "acceptance_lengths": res.acceptance_lengths}
                if name == "dflash":  # z-lab feeds the DFlash answer back for the next turn
                    answer = tok.decode(res.sequences[0, res.num_prompt_tokens:], skip_special_tokens=True,
                                        clean_up_tokenization_spaces=False)
            history.append({"role": "assistant", "content": answer})
            records.append(row)
            print(f"[{len(records)}] sample {i} turn {t}: {row['dflash']['tokens']} tokens, tau "
                  f"{row['dflash']['tau']:.2f}", file=sys.stderr, flush=True)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            for row in records:
                f.write(json.dumps(row) + "\n")
    print(benchmark_report(records, block, args.dataset, args.runtime))
    return 0


def benchmark_report(records: list[dict], block: int, dataset: str, runtime: str) -> str:
    """z-lab's summary: throughput = 1 / mean TPOT, speedup = mean TPOT(baseline) / mean TPOT(DFlash), tau = mean
    over requests of their mean acceptance length, histogram of acceptance lengths over all rounds."""
    def mean(xs):
        return sum(xs) / max(1, len(xs))

    base = mean([r["baseline"]["tpot"] for r in records])
    dfl = mean([r["dflash"]["tpot"] for r in records])
    tau = mean([r["dflash"]["tau"] for r in records])
    lengths = [a for r in records for a in r["dflash"]["acceptance_lengths"]]
    hist = [sum(1 for a in lengths if a == k) / max(1, len(lengths)) for k in range(block + 1)]
    lines = [
        f"dataset {dataset} (shipped offline set), {len(records)} requests, B={block}, backend {runtime}",
        f"Baseline throughput: {1 / max(base, 1e-12):.2f} tokens/s",
        f"DFlash throughput:   {1 / max(dfl, 1e-12):.2f} tokens/s",
        f"Decoding speedup:    {base / max(dfl, 1e-12):.2f}x",
        f"Average acceptance length (tau): {tau:.2f}",
        "Acceptance length histogram: " + " ".join(f"{k}:{h:.2f}" for k, h in enumerate(hist)),
    ]
    return "\n".join(lines)

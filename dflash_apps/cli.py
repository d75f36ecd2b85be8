"""``dflash`` command line: z-lab's ``dflash generate`` and ``dflash benchmark``, and this project's
``dflash demo``, ``dflash train``, ``dflash export``, ``dflash bench <name>``."""
from __future__ import annotations

import argparse
import importlib
import os
import runpy
import sys
from pathlib import Path

BENCHMARKS = {
    "draft-latency": "draft_latency.py",
    "kernels": "kernels.py",
    "e2e": "e2e.py",
    "traffic": "traffic.py",
    "step-latency": "step_latency.py",
    "tree": "tree.py",
}
# name -> ("module:function" taking the remaining arguments, help)
SUBCOMMANDS = {
    "generate": ("dflash_apps.zlab_cli:generate_main", "z-lab's generate: dflash generate transformers --model M "
                 "--draft D PROMPT (M, D local folders or 'smollm2')"),
    "benchmark": ("dflash_apps.zlab_cli:benchmark_main", "z-lab's benchmark on prompt sets shipped in the package"),
    "demo": ("dflash_apps.demo:main", "run the embedded SmolLM2-135M + DFlash draft demo (offline)"),
    "train": ("dflash_apps.train:main", "train a DFlash draft for a target model"),
    "export": ("dflash_apps.cli:export_main", "dflash export vllm DRAFT OUT [--target T]: re-save a draft in the form "
               "vLLM serves (a vocabulary subset as the draft's own lm_head rows + d2t)"),
}


def device_arg(name: str):
    """A ``--device`` value as a torch.device: "auto" (cuda when available, else cpu), "cpu", "cuda" or
    "cuda:N" of a GPU this machine has; anything else is a ValueError naming ``--device``."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {name!r} is not a device: pass cpu, cuda, cuda:N or auto")
    if device.type == "cuda" and not (torch.cuda.is_available() and (device.index or 0) < torch.cuda.device_count()):
        found = torch.cuda.device_count() if torch.cuda.is_available() else 0
        raise ValueError(f"--device {name!r}: this machine has {found} CUDA device(s); pass --device cpu")
    return device


def bench_dir() -> Path:
    """bench/ of the source checkout (the package is installed editable from it)."""
    return Path(__file__).resolve().parents[1] / "bench"


def no_checkout_message(name: str) -> str:
    return (f"dflash bench {name}: the benchmark scripts live in bench/ of the source repository, which an "
            "installed package does not include. Clone the repository and run `pip install -e .` (or run "
            f"`python bench/{BENCHMARKS[name]}` there); `dflash benchmark` runs from any install.")


def export_main(argv: list[str]) -> int:
    """``dflash export vllm DRAFT OUT``: a draft saved with ``draft_token_ids`` re-saved so that vLLM loads it;
    a vocabulary subset needs the target (``--target``: "smollm2" or a Hugging Face model folder) for the
    LM head rows it scores."""
    import torch

    from dflash.draft import DraftModel

    parser = argparse.ArgumentParser(prog="dflash export", description=export_main.__doc__)
    parser.add_argument("format", choices=["vllm"])
    parser.add_argument("draft", help="draft folder to convert")
    parser.add_argument("out", help="folder to write")
    parser.add_argument("--target", help='the target the draft was trained for: "smollm2" or a model folder '
                        "(needed when the draft has a vocabulary subset)")
    args = parser.parse_args(argv)
    draft = DraftModel.from_pretrained(args.draft)
    head = None
    if draft.config.draft_vocab_size is not None:
        if args.target is None:
            parser.error(f"{args.draft} has a draft vocabulary subset ({draft.config.draft_vocab_size} ids): pass "
                         "--target (smollm2 or the target's model folder) so its LM head rows can be written")
        if args.target == "smollm2":
            from dflash_apps import smollm2

            target, _ = smollm2.load(dtype=draft.fc.weight.dtype)
        else:
            from transformers import AutoModelForCausalLM

            target = AutoModelForCausalLM.from_pretrained(args.target, dtype=draft.fc.weight.dtype)
        head = target.get_output_embeddings()
    with torch.no_grad():
        draft.save_pretrained(args.out, output_head=head)
    print(f"wrote {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="dflash", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (_, help_text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    bench = sub.add_parser("bench", help="run a benchmark from bench/", add_help=False)
    bench.add_argument("name", choices=sorted(BENCHMARKS))
    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":
        script = bench_dir() / BENCHMARKS[args.name]
        if not script.is_file():
            print(no_checkout_message(args.name), file=sys.stderr)
            return 2
        sys.argv = [str(script), *rest]
        os.environ.setdefault("PYTHONUNBUFFERED", "1")
        runpy.run_path(str(script), run_name="__main__")
        return 0
    module, function = SUBCOMMANDS[args.command][0].split(":")
    return int(getattr(importlib.import_module(module), function)(rest) or 0)


if __name__ == "__main__":
    raise SystemExit(main())

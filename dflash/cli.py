"""``dflash`` command line: ``dflash demo``, ``dflash train``, ``dflash bench <name>``."""
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
}
SUBCOMMANDS = {
    "demo": ("dflash.demo", "run the embedded SmolLM2-135M + DFlash draft demo (offline)"),
    "train": ("dflash.train", "train a DFlash draft for a target model"),
}


def bench_dir() -> Path:
    """bench/ of the source checkout (the package is installed editable from it)."""
    return Path(__file__).resolve().parents[1] / "bench"


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
            parser.error(f"{script} not found: benchmarks run from a source checkout (pip install -e .)")
        sys.argv = [str(script), *rest]
        os.environ.setdefault("PYTHONUNBUFFERED", "1")
        runpy.run_path(str(script), run_name="__main__")
        return 0
    module = importlib.import_module(SUBCOMMANDS[args.command][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    raise SystemExit(main())

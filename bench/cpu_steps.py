"""The SmolLM2 demo pair on the CPU, step by step: HF ``generate``, our autoregressive decoding (``block_size=1``)
and DFlash, for each kernel backend, interleaved in one process.

Each rep runs, in order, HF ``target.generate``, then for every ``--backends`` entry our autoregressive decoding
and DFlash at ``--block`` (default: the draft's), all greedy on the demo's default prompt, each after its own
warm-up call. Reported: medians over reps of the end-to-end time (prefill included) and tokens/s, and medians
over all rounds of all reps of the one-token step (the autoregressive verify), the B-row verify step and the
draft step, plus τ and whether every output equals HF's. ``--backends torch`` is the ops' PyTorch references
with ``F.linear`` (the CPU path before the ``"cpu"`` backend); ``cpu`` is the default on CPU now;
``cpu-no-native`` is ``cpu`` with its native kernels off (``DFLASH_CPU_NATIVE=0``: the torch formulas);
``cpu-no-amx`` is ``cpu`` with ``cpu_linear``'s AMX path off (its fp32 kernel); ``cpu-no-bf16`` is ``cpu`` with
``cpu_linear``'s bf16-packed weights off (bf16-exact weights stream as fp32); ``cpu-op-path`` is ``cpu`` with the
lean target's native forward off (``dflash_kernels.cpu.forward``: the forward through the ops, one Python call each).

Usage: python bench/cpu_steps.py [--reps 5] [--threads 2] [--max-new 128] [--backends torch,cpu,cpu-no-amx,cpu-op-path]
       [--out FILE]
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  (puts the repository root on sys.path)

from dflash import generate  # noqa: E402
from dflash_apps import smollm2  # noqa: E402

from dflash_kernels.cpu import linear as cpu_linear  # noqa: E402
from dflash.model import DFlashDraftModel  # noqa: E402
from dflash_apps.demo import DEFAULT_DRAFT, DEFAULT_PROMPT  # noqa: E402
from dflash_kernels.cpu import native as cpu_native  # noqa: E402

NO_NATIVE = "-no-native"
NO_AMX = "-no-amx"
NO_BF16 = "-no-bf16"
OP_PATH = "-op-path"


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
    except OSError:
        return platform.processor() or "?"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-new", type=int, default=128)
    p.add_argument("--block", type=int, default=None)
    p.add_argument("--backends", default="torch,cpu", help="kernel backends of our runtime, comma-separated")
    p.add_argument("--out", default=None, help="also write the markdown report here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    backends = args.backends.split(",")
    if cpu_native.ENV in os.environ:
        raise SystemExit(f"bench/cpu_steps.py: unset {cpu_native.ENV}; choose with --backends cpu,cpu{NO_NATIVE}")
    load0 = os.getloadavg()[0]

    target, tok = smollm2.load(verbose=False)
    draft = DFlashDraftModel.from_pretrained(DEFAULT_DRAFT, dtype=torch.float32)
    block = args.block or draft.config.block_size
    ids = torch.tensor([tok(smollm2.chat_prompt(tok, DEFAULT_PROMPT), add_special_tokens=False)["input_ids"]])
    stops = smollm2.stop_token_ids(tok)

    def hf(n):
        return common.hf_greedy(target, ids, n, stops)

    def ours(n, b, kb):
        with common.cpu_kernels(native=not kb.endswith(NO_NATIVE), amx=not kb.endswith(NO_AMX),
                                native_forward=not kb.endswith(OP_PATH), bf16=not kb.endswith(NO_BF16)):
            return generate(target, draft, ids, n, block_size=b, stop_token_ids=stops, backend="fast",
                            kernel_backend=kb.removesuffix(NO_NATIVE).removesuffix(NO_AMX).removesuffix(OP_PATH)
                            .removesuffix(NO_BF16))

    runs = [("HF generate", None, None)] + [(f"{kind} ({kb})", kb, b) for kb in backends
                                            for kind, b in (("autoregressive", 1), (f"DFlash B={block}", block))]
    totals = {name: [] for name, _, _ in runs}
    tokens = {name: [] for name, _, _ in runs}
    draft_ms = {name: [] for name, _, _ in runs}
    verify_ms = {name: [] for name, _, _ in runs}
    taus = {name: [] for name, _, _ in runs}
    identical = True
    def report(reps_done: int) -> str:
        med = statistics.median
        hf_tps = med(tokens["HF generate"]) / med(totals["HF generate"])
        lines = [f"Machine: {_cpu_model()}, {os.cpu_count()} cores visible, shared with other jobs (load average "
                 f"{load0:.1f} at start, {os.getloadavg()[0]:.1f} at end); torch {torch.__version__}, "
                 f"{args.threads} threads, fp32; python {platform.python_version()}; commit {_commit()}; "
                 f"cpu_linear: {cpu_linear.isa() or cpu_linear.unavailable_reason()}, AMX "
                 f"{'on' if cpu_linear.amx_active() else 'off'}.",
                 f"Command: `python bench/cpu_steps.py --reps {args.reps} --threads {args.threads} --max-new "
                 f"{args.max_new} --backends {args.backends}` ({reps_done} reps done). Default demo prompt, greedy, up "
                 f"to {args.max_new} new tokens; per rep, each runtime after its own warm-up call, in the order of "
                 "the table; medians over reps (end to end) and over all rounds but each run's first (steps).", "",
                 "| runtime | median s (min-max) | tok/s | vs HF | one-token / verify step ms | draft step ms | τ |",
                 "|---|---:|---:|---:|---:|---:|---:|"]
        for name, kb, b in runs:
            t = totals[name]
            tps = med(tokens[name]) / med(t)
            step = f"{med(verify_ms[name]):.1f}" if verify_ms[name] else ""
            dstep = f"{med(draft_ms[name]):.1f}" if b and b > 1 else ""
            tau = f"{med(taus[name]):.2f}" if taus[name] else ""
            lines.append(f"| {name} | {med(t):.2f} ({min(t):.2f}-{max(t):.2f}) | {tps:.1f} | {tps / hf_tps:.2f}x | "
                         f"{step} | {dstep} | {tau} |")
        for kb in backends:
            one, blk = verify_ms[f"autoregressive ({kb})"], verify_ms[f"DFlash B={block} ({kb})"]
            lines.append("")
            lines.append(f"{kb}: verify step at B={block} / one-token step = {med(blk) / med(one):.2f}")
        lines += ["", f"Outputs identical to HF generate's greedy output (every run): {'yes' if identical else 'NO'}"]
        text = "\n".join(lines)
        if args.out:  # rewritten after every rep: an interrupted run keeps its reps so far
            with open(args.out, "w", encoding="utf-8") as f:
                f.write(text + "\n")
        return text

    for rep in range(args.reps):
        for name, kb, b in runs:
            if kb is None:
                hf(4)
                ref, secs = hf(args.max_new)
                totals[name].append(secs)
                tokens[name].append(ref.shape[1] - ids.shape[1])
                continue
            ours(4, b, kb)  # warm-up: the engine for this backend and block size
            res = ours(args.max_new, b, kb)
            identical &= torch.equal(res.sequences, ref)
            totals[name].append(res.total_time)
            tokens[name].append(res.num_generated_tokens)
            rounds = res.extra["round_times"][1:]  # the first round builds the engine's state
            draft_ms[name] += [1e3 * r[0] for r in rounds]
            verify_ms[name] += [1e3 * r[1] for r in rounds]
            taus[name].append(res.tau)
        report(rep + 1)
        print(f"rep {rep + 1}/{args.reps} done", file=sys.stderr, flush=True)
    print(report(args.reps))
    return 0 if identical else 3


if __name__ == "__main__":
    sys.exit(main())

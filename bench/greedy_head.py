"""The greedy verify's LM head on the CPU: a SmolLM2 target forward whose head returns logits (then
their argmax by NumPy, as ``verify_greedy``'s "cpu" backend takes it) against one whose head returns the argmax
itself (``cpu_linear.linear_argmax``: a screen of the vocabulary, one AMX tile product a step on the AMX route or
int8 codes on the bf16-packed route, and only the 16-column groups a proven bound cannot rule out computed
exactly), at several row counts, in one run. ``--without-amx`` runs every row count on the bf16-packed route (the
route of CPUs without AMX; with AMX on, every row count takes AMX).

The forward is ``dflash.lean_target.LeanTarget`` on the "cpu" kernel backend (its native forward where it applies,
as the engine runs it), after a context of ``--context`` tokens of real text: a held-out prompt and the target's
own greedy continuation of it, and the block is the next ``rows`` tokens (random tokens would flatten the target's
distributions and make the screen's job look harder than in decoding). The two heads alternate rep by rep; each
cell is a median over reps. "exact groups a row": how many of the vocabulary's 16-column groups the screen
computed exactly, per row (SmolLM2: 3,072 groups).

Usage: python bench/greedy_head.py [--rows 1,8,16,24,32] [--reps 15] [--context 200] [--threads 2] [--without-amx]
       [--out FILE.md]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

import torch  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,8,16,24,32")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--without-amx", action="store_true", help="cpu_linear's AMX path off for the run")
    ap.add_argument("--out", default=None, help="also write the markdown table here")
    args = ap.parse_args(argv)

    from dflash_apps import smollm2

    from dflash_kernels.cpu import linear as cpu_linear
    from dflash.lean_target import LeanTarget
    from dflash_apps.train.prompts import eval_prompts
    from dflash_kernels.cpu.argmax import argmax_cpu

    if common.smollm2_unavailable("greedy_head.py"):
        return 1
    torch.set_num_threads(args.threads)
    rows_list = common.parse_ints(args.rows)
    target, tok = smollm2.load(verbose=False)
    prompt = tok(smollm2.chat_prompt(tok, eval_prompts(2)[1]), return_tensors="pt").input_ids
    need = args.context + max(rows_list)
    text = prompt
    if need > prompt.shape[1]:
        with torch.inference_mode():
            more = need - prompt.shape[1]
            text = target.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                   max_new_tokens=more, min_new_tokens=more)
    text = text[:, :need]
    lt = LeanTarget(target, [1, 27], batch=1, capacity=need, backend="cpu")
    start = torch.tensor([args.context])
    exact: dict = {}
    screens = {name: getattr(cpu_linear, name) for name in ("_amx_argmax", "_int8_argmax")}

    def counted(screen):
        def call(x, *rest):
            ids, pairs = screen(x, *rest)
            rows = x.numel() // x.shape[-1]  # (x: the head's [1, rows, H] input)
            exact.setdefault(rows, []).append(pairs / rows)
            return ids, pairs
        return call
    for name, screen in screens.items():
        setattr(cpu_linear, name, counted(screen))
    amx_before = cpu_linear.set_amx(False) if args.without_amx else None
    times: dict = {}
    try:
        with torch.inference_mode():
            lt.forward(text[:, :args.context], torch.tensor([0]), args.context)
            for rep in range(args.reps + 2):  # two warm-up reps, not kept
                for q in rows_list:
                    block = text[:, args.context:args.context + q]
                    for mode in ("logits", "argmax")[::1 if rep % 2 else -1]:
                        t = time.perf_counter()
                        if mode == "logits":
                            out = argmax_cpu(lt.forward(block, start, args.context + q)[0])
                        else:
                            out = lt.forward(block, start, args.context + q, argmax=True)[0]
                        ms = 1e3 * (time.perf_counter() - t)
                        if rep >= 2:
                            times.setdefault((q, mode), []).append(ms)
                        times.setdefault(("ids", q, mode), out)
                    if not torch.equal(times[("ids", q, "logits")], times[("ids", q, "argmax")]):
                        raise AssertionError(f"rows {q}: the screened argmax differs from the logits' argmax")
                print(f"[greedy_head] rep {rep + 1}/{args.reps + 2}", file=sys.stderr, flush=True)
        amx = "on" if cpu_linear.amx_active() else "off"
    finally:
        for name, screen in screens.items():
            setattr(cpu_linear, name, screen)
        if amx_before is not None:
            cpu_linear.set_amx(amx_before)

    rows = []
    for q in rows_list:
        before, after = (statistics.median(times[(q, m)]) for m in ("logits", "argmax"))
        rows.append({"rows": q, "logits_then_argmax_ms": round(before, 2), "screened_argmax_ms": round(after, 2),
                     "saved_ms": round(before - after, 2), "ratio": f"{after / before:.3f}",
                     "exact_groups_a_row": round(statistics.median(exact[q]), 2) if q in exact else "n/a"})
    env = common.environment(torch.device("cpu"))
    head = (f"SmolLM2-135M lean target forward (\"cpu\" backend), {args.context} cached tokens (a prompt and its "
            f"greedy text), fp32, {args.reps} reps (medians), the two heads alternated; AMX {amx}; {env['hardware']}, "
            f"torch {env['torch']}, commit {env['commit']}, {env['date']}")
    columns = ["rows", "logits_then_argmax_ms", "screened_argmax_ms", "saved_ms", "ratio", "exact_groups_a_row"]
    common.report(head, rows, columns, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

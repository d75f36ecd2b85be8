"""Draft and verify step latency, measured, next to the traffic accountant's H200 prediction.

For a random pair of bench/traffic.py's MODELS (default on CUDA: qwen3-8b, all 36 target layers and the
5-layer b16 draft in bf16, ~18 GB of weights; batch 8 at a 32k context adds ~44 GB of caches, so an
H200 needs no reduced layer count), one ``DFlashEngine`` per batch size and mode:

  eager   use_cuda_graphs=False: the step's kernels launched from Python, attention bounded by the
          context + B
  graph   the step captured once per engine as a CUDA graph and replayed, attention bounded by the
          capacity (as captured steps are); CUDA only: on CPU the rows say so

``engine.fill_random_context(context)`` sets the state (random draft and target K/V, features,
anchors), and ``engine.set_context(context)`` restores the positions before every repetition
(untimed), so each verify step commits from the same state. Medians after warm-up (the first graph
call captures); CUDA events per repetition.

Next to each median: the accountant's ``predicted_ms_h200`` (its bytes at 4.3 TB/s or FLOPs at
790 TFLOP/s, plus 4 us per eager or 1.5 us per replayed launch, assumed) and ``floor_ms_h200`` (the
bytes the step cannot avoid, at 4.3 TB/s) for the same model, batch, context, capacity, block and
mode, and measured / predicted. On CPU the default is the ``tiny`` model in fp32, a smoke run: its
timings say nothing about a GPU, the prediction columns are still the H200's.

Usage: python bench/step_latency.py [--model qwen3-8b] [--batch 1,8] [--contexts 2k,32k] [--block 16]
       [--out DIR]       (``dflash bench step-latency`` runs this file)
"""
from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import summarize  # noqa: E402
import traffic  # noqa: E402

import torch  # noqa: E402

from dflash.engine import DFlashEngine  # noqa: E402

MODES = ("eager", "graph")


def predictions(model: str, batches, contexts, capacity: int, block: int) -> dict:
    """(batch, context, mode, step) -> the accountant's summary. Called outside inference mode, which
    would change the aten ops it records."""
    return {(batch, context, mode, s["step"]): s for batch in batches for context in contexts for mode in MODES
            for s in traffic.measure(model, batch, context, capacity, block, graphs=mode == "graph")}


def run(args, partial_csv: Path):
    device = common.pick_device(args.device)
    cuda = device.type == "cuda"
    if not cuda:
        torch.set_num_threads(args.threads)
    model = args.model or ("qwen3-8b" if cuda else "tiny")
    dtype = torch.bfloat16 if cuda else torch.float32
    batches = common.parse_ints(args.batch)
    contexts = common.parse_ints(args.contexts or ("2k,32k" if cuda else "48,192"))
    capacity = max(contexts) + args.block  # the longest context still drafts a full block
    t0 = time.perf_counter()
    pred = predictions(model, batches, contexts, capacity, args.block)
    env = common.print_header("draft and verify step latency vs the traffic accountant's H200 prediction", device, {
        "model": f"{model} {traffic.MODELS[model]}, random weights in {str(dtype)[6:]}, capacity {capacity}, "
                 f"block {args.block}",
        "prediction": f"bench/traffic.py on meta tensors ({time.perf_counter() - t0:.1f} s): bytes at "
                      f"{traffic.H200_BYTES_PER_S / 1e12} TB/s or FLOPs at {traffic.H200_FLOPS / 1e12:.0f} TFLOP/s + "
                      f"launches (graph: {traffic.LAUNCH_US['graph']} us each; eager: the host time measured on this "
                      f"CPU + {traffic.CUDA_LAUNCH_API_US} us a launch)",
    })
    if not cuda:
        print("# graph: UNAVAILABLE on this machine (no CUDA device); CPU timings say nothing about an H200")
    target, draft = common.randomize_(*traffic.build_models(model, capacity, args.block, device, dtype))
    rows = common.RowLog(partial_csv, env)
    with torch.inference_mode():
        for batch in batches:
            for mode in MODES:
                engine = DFlashEngine(target, draft, batch=batch, capacity=capacity, block_size=args.block,
                                      use_cuda_graphs=mode == "graph") if cuda or mode == "eager" else None
                for context in contexts:
                    if engine:
                        engine.fill_random_context(context)
                    for step in ("draft", "verify"):
                        p = pred[batch, context, mode, step]
                        row = dict(model=model, batch=batch, context=context, capacity=capacity, block=args.block,
                                   step=step, mode=mode, dtype=str(dtype)[6:], launches=p["launches"],
                                   bytes_GB=p["bytes"] / 1e9, predicted_ms_h200=p["predicted_ms_h200"],
                                   floor_ms_h200=p["floor_ms_h200"])
                        if engine is None:
                            rows.append({**row, "status": "unavailable: no CUDA device"})
                            continue
                        t = common.time_fn(lambda s=step: engine.run_step(s), device, warmup=args.warmup,
                                           reps=args.reps, budget_s=args.budget,
                                           before=lambda c=context: engine.set_context(c))
                        ratio = t["median_ms"] / p["predicted_ms_h200"]
                        rows.append({**row, "status": "ok", **t, "measured_over_predicted": ratio,
                                     "measured_over_floor": t["median_ms"] / p["floor_ms_h200"]})
                        print(f"{model} b{batch:<2d} ctx{context:<6d} {step:6s} {mode:5s} {t['median_ms']:9.4g} ms  "
                              f"predicted {p['predicted_ms_h200']:7.4g} ms (x{ratio:.2f})  floor "
                              f"{p['floor_ms_h200']:7.4g} ms  [{time.perf_counter() - t0:4.0f} s]", flush=True)
                del engine
                gc.collect()
                if cuda:
                    torch.cuda.empty_cache()
    return rows, env


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="auto")
    p.add_argument("--model", choices=sorted(traffic.MODELS), help="default qwen3-8b on CUDA, tiny on CPU")
    p.add_argument("--batch", default="1,8", help="comma list (default 1,8)")
    p.add_argument("--contexts", help="cached rows per request, comma list, k = 1024; default CUDA 2k,32k, CPU 48,192")
    p.add_argument("--block", type=int, default=16)
    p.add_argument("--threads", type=int, default=1, help="CPU threads (default 1: the cores are shared)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--budget", type=float, default=0.3, help="seconds of timed work per measurement")
    p.add_argument("--out", help="output folder (default $OUT, else bench/results)")
    p.add_argument("--tag", help="file name stem (default step_latency-<device>)")
    args = p.parse_args(argv)
    if args.block < 2:
        raise SystemExit(f"--block {args.block}: the draft step needs a block of at least 2")
    out = common.out_dir(args.out)
    stem = args.tag or f"step_latency-{common.pick_device(args.device).type}"
    rows, env = run(args, out / f"{stem}.partial.csv")
    print()
    print(summarize.step_latency_summary(rows))
    path = rows.finish(out / f"{stem}.csv")
    print(f"# wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Draft-step latency vs block size, context length and batch: reference vs fast eager vs CUDA graph.

One draft step = what one decode round spends in the draft: fuse + inject the last round's B
context rows, every draft layer over [context cache ++ block], final norm, the target's LM head on
the B-1 proposal rows, argmax. Providers, timed side by side in one run on the same weights:

  reference   DFlashDraftModel.forward (eager: torch.cat into a DraftKVCache, SDPA) with a cache
              prefilled to `context` rows, then LM head + argmax: the official loop's draft call.
              It gets B new context rows per step, like the fast step's static shape.
  fast-eager  DFlashEngine.draft_step() with use_cuda_graphs=False (kernel backend "auto" on GPU:
              Triton/CUDA kernels; on CPU the ops' eager CPU bodies, backend "cpu").
  fast-graph  the same step captured once per (batch, block) as a CUDA graph, timed by replays.
              GPU only: on CPU every row says it is unavailable.

Columns: median ms, and % of the floor. The memory floor is the bytes the step must move (draft
layer weights + fc + the LM head when B > 1 + context K/V read + features/embeddings read + injected
K/V written) over the copy bandwidth measured at the start of the same run; the compute floor is
its FLOPs over the measured matrix-product rate. %mem = memory floor / median.

Usage: python bench/draft_latency.py [--models qwen3-8b,qwen3-4b] [--batch 1,4,16]
       [--contexts 512,2k,8k,32k] [--blocks 1,2,4,8,16,32] [--out DIR]
(``dflash bench draft-latency`` runs this file.) Default on CPU: the scaled-down model `cpu-small`.
"""
from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

# name: (hidden, draft layers, heads, kv heads, head dim, intermediate, taps, target layers, vocab)
MODELS = {
    "qwen3-8b": dict(hidden=4096, layers=5, heads=32, kv_heads=8, head_dim=128, inter=12288,
                     taps=[1, 9, 17, 25, 33], target_layers=36, vocab=151936),
    "qwen3-4b": dict(hidden=2560, layers=5, heads=32, kv_heads=8, head_dim=128, inter=9728,
                     taps=[1, 9, 17, 25, 33], target_layers=36, vocab=151936),
    # CPU stand-in: same structure (5 layers, 5 taps of 36, GQA 4:1), ~1/8 width, 1/9 vocab.
    "cpu-small": dict(hidden=512, layers=5, heads=8, kv_heads=2, head_dim=64, inter=1536,
                      taps=[1, 9, 17, 25, 33], target_layers=36, vocab=16384),
    # smoke-test size
    "tiny": dict(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, inter=128,
                 taps=[1, 3], target_layers=4, vocab=512),
}
PROVIDERS = ("reference", "fast-eager", "fast-graph")


def build_pair(spec: dict, device: torch.device, dtype: torch.dtype, block: int):
    """A random Qwen3 target (right hidden/vocab, enough layers for the taps; its layers are
    minimal-width because the draft step only touches its embedding and LM head) and a random draft."""
    from transformers import Qwen3Config

    from dflash import DFlashConfig

    tcfg = Qwen3Config(vocab_size=spec["vocab"], hidden_size=spec["hidden"], intermediate_size=64,
                       num_hidden_layers=max(spec["taps"]) + 1, num_attention_heads=1, num_key_value_heads=1,
                       head_dim=spec["head_dim"], max_position_embeddings=65536, tie_word_embeddings=False,
                       rope_theta=1e6)
    dcfg = DFlashConfig(hidden_size=spec["hidden"], num_hidden_layers=spec["layers"],
                        num_attention_heads=spec["heads"], num_key_value_heads=spec["kv_heads"],
                        head_dim=spec["head_dim"], intermediate_size=spec["inter"],
                        num_target_layers=spec["target_layers"], target_layer_ids=spec["taps"], block_size=block,
                        mask_token_id=spec["vocab"] - 2, vocab_size=spec["vocab"], max_position_embeddings=65536,
                        rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    return common.instantiate_random(tcfg, dcfg, device, dtype)


def step_cost(spec: dict, batch: int, context: int, block: int, elem: int, draft) -> tuple[float, float]:
    """(bytes, FLOPs) the draft step must move / compute at least."""
    H, L, kvh, D, V, nh = spec["hidden"], spec["layers"], spec["kv_heads"], spec["head_dim"], spec["vocab"], spec["heads"]
    layer_params = sum(p.numel() for p in draft.layers.parameters())
    fc_params = draft.fc.weight.numel()
    head_params = V * H if block > 1 else 0
    rows = batch * block
    nbytes = (layer_params + fc_params + head_params + 2 * H) * elem
    nbytes += L * batch * context * kvh * D * 2 * elem          # context K/V read
    nbytes += rows * (len(spec["taps"]) + 1) * H * elem         # features + embedding rows read
    nbytes += L * rows * kvh * D * 2 * elem                     # injected K/V written
    flops = 2 * rows * (layer_params + fc_params) + 2 * batch * (block - 1) * head_params
    flops += L * 4 * rows * nh * D * (context + block)          # QK^T and PV
    return float(nbytes), float(flops)


class Reference:
    """The official loop's draft call on a DraftKVCache holding `context` rows (random K/V)."""

    def __init__(self, target, draft, batch: int, context: int, device, dtype):
        from dflash.model import DraftKVCache

        cfg = draft.config
        self.target, self.draft, self.batch, self.context = target, draft, batch, context
        self.cache = DraftKVCache()
        for li in range(cfg.num_hidden_layers):
            shape = (batch, cfg.num_key_value_heads, context, cfg.head_dim)
            self.cache.update(torch.randn(shape, device=device, dtype=dtype),
                              torch.randn(shape, device=device, dtype=dtype), li)
        self.positions = torch.arange(context + 64, device=device)[None]
        self.device, self.dtype = device, dtype

    def prepare(self, block: int) -> None:
        cfg = self.draft.config
        V = self.target.config.vocab_size
        self.block_size = block
        self.new = min(block, self.context)  # new context rows per step (the fast step's static shape)
        self.features = torch.randn(self.batch, self.new, cfg.num_taps * cfg.hidden_size, device=self.device,
                                    dtype=self.dtype)
        self.block = torch.full((self.batch, block), cfg.mask_token_id, device=self.device, dtype=torch.long)
        self.block[:, 0] = torch.randint(0, V - 2, (self.batch,), device=self.device)

    def step(self) -> torch.Tensor:
        draft, target, B = self.draft, self.target, self.block_size
        start = self.context  # rows before the block; the cache holds start - new of them
        self.cache.crop(start - self.new)
        noise = F.embedding(self.block, target.model.embed_tokens.weight).to(self.dtype)
        noise = noise * draft.config.input_embedding_scale
        hidden = draft(position_ids=self.positions[:, start - self.new:start + B], noise_embedding=noise,
                       target_hidden=self.features, past_key_values=self.cache)
        self.cache.crop(start)
        logits = draft.compute_logits(hidden[:, 1:, :], target.lm_head)
        return torch.argmax(logits, dim=-1)


def make_engine(target, draft, batch: int, capacity: int, block: int, graphs: bool):
    from dflash.engine import DFlashEngine

    return DFlashEngine(target, draft, batch=batch, capacity=capacity, block_size=block, use_cuda_graphs=graphs)


def run(args, partial_csv: Path):
    device = common.pick_device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[
        args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    elem = torch.tensor([], dtype=dtype).element_size()
    models = args.models.split(",") if args.models else (["qwen3-8b", "qwen3-4b"] if device.type == "cuda"
                                                         else ["cpu-small"])
    batches = common.parse_ints(args.batch or "1")
    contexts = common.parse_ints(args.contexts or ("512,2k,8k,32k" if device.type == "cuda" else "512,2k"))
    blocks = common.parse_ints(args.blocks or "1,2,4,8,16,32")
    bw = common.copy_bandwidth(device)
    mm = common.matmul_rate(device, dtype)
    graph_ok = device.type == "cuda"
    env = common.print_header("draft step latency", device, {
        "dtype": f"{str(dtype)[6:]}" + ("" if device.type == "cuda" else
                                        " (CPU: fp32 by default; bf16 GEMM has no native path on this CPU)"),
        "floor": f"memory floor = bytes / {bw['copy_GBps']:.1f} GB/s (copy of {bw['copy_bytes'] / 2**20:.0f} MiB random "
                 f"bf16, read+write, measured now); compute floor = FLOPs / {mm['mm_TFLOPs']:.3f} TFLOP/s "
                 f"({mm['mm_n']}^3 {mm['mm_dtype']} matmul, measured now)",
        "providers": "reference (DFlashDraftModel + DraftKVCache, eager) | fast-eager (DFlashEngine.draft_step, "
                     f"kernel backend {'auto' if device.type == 'cuda' else 'torch'}) | fast-graph (CUDA graph replay)",
    })
    if not graph_ok:
        print("# fast-graph: UNAVAILABLE on this machine (no CUDA device): CUDA graphs need a GPU; rows say so")
    l2 = common.l2_bytes(device)
    rows = common.RowLog(partial_csv, {**env, **bw, **mm})
    t_start = time.perf_counter()
    with torch.inference_mode():
        for name in models:
            spec = MODELS[name]
            # DFlashEngine and the reference forward take the block size per call: one pair per model
            target, draft = build_pair(spec, device, dtype, max(blocks))
            for batch in batches:
                for block in blocks:
                    cap = max(contexts) + block
                    refs = {}
                    engine = make_engine(target, draft, batch, cap, block, graphs=False)
                    for context in contexts:
                        nbytes, flops = step_cost(spec, batch, context, block, elem, draft)
                        floor_mem = nbytes / (bw["copy_GBps"] * 1e9) * 1e3
                        floor_cmp = flops / (mm["mm_TFLOPs"] * 1e12) * 1e3
                        base = dict(model=name, batch=batch, context=context, block=block, dtype=str(dtype)[6:],
                                    bytes_MB=nbytes / 1e6, GFLOP=flops / 1e9, floor_mem_ms=floor_mem,
                                    floor_compute_ms=floor_cmp)
                        if l2 and nbytes < 4 * l2:
                            print(f"# note: {name} b{batch} ctx{context} B{block}: step moves {nbytes / 1e6:.0f} MB, "
                                  f"< 4x L2: repeated steps may hit L2")
                        timings = {}
                        # reference
                        ref = refs.get(context) or Reference(target, draft, batch, context, device, dtype)
                        refs = {context: ref}
                        ref.prepare(block)
                        timings["reference"] = common.time_fn(ref.step, device, warmup=args.warmup, reps=args.reps,
                                                              budget_s=args.budget)
                        # fast eager
                        engine.fill_random_context(context)
                        timings["fast-eager"] = common.time_fn(engine.draft_step, device, warmup=args.warmup,
                                                               reps=args.reps, budget_s=args.budget)
                        # fast graph
                        if graph_ok:
                            if context == contexts[0]:
                                genv = make_engine(target, draft, batch, cap, block, graphs=True)
                            genv.fill_random_context(context)
                            genv.run_step("draft")  # captures on first call
                            timings["fast-graph"] = common.time_fn(lambda: genv.run_step("draft"), device,
                                                                   warmup=args.warmup, reps=args.reps,
                                                                   budget_s=args.budget)
                        for prov in PROVIDERS:
                            t = timings.get(prov)
                            if t is None:
                                rows.append({**base, "provider": prov, "status": "unavailable: no CUDA device",
                                             "median_ms": float("nan")})
                                continue
                            rows.append({**base, "provider": prov, "status": "ok", **t,
                                         "pct_mem_floor": 100 * floor_mem / t["median_ms"],
                                         "pct_floor": 100 * max(floor_mem, floor_cmp) / t["median_ms"]})
                        r, f = timings["reference"]["median_ms"], timings["fast-eager"]["median_ms"]
                        gm = timings.get("fast-graph", {}).get("median_ms", float("nan"))
                        print(f"{name:9s} b{batch:<3d} ctx{context:<6d} B{block:<3d} ref {r:9.3f} ms  fast {f:9.3f} ms"
                              f"  graph {'n/a (no GPU)' if gm != gm else f'{gm:9.3f} ms'}  floor(mem) {floor_mem:8.3f} ms"
                              f"  [{time.perf_counter() - t_start:5.0f} s]", flush=True)
                    del engine, refs
                    if graph_ok:
                        del genv
                    gc.collect()
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
            del target, draft
    return rows, env, bw, mm


def wide(rows: list[dict]) -> list[dict]:
    out: dict[tuple, dict] = {}
    for r in rows:
        key = (r["model"], r["batch"], r["context"], r["block"])
        w = out.setdefault(key, {"model": r["model"], "batch": r["batch"], "ctx": r["context"], "B": r["block"],
                                 "floor_mem_ms": r["floor_mem_ms"], "floor_cmp_ms": r["floor_compute_ms"]})
        short = {"reference": "ref", "fast-eager": "fast", "fast-graph": "graph"}[r["provider"]]
        w[f"{short}_ms"] = r["median_ms"] if r["status"] == "ok" else "n/a"
        w[f"{short}_%mem"] = r.get("pct_mem_floor", "n/a") if r["status"] == "ok" else "n/a"
    for w in out.values():
        if isinstance(w.get("fast_ms"), float):
            w["ref/fast"] = w["ref_ms"] / w["fast_ms"]
        if isinstance(w.get("graph_ms"), float):
            w["ref/graph"] = w["ref_ms"] / w["graph_ms"]
    return list(out.values())


WIDE_COLUMNS = ["model", "batch", "ctx", "B", "ref_ms", "fast_ms", "graph_ms", "floor_mem_ms", "floor_cmp_ms", "ref_%mem",
                "fast_%mem", "graph_%mem", "ref/fast", "ref/graph"]


def plot(rows: list[dict], path: Path) -> Path | None:
    if not common.have_matplotlib():
        print("# plot: matplotlib is not installed; no PNG written (pip install matplotlib)")
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["model"], r["batch"]) for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    styles = {"reference": "-", "fast-eager": "--", "fast-graph": ":"}
    markers = {"reference": "o", "fast-eager": "s", "fast-graph": "^"}
    for ax, (model, batch) in zip(axes[0], panels):
        contexts = sorted({r["context"] for r in rows if r["model"] == model})
        colors = plt.cm.viridis([i / max(1, len(contexts) - 1) for i in range(len(contexts))])
        for ci, ctx in enumerate(contexts):
            for prov in PROVIDERS:
                pts = sorted((r["block"], r["median_ms"]) for r in rows if r["model"] == model and r["batch"] == batch
                             and r["context"] == ctx and r["provider"] == prov and r["status"] == "ok")
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], styles[prov], marker=markers[prov],
                            color=colors[ci], label=f"{prov} ctx {ctx}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("block size B")
        ax.set_ylabel("draft step, median ms")
        missing = [prov for prov in PROVIDERS if not any(r["provider"] == prov and r["status"] == "ok" for r in rows)]
        ax.set_title(f"{model}, batch {batch}" + (f"\n({', '.join(missing)}: unavailable, no GPU)" if missing else ""),
                     fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def load_rows(path: Path) -> list[dict]:
    import csv

    rows = []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            for k in ("batch", "context", "block"):
                r[k] = int(r[k])
            r["median_ms"] = float(r["median_ms"]) if r["median_ms"] not in ("", "nan") else float("nan")
            rows.append(r)
    return rows


def replot(path: Path) -> int:
    png = plot(load_rows(path), path.with_suffix(".png"))
    print(f"# wrote {png}" if png else "# no plot")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="auto")
    p.add_argument("--models", help=f"comma list of {sorted(MODELS)}")
    p.add_argument("--batch", help="comma list, default 1 (the issue's sweep: 1,4,16)")
    p.add_argument("--contexts", help="comma list, k = 1024; default GPU 512,2k,8k,32k, CPU 512,2k")
    p.add_argument("--blocks", help="comma list, default 1,2,4,8,16,32")
    p.add_argument("--dtype", choices=["bf16", "fp32", "fp16"], help="default bf16 on GPU, fp32 on CPU")
    p.add_argument("--threads", type=int, default=1, help="CPU threads (default 1: the cores are shared)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--budget", type=float, default=1.0, help="seconds of timed work per measurement")
    p.add_argument("--out", help="output folder (default $OUT, else bench/results)")
    p.add_argument("--tag", default=None, help="file name stem (default draft_latency-<device>)")
    p.add_argument("--replot", metavar="CSV", help="only redraw the PNG of an earlier run's CSV (next to it)")
    args = p.parse_args(argv)
    if args.replot:
        return replot(Path(args.replot))
    device = common.pick_device(args.device)
    out = common.out_dir(args.out)
    stem = args.tag or f"draft_latency-{device.type}"
    rows, env, bw, mm = run(args, partial_csv=out / f"{stem}.partial.csv")
    print()
    print(common.table(wide(rows), WIDE_COLUMNS))
    print(f"# %mem = memory floor / median (memory floor at {bw['copy_GBps']:.1f} GB/s measured copy bandwidth); "
          f"floor_cmp_ms = FLOPs at {mm['mm_TFLOPs']:.3f} TFLOP/s; ref/fast, ref/graph = speedup over the reference")
    if device.type != "cuda":
        print("# graph columns: n/a = CUDA graphs unavailable (no GPU in this run), not skipped silently")
    csv_path = rows.finish(out / f"{stem}.csv")
    print(f"# wrote {csv_path}")
    png = plot(rows, out / f"{stem}.png")
    if png:
        print(f"# wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

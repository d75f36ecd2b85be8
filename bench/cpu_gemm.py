"""CPU skinny GEMMs of SmolLM2-135M in fp32: candidates per projection shape and rows.

usage: python bench/cpu_gemm.py [--threads 2] [--rows 1,2,4,8,16] [--out bench/results] [--parts gemm,e2e]
       [--candidates F.linear,fp32_kernel,bf16_kernel]

gemm: every projection shape the runtime uses on SmolLM2 (merged QKV, o_proj, merged gate/up, down,
LM head, a 10k draft-vocab head) x rows. Each candidate's time per call is the median over rounds of
one pass over enough random weight copies to exceed --working-set-mb (weights come from DRAM, as in a
decode step that reads 540 MB), candidates interleaved within each round (the machine may be shared).
Each round also times a 256 MiB copy; floor = weight bytes / that copy's GB/s (read + write), median.
Candidates: F.linear; torch.mm with a pre-transposed weight; one GEMV per row; oneDNN-prepacked
(mkldnn._reorder_linear_weight + _linear_pointwise); MKL-packed (mkl._mkl_reorder_linear_weight +
_mkl_linear, what inductor emits for an fp32 linear under freezing); torch.compile with freezing of a
module holding all the copies; dflash_kernels.cpu.linear.linear with its AMX path (where the CPU has AMX-BF16) and
with its fp32 kernel (AMX and bf16-packed weights off: its route, F.linear outside 2-16 rows); the loaded fp32 kernel
called directly at every row count, on the fp32 weights and on their bf16-packed copies (cpu_linear.bf16_rows: the
same bits, half the bytes), and the same two of the AVX2 build. The weights are random values rounded to bf16
(as SmolLM2's are: the AMX path takes only such weights; the others do not care). Each is checked against fp64
with the 2x rule of tests/helpers/tol.py (ok column; err_x = its max error / F.linear's).

e2e: SmolLM2 fp32: HF generate's greedy per-token time ((64 new tokens - 1 new token) / 63, 30-token
prompt), and a forward of 1 and 8 new rows on a DynamicCache holding the prompt, with F.linear, with
every nn.Linear routed through dflash_kernels.cpu.linear.linear, and with every projection skipped (an empty
output: the time of everything else); B8/B1 for each.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # no compile workers competing for the cores

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, cpu_kernels, environment, fmt, out_dir, parse_ints, table, write_csv  # noqa: E402

sys.path.insert(0, str(ROOT / "tests"))  # the tests' helpers package
from helpers.tol import assert_within_rule  # noqa: E402

from dflash_kernels.cpu import linear as cpu_linear  # noqa: E402

H, I, V, HD = 576, 1536, 49152, 64
SHAPES = {  # name: (K, N)
    "qkv": (H, (9 + 3 + 3) * HD),
    "o_proj": (H, H),
    "gate_up": (H, 2 * I),
    "down": (I, H),
    "lm_head": (H, V),
    "draft_head_10k": (H, 10000),
}
COPY_BYTES = 256 * 2**20


class _Copies(torch.nn.ModuleList):
    """One bias-free Linear per weight copy; forward runs them all (what torch.compile compiles)."""

    def __init__(self, ws: list[torch.Tensor]):
        super().__init__(torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta") for w in ws)
        for lin, w in zip(self, ws):
            lin.weight = torch.nn.Parameter(w, requires_grad=False)  # shares the copy's memory

    def forward(self, x):
        return [lin(x) for lin in self]


def candidates(ws: list[torch.Tensor], x: torch.Tensor, with_compile: bool) -> dict:
    """name -> setup; setup() (untimed) returns a pass: a callable running all copies, returning the outputs."""
    m = x.shape[0]

    def per_copy(call):
        return lambda: [call(i) for i in range(len(ws))]

    def mm_pretransposed():
        wt = [w.t().contiguous() for w in ws]
        return per_copy(lambda i: torch.mm(x, wt[i]))

    def onednn():
        pw = [torch.ops.mkldnn._reorder_linear_weight(w, m) for w in ws]
        return per_copy(lambda i: torch.ops.mkldnn._linear_pointwise(x, pw[i], None, "none", [], ""))

    def mkl():
        pw = [torch.ops.mkl._mkl_reorder_linear_weight(w, m) for w in ws]
        return per_copy(lambda i: torch.ops.mkl._mkl_linear(x, pw[i], ws[i], None, m))

    def compiled():
        import torch._inductor.config as inductor_config

        torch._dynamo.reset()  # a fresh compile per shape and row count (no recompile limit)
        fn = torch.compile(_Copies(ws).eval())
        with inductor_config.patch(freezing=True):
            fn(x)
        return lambda: fn(x)

    def without_amx(run):
        def call():
            with cpu_kernels(amx=False, bf16=False):
                return run()
        return call

    def kernel_pass(isa: str | None, packed: bool):
        """The fp32 kernel of ``isa`` (None: the loaded one) called directly, on the fp32 weights or on their
        bf16-packed copies."""
        isa = isa or cpu_linear.isa()
        op = getattr(torch.ops.dflash_cpu, f"linear_{isa}_bf16" if packed else f"linear_{isa}")
        weights = [cpu_linear.bf16_rows(w) for w in ws] if packed else ws
        return per_copy(lambda i: cpu_linear._run(op, x, weights[i], None))

    def amx_pass():
        reason = cpu_linear.amx_unavailable_reason()
        if reason:
            raise RuntimeError(reason)
        return per_copy(lambda i: cpu_linear.linear(x, ws[i]))

    x1 = x[:1].clone()
    out = {
        "F.linear_1row": lambda: per_copy(lambda i: F.linear(x1, ws[i])),  # the GEMV reference, same rounds
        "F.linear": lambda: per_copy(lambda i: F.linear(x, ws[i])),
        "mm_pretransposed": mm_pretransposed,
        "gemv_per_row": lambda: per_copy(lambda i: torch.stack([torch.mv(ws[i], r) for r in x])),
        "onednn_packed": onednn,
        "mkl_packed": mkl,
        "compile_freezing": compiled,
        "dflash_cpu_linear_amx": amx_pass,
        "dflash_cpu_linear": lambda: without_amx(per_copy(lambda i: cpu_linear.linear(x, ws[i]))),
        "fp32_kernel": lambda: kernel_pass(None, False),
        "bf16_kernel": lambda: kernel_pass(None, True),
        "fp32_kernel_avx2": lambda: kernel_pass("avx2", False),
        "bf16_kernel_avx2": lambda: kernel_pass("avx2", True),
    }
    if not with_compile:
        del out["compile_freezing"]
    return out


@torch.no_grad()
def bench_shape(name: str, k: int, n: int, m: int, args) -> list[dict]:
    copies = max(2, -(-args.working_set_mb * 2**20 // (4 * k * n)))
    ws = [(torch.randn(n, k) * k**-0.5).bfloat16().float() for _ in range(copies)]
    x = torch.randn(m, k)
    ref = x.double() @ ws[0].double().T
    base = F.linear(x, ws[0])
    passes, rows = {}, {}
    wanted = args.candidates.split(",") if args.candidates else None
    for cname, setup in candidates(ws, x, args.compile).items():
        if wanted and cname not in wanted and cname != "F.linear_1row":
            continue
        t0 = time.perf_counter()
        try:
            passes[cname] = setup()
            y = passes[cname]()[0]
        except Exception as e:  # a candidate that cannot run still gets a row saying why
            passes.pop(cname, None)
            rows[cname] = {"note": f"unavailable: {type(e).__name__}: {str(e).splitlines()[0][:120]}"}
            continue
        if cname == "F.linear_1row":  # F.linear itself, on x[:1]
            rows[cname] = {"t": []}
            continue
        try:
            assert_within_rule(y, ref, base, f"{name} M={m} {cname}")
            ok = True
        except AssertionError:
            ok = False
        err = float((y.double() - ref).abs().max() / (base.double() - ref).abs().max().clamp_min(1e-30))
        rows[cname] = {"ok": ok, "err_x": err, "setup_s": time.perf_counter() - t0, "t": []}
    src = torch.randn(COPY_BYTES // 4)
    dst = torch.empty_like(src)
    gbps = []
    for run in passes.values():  # warm-up
        run()
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        dst.copy_(src)
        gbps.append(2 * COPY_BYTES / (time.perf_counter() - t0) / 1e9)
        for cname, run in passes.items():
            t0 = time.perf_counter()
            run()
            rows[cname]["t"].append((time.perf_counter() - t0) * 1e3 / copies)
    bw = statistics.median(gbps)
    floor_ms = 4 * k * n / (bw * 1e9) * 1e3
    out = []
    for cname, r in rows.items():
        t = sorted(r.pop("t", []))
        row = {"shape": name, "K": k, "N": n, "rows": m, "candidate": cname, "copies": copies,
               "copy_GBps": bw, "floor_ms": floor_ms, **r}
        if t:
            row.update(median_ms=statistics.median(t), p10_ms=t[len(t) // 10], p90_ms=t[(9 * len(t)) // 10],
                       min_ms=t[0], x_floor=statistics.median(t) / floor_ms)
        out.append(row)
    del ws, passes, src, dst
    _release_memory()
    return out


def _release_memory() -> None:
    """Free the last shape's weight copies: inductor keeps each compiled module (with its frozen, packed
    weights) in sys.modules, and glibc keeps freed heap; without this the sweep runs out of memory."""
    from torch._inductor.codecache import PyCodeCache

    torch.compiler.reset()
    PyCodeCache.cache_clear()
    for name in [n for n in sys.modules if n.startswith("torch._inductor.runtime.compile_tasks.")]:
        del sys.modules[name]
    gc.collect()
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def gemm_markdown(rows: list[dict], cands: list[str]) -> str:
    """One line per shape and row count: each candidate's median ms (x floor); the fastest passing one in
    bold, and its time over the 1-row F.linear's of the same rounds (GEMV per weight byte = 1)."""
    cands = [c for c in cands if c != "F.linear_1row"]
    lines = ["| shape | K -> N | rows | floor ms | 1-row F.linear | " + " | ".join(cands) + " | best / 1-row |",
             "|---|---|---:|---:|---:|" + "---:|" * (len(cands) + 1)]
    keys = sorted({(r["shape"], r["rows"]) for r in rows}, key=lambda s: (list(SHAPES).index(s[0]), s[1]))
    for shape, m in keys:
        sel = {r["candidate"]: r for r in rows if r["shape"] == shape and r["rows"] == m}
        ref = sel["F.linear_1row"]
        timed = [c for c in cands if "median_ms" in sel.get(c, {})]
        best = min((c for c in timed if sel[c]["ok"]), key=lambda c: sel[c]["median_ms"], default=None)
        cells = []
        for c in cands:
            r = sel.get(c)
            if c not in timed:
                cells.append("n/a")
                continue
            cell = f"{fmt(r['median_ms'])} ({r['x_floor']:.2f}x)" + ("" if r["ok"] else " FAIL")
            cells.append(f"**{cell}**" if c == best else cell)
        ratio = f"{sel[best]['median_ms'] / ref['median_ms']:.2f}" if best else "n/a"
        lines.append(f"| {shape} | {ref['K']} -> {ref['N']} | {m} | {fmt(ref['floor_ms'])} | "
                     f"{fmt(ref['median_ms'])} ({ref['x_floor']:.2f}x) | " + " | ".join(cells) + f" | {ratio} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------- e2e
def _no_linear(x, weight, bias):
    return x.new_empty(x.shape[:-1] + weight.shape[:1])


@contextlib.contextmanager
def routed_linears(model, linear=cpu_linear.linear):
    """Every nn.Linear of ``model`` calls ``linear(x, weight, bias)`` while inside."""
    mods = [mod for mod in model.modules() if isinstance(mod, torch.nn.Linear)]
    for mod in mods:
        mod.forward = lambda inp, mod=mod: linear(inp, mod.weight, mod.bias)
    try:
        yield
    finally:
        for mod in mods:
            del mod.forward


def bench_e2e(args) -> list[dict]:
    from transformers import DynamicCache

    from dflash_apps.smollm2 import load

    model, tok = load()
    text = ("Once upon a time, in a small village by the sea, there lived an old clockmaker who repaired "
            "every clock in town except his own, which had stopped many years before.")
    ids = tok(text, return_tensors="pt").input_ids[:, :30]
    plen = ids.shape[1]
    new = torch.randint(100, 40000, (1, 8))
    gen = dict(do_sample=False, pad_token_id=tok.eos_token_id)
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        model(input_ids=ids, past_key_values=cache, use_cache=True)

        def step(q: int, linear=None):
            try:
                with routed_linears(model, linear) if linear else contextlib.nullcontext():
                    return model(input_ids=new[:, :q], past_key_values=cache, use_cache=True).logits
            finally:
                cache.crop(-q)  # back to the prompt

        logits_ref, logits_new = step(8), step(8, cpu_linear.linear)
        diff = float((logits_ref - logits_new).abs().max())
        same_argmax = bool((logits_ref.argmax(-1) == logits_new.argmax(-1)).all())
        variants = {
            "generate_64": lambda: model.generate(ids, max_new_tokens=64, min_new_tokens=64, **gen),
            "generate_1": lambda: model.generate(ids, max_new_tokens=1, **gen),
            "forward_B1_F.linear": lambda: step(1),
            "forward_B8_F.linear": lambda: step(8),
            "forward_B1_cpu_linear": lambda: step(1, cpu_linear.linear),
            "forward_B8_cpu_linear": lambda: step(8, cpu_linear.linear),
            "forward_B1_no_linear": lambda: step(1, _no_linear),  # everything but the projections
            "forward_B8_no_linear": lambda: step(8, _no_linear),
        }
        for fn in variants.values():
            fn()
        times = {v: [] for v in variants}
        for r in range(args.e2e_rounds):
            for v, fn in variants.items():
                if v.startswith("generate") and r >= args.generate_rounds:
                    continue
                t0 = time.perf_counter()
                fn()
                times[v].append((time.perf_counter() - t0) * 1e3)
    med = {v: statistics.median(t) for v, t in times.items()}
    rows = [{"what": v, "median_ms": med[v], "min_ms": min(t), "reps": len(t)} for v, t in times.items()]
    rows.append({"what": "generate_per_token (64-1)/63", "median_ms": (med["generate_64"] - med["generate_1"]) / 63})
    rows.append({"what": "B8/B1 F.linear", "ratio": med["forward_B8_F.linear"] / med["forward_B1_F.linear"]})
    rows.append({"what": "B8/B1 cpu_linear", "ratio": med["forward_B8_cpu_linear"] / med["forward_B1_cpu_linear"]})
    rows.append({"what": "B8 cpu_linear / B1 F.linear",
                 "ratio": med["forward_B8_cpu_linear"] / med["forward_B1_F.linear"],
                 "note": "B1 is F.linear on both paths (1 row)"})
    rows.append({"what": "projections only: B8 cpu_linear / B1 F.linear",
                 "ratio": (med["forward_B8_cpu_linear"] - med["forward_B8_no_linear"])
                 / (med["forward_B1_F.linear"] - med["forward_B1_no_linear"]),
                 "note": "forward minus forward_no_linear"})
    rows.append({"what": "B8 logits max |cpu_linear - F.linear|", "ratio": diff, "note": f"argmax equal: {same_argmax}"})
    for r in rows:
        r["prompt_tokens"] = plen
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", default="1,2,4,8,16")
    p.add_argument("--out", default=None)
    p.add_argument("--parts", default="gemm,e2e", help="comma list of gemm, e2e")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--working-set-mb", type=int, default=400)
    p.add_argument("--rounds", type=int, default=21)
    p.add_argument("--no-compile", dest="compile", action="store_false", help="skip the torch.compile candidate")
    p.add_argument("--candidates", default=None, help="comma list of the candidates to run (default: all)")
    p.add_argument("--e2e-rounds", type=int, default=30)
    p.add_argument("--generate-rounds", type=int, default=7)
    p.add_argument("--tag", default=None, help="file name stem (default <date>-cpu-gemm)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    parts = set(args.parts.split(","))
    env = environment(torch.device("cpu"))
    stem = args.tag or f"{time.strftime('%Y-%m-%d')}-cpu-gemm"
    dest = out_dir(args.out)
    md = [f"# CPU skinny GEMMs, SmolLM2-135M shapes, fp32, {args.threads} threads",
          "", f"{env['hardware']} | torch {env['torch']} | commit {env['commit']} | {env['date']}",
          f"cpu_linear: {cpu_linear.unavailable_reason() or 'kernel built'}", ""]
    print("\n".join(md), flush=True)
    if "gemm" in parts:
        rows = []
        for shape in args.shapes.split(","):
            k, n = SHAPES[shape]
            for m in parse_ints(args.rows):
                new = bench_shape(shape, k, n, m, args)
                rows += new
                print(table(new, ["shape", "rows", "candidate", "median_ms", "x_floor", "min_ms", "ok", "err_x",
                                  "note"]), flush=True)
        write_csv(dest / f"{stem}.csv", rows, env)
        cands = list(dict.fromkeys(r["candidate"] for r in rows))
        md += ["## Time per call: median ms (x the weight-streaming floor); bold = fastest passing", "",
               f"Floor = weight bytes / the GB/s of a 256 MiB copy timed in the same rounds "
               f"(median {fmt(statistics.median(r['copy_GBps'] for r in rows))} GB/s read+write). "
               f"Working set >= {args.working_set_mb} MB of weight copies per pass, {args.rounds} rounds, "
               "candidates interleaved. FAIL = outside the 2x-of-F.linear error rule.", "",
               gemm_markdown(rows, cands), ""]
    if "e2e" in parts:
        rows = bench_e2e(args)
        write_csv(dest / f"{stem}-e2e.csv", rows, env)
        print(table(rows, ["what", "median_ms", "min_ms", "reps", "ratio", "note"]), flush=True)
        md += ["## End to end: SmolLM2-135M fp32 on a DynamicCache", "",
               table(rows, ["what", "median_ms", "min_ms", "reps", "ratio", "note"], markdown=True), ""]
    (dest / f"{stem}.md").write_text("\n".join(md))
    print(f"# wrote {dest / stem}.*")


if __name__ == "__main__":
    main()

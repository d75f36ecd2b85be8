"""Each dflash_kernels op vs its PyTorch reference over shapes: median latency, GB/s, % of the copy
bandwidth measured in the same run, speedup over the torch backend.

Backends per op: torch (the reference, the op's definition), triton (GPU only: on CPU the Triton
interpreter runs kernels element by element in Python, so its timings say nothing about the
kernel and are not taken), ext (the compiled C++/CUDA op, for verify_greedy and commit_round);
gate_up_silu also times "unfused", the two launches it replaces (``F.linear`` = cuBLAS into
[N, 2I], then the Triton ``silu_mul``), GPU only like triton.
A backend that cannot run is listed with the reason, never skipped silently.

Bytes counted per call = each input read once + each output written once (the floor; for the
attention ops the live context K/V, and verify_attention's block K/V rows written; the fp32 split
partials of the README's cost contract, ~13 % of the K/V bytes at the Qwen3-8B tile, are not counted);
GB/s = bytes / median time; %copy = GB/s / measured copy bandwidth (read + write bytes of a large copy).
In-place ops are timed on inputs they keep valid: inject_context_kv and verify_attention rewrite the
same cache rows with the same values and never read the rows they write; add_rms_norm's residual
grows by x per call (the timing does not depend on the values); commit_round's state is restored
before each call. compare() runs the reference and the backend on the same snapshot.
Input sets are rotated so that the working set exceeds 4x L2 (GPU) and repeated calls do not read
from cache; on GPU each call is timed with CUDA events, and ops that can be captured are also
timed as CUDA-graph replays (launch overhead excluded as in the decode loop).

Usage: python bench/kernels.py [--ops fused_context,...] [--size real|small|tiny] [--out DIR]
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import dflash_kernels as dk  # noqa: E402
from dflash_kernels._dispatch import backend_status  # noqa: E402
from dflash.graphs import capture  # noqa: E402

OPS = ("fused_context", "inject_context_kv", "draft_attention", "verify_attention", "add_rms_norm", "silu_mul",
       "gate_up_silu", "verify_greedy", "verify_sample", "commit_round")
BACKENDS = {
    "fused_context": ("torch", "triton"),
    "inject_context_kv": ("torch", "triton"),
    "draft_attention": ("torch", "triton"),
    "verify_attention": ("torch", "triton"),
    "add_rms_norm": ("torch", "triton"),
    "silu_mul": ("torch", "triton"),
    "gate_up_silu": ("torch", "unfused", "triton"),
    "verify_greedy": ("torch", "triton", "ext"),
    "verify_sample": ("torch", "triton"),
    "commit_round": ("torch", "ext"),
}
SIZES = {  # hidden, taps, draft layers, heads, kv heads, head dim, vocab, intermediate
    "real": dict(H=4096, T=5, L=5, nH=32, kvH=8, D=128, V=151936, I=12288),  # Qwen3-8B(-DFlash-b16)
    "small": dict(H=512, T=5, L=5, nH=8, kvH=2, D=64, V=16384, I=1536),      # CPU stand-in (draft_latency cpu-small)
    "tiny": dict(H=64, T=2, L=2, nH=4, kvH=2, D=16, V=512, I=128),           # smoke test
}
# per op: list of shape dicts; rows = batch * block
SWEEPS = {
    "real": {
        "fused_context": [dict(N=16), dict(N=64), dict(N=256)],
        "inject_context_kv": [dict(R=1, B=16), dict(R=4, B=16), dict(R=16, B=16)],
        "draft_attention": [dict(R=1, B=16, ctx=2048), dict(R=1, B=16, ctx=32768), dict(R=4, B=16, ctx=8192),
                            dict(R=16, B=16, ctx=8192)],
        "verify_attention": [dict(R=1, B=16, ctx=2048), dict(R=8, B=16, ctx=2048), dict(R=1, B=16, ctx=32768),
                             dict(R=8, B=16, ctx=32768)],  # one target layer of the verify step
        "add_rms_norm": [dict(N=16), dict(N=128)],
        "silu_mul": [dict(N=16), dict(N=128)],
        "gate_up_silu": [dict(N=16), dict(N=128)],  # decode rows at batch 1 and 8 (block 16)
        "verify_greedy": [dict(R=1, B=16), dict(R=4, B=16), dict(R=16, B=16)],
        "verify_sample": [dict(R=1, B=16, filt=False), dict(R=16, B=16, filt=False), dict(R=16, B=16, filt=True)],
        "commit_round": [dict(R=1, B=16), dict(R=16, B=16), dict(R=64, B=16)],
    },
    "small": {
        "fused_context": [dict(N=16), dict(N=64)],
        "inject_context_kv": [dict(R=1, B=16), dict(R=4, B=16)],
        "draft_attention": [dict(R=1, B=16, ctx=512), dict(R=1, B=16, ctx=2048), dict(R=4, B=16, ctx=2048)],
        "verify_attention": [dict(R=1, B=16, ctx=512), dict(R=4, B=16, ctx=2048)],
        "add_rms_norm": [dict(N=16), dict(N=128)],
        "silu_mul": [dict(N=16), dict(N=128)],
        "gate_up_silu": [dict(N=16), dict(N=128)],
        "verify_greedy": [dict(R=1, B=16), dict(R=4, B=16), dict(R=16, B=16)],
        "verify_sample": [dict(R=1, B=16, filt=False), dict(R=4, B=16, filt=True)],
        "commit_round": [dict(R=1, B=16), dict(R=16, B=16), dict(R=64, B=16)],
    },
    "tiny": {
        "fused_context": [dict(N=8)],
        "inject_context_kv": [dict(R=1, B=4)],
        "draft_attention": [dict(R=1, B=4, ctx=32)],
        "verify_attention": [dict(R=2, B=4, ctx=32)],
        "add_rms_norm": [dict(N=8)],
        "silu_mul": [dict(N=8)],
        "gate_up_silu": [dict(N=8)],
        "verify_greedy": [dict(R=2, B=4)],
        "verify_sample": [dict(R=2, B=4, filt=True)],
        "commit_round": [dict(R=4, B=4)],
    },
}


def _inv_freq(d: int) -> torch.Tensor:
    return 1.0 / (1e6 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))


class Case:
    """One op at one shape: builds random input sets, runs a backend, counts bytes."""

    def __init__(self, op: str, shape: dict, dims: dict, device: torch.device, dtype: torch.dtype):
        self.op, self.shape, self.dims, self.device, self.dtype = op, shape, dims, device, dtype
        self.elem = torch.tensor([], dtype=dtype).element_size()
        self.nbytes = getattr(self, f"_bytes_{op}")()

    def label(self) -> str:
        return " ".join(f"{k}={'T' if v is True else 'F' if v is False else v}" for k, v in self.shape.items())

    def rnd(self, *shape, scale=1.0):
        return (torch.randn(*shape, device=self.device) * scale).to(self.dtype)

    # -------------------------------------------------------------------------------- bytes
    def _bytes_fused_context(self):
        d, e = self.dims, self.elem
        N, H, T = self.shape["N"], d["H"], d["T"]
        return (N * T * H + T * H * H + H + N * H) * e

    def _bytes_inject_context_kv(self):  # one layer: projected K/V rows read, written into the cache
        d, e = self.dims, self.elem
        M = self.shape["R"] * self.shape["B"]
        return (4 * M * d["kvH"] * d["D"] + d["D"]) * e

    def _bytes_draft_attention(self):
        d, e, s = self.dims, self.elem, self.shape
        R, B, ctx = s["R"], s["B"], s["ctx"]
        return (2 * R * B * d["nH"] * d["D"] + 2 * R * B * d["kvH"] * d["D"] + 2 * R * ctx * d["kvH"] * d["D"]) * e

    def _bytes_verify_attention(self):  # + the block's K and V rows written
        s, d = self.shape, self.dims
        return self._bytes_draft_attention() + 2 * s["R"] * s["B"] * d["kvH"] * d["D"] * self.elem

    def _bytes_add_rms_norm(self):  # x and the residual read, out and the residual written, the weight read
        H = self.dims["H"]
        return (4 * self.shape["N"] * H + H) * self.elem

    def _bytes_silu_mul(self):  # [N, 2I] read, [N, I] written
        return 3 * self.shape["N"] * self.dims["I"] * self.elem

    def _bytes_gate_up_silu(self):  # x [N, H] and the merged weight [2I, H] read, [N, I] written
        N, H, I = self.shape["N"], self.dims["H"], self.dims["I"]
        return (N * H + 2 * I * H + N * I) * self.elem

    def _bytes_verify_greedy(self):
        s = self.shape
        return s["R"] * s["B"] * self.dims["V"] * self.elem + s["R"] * (s["B"] - 1) * 8 + 2 * s["R"] * 8

    _bytes_verify_sample = _bytes_verify_greedy

    def _bytes_commit_round(self):
        R, B = self.shape["R"], self.shape["B"]
        return R * (B - 1) * 8 + 2 * R * 8 + R * B * 8 + 2 * 5 * R * 8  # drafts, acc+bonus, tokens, state r/w

    # -------------------------------------------------------------------------------- inputs
    def make(self) -> dict:
        return getattr(self, f"_make_{self.op}")()

    def _make_fused_context(self):
        d = self.dims
        N, H, T = self.shape["N"], d["H"], d["T"]
        return dict(taps=self.rnd(N, T * H), w=self.rnd(H, T * H, scale=(T * H) ** -0.5),
                    nw=(1 + 0.1 * torch.randn(H, device=self.device)).to(self.dtype))

    def _make_inject_context_kv(self):
        d = self.dims
        R, B = self.shape["R"], self.shape["B"]
        kvH, D = d["kvH"], d["D"]
        cap = 4 * B + 64
        lens = torch.randint(0, cap - B, (R,), device=self.device)
        return dict(k=self.rnd(R * B, kvH, D), v=self.rnd(R * B, kvH, D),
                    knw=(1 + 0.1 * torch.randn(D, device=self.device)).to(self.dtype),
                    cu=torch.arange(R + 1, device=self.device) * B, lens=lens,
                    kc=self.rnd(R, cap, kvH, D), vc=self.rnd(R, cap, kvH, D), inv=_inv_freq(D).to(self.device))

    def _make_draft_attention(self):
        d, s = self.dims, self.shape
        R, B, ctx = s["R"], s["B"], s["ctx"]
        nH, kvH, D = d["nH"], d["kvH"], d["D"]
        return dict(q=self.rnd(R, B, nH, D), k=self.rnd(R, B, kvH, D), v=self.rnd(R, B, kvH, D),
                    kc=self.rnd(R, ctx + B, kvH, D), vc=self.rnd(R, ctx + B, kvH, D),
                    lens=torch.full((R,), ctx, device=self.device, dtype=torch.long),
                    qw=(1 + 0.1 * torch.randn(D, device=self.device)).to(self.dtype),
                    kw=(1 + 0.1 * torch.randn(D, device=self.device)).to(self.dtype),
                    inv=_inv_freq(D).to(self.device))

    _make_verify_attention = _make_draft_attention

    def _make_add_rms_norm(self):
        N, H = self.shape["N"], self.dims["H"]
        return dict(x=self.rnd(N, H), res=self.rnd(N, H), w=(1 + 0.1 * torch.randn(H, device=self.device)).to(self.dtype))

    def _make_silu_mul(self):
        return dict(gu=self.rnd(self.shape["N"], 2 * self.dims["I"]))

    def _make_gate_up_silu(self):
        H, I = self.dims["H"], self.dims["I"]
        return dict(x=self.rnd(self.shape["N"], H), w=self.rnd(2 * I, H, scale=H ** -0.5))

    def _logits_and_drafts(self):
        R, B, V = self.shape["R"], self.shape["B"], self.dims["V"]
        logits = self.rnd(R, B, V, scale=3.0)
        drafts = logits.argmax(-1)[:, :-1].clone()
        # realistic acceptance: corrupt each request's drafts after a random prefix
        cut = torch.randint(0, B, (R,), device=self.device)
        cols = torch.arange(B - 1, device=self.device)
        drafts = torch.where(cols[None] >= cut[:, None], (drafts + 1) % V, drafts)
        return logits, drafts.contiguous()

    def _make_verify_greedy(self):
        logits, drafts = self._logits_and_drafts()
        return dict(logits=logits, drafts=drafts)

    def _make_verify_sample(self):
        logits, drafts = self._logits_and_drafts()
        return dict(logits=logits, drafts=drafts, seed=torch.tensor([7], device=self.device),
                    offset=torch.tensor([0], device=self.device))

    def _make_commit_round(self):
        R, B = self.shape["R"], self.shape["B"]
        cap = 4096
        dev = self.device
        lengths = torch.randint(1, cap // 2, (R,), device=dev)
        st = dict(drafts=torch.randint(0, 1000, (R, B - 1), device=dev),
                  acc=torch.randint(0, B, (R,), device=dev), bonus=torch.randint(0, 1000, (R,), device=dev),
                  out_tokens=torch.randint(0, 1000, (R, cap), device=dev), lengths=lengths,
                  positions=lengths - 1, anchor=torch.randint(0, 1000, (R,), device=dev),
                  done=torch.zeros(R, dtype=torch.bool, device=dev),
                  max_lengths=torch.full((R,), cap, device=dev), stop_tokens=torch.tensor([1001, 1002], device=dev))
        st["pristine"] = {k: st[k].clone() for k in ("out_tokens", "lengths", "positions", "anchor", "done")}
        return st

    def restore(self, x: dict) -> None:
        if self.op == "commit_round":
            for k, v in x["pristine"].items():
                x[k].copy_(v)

    # -------------------------------------------------------------------------------- call
    def call(self, x: dict, backend: str):
        if self.op == "fused_context":
            return dk.fused_context(x["taps"], x["w"], x["nw"], 1e-6, backend=backend)
        if self.op == "inject_context_kv":
            dk.inject_context_kv(x["k"], x["v"], x["knw"], x["cu"], x["lens"], x["kc"], x["vc"], inv_freq=x["inv"],
                                 backend=backend)
            return x["kc"], x["vc"]
        if self.op == "draft_attention":
            return dk.draft_attention(x["q"], x["k"], x["v"], x["kc"], x["vc"], x["lens"], x["qw"], x["kw"],
                                      inv_freq=x["inv"], max_context_len=self.shape["ctx"] + self.shape["B"],
                                      backend=backend)
        if self.op == "verify_attention":  # the output and the block rows it wrote
            ctx = self.shape["ctx"]
            out = dk.verify_attention(x["q"], x["k"], x["v"], x["kc"], x["vc"], x["lens"], x["qw"], x["kw"],
                                      inv_freq=x["inv"], max_context_len=ctx, backend=backend)
            return out, x["kc"][:, ctx:], x["vc"][:, ctx:]
        if self.op == "add_rms_norm":
            return dk.add_rms_norm(x["x"], x["w"], 1e-6, residual=x["res"], backend=backend), x["res"]
        if self.op == "silu_mul":
            return dk.silu_mul(x["gu"], backend=backend)
        if self.op == "gate_up_silu":
            if backend == "unfused":  # what the steps ran before: cuBLAS GEMM into [N, 2I], then silu_mul's kernel
                return dk.silu_mul(F.linear(x["x"], x["w"]), backend="triton")
            return dk.gate_up_silu(x["x"], x["w"], backend=backend)
        if self.op == "verify_greedy":
            return dk.verify_greedy(x["logits"], x["drafts"], backend=backend)
        if self.op == "verify_sample":
            filt = self.shape["filt"]
            return dk.verify_sample(x["logits"], x["drafts"], temperature=1.0, top_k=50 if filt else 0,
                                    top_p=0.9 if filt else 1.0, seed=x["seed"], offset=x["offset"], backend=backend)
        if self.op == "commit_round":
            return dk.commit_round(x["drafts"], x["acc"], x["bonus"], out_tokens=x["out_tokens"], lengths=x["lengths"],
                                   positions=x["positions"], anchor=x["anchor"], done=x["done"],
                                   max_lengths=x["max_lengths"], stop_tokens=x["stop_tokens"], backend=backend,
                                   check=False)
        raise ValueError(self.op)


def _flat(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for t in out if isinstance(t, torch.Tensor)]


def compare(case: Case, x: dict, backend: str) -> str:
    """Agreement with the torch backend on one input set (exact for integer outputs)."""
    if case.op == "verify_sample":
        return "stochastic (streams differ)"
    case.restore(x)
    snap = {k: v.clone() for k, v in x.items() if isinstance(v, torch.Tensor)}
    ref = [t.clone() for t in _flat(case.call(x, "torch"))]
    if case.op == "commit_round":
        ref += [x[k].clone() for k in ("out_tokens", "lengths", "positions", "anchor", "done")]
    for k, v in snap.items():
        x[k].copy_(v)
    case.restore(x)
    out = [t.clone() for t in _flat(case.call(x, backend))]
    if case.op == "commit_round":
        out += [x[k].clone() for k in ("out_tokens", "lengths", "positions", "anchor", "done")]
    for k, v in snap.items():
        x[k].copy_(v)
    worst = 0.0
    for a, b in zip(out, ref):
        if not a.dtype.is_floating_point:
            if not torch.equal(a, b):
                return "MISMATCH"
            continue
        worst = max(worst, float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)))
    return "equal" if worst == 0.0 else f"rel {worst:.1e}"


def run(args, rows: common.RowLog):
    """Time every op at every shape and backend; each row goes to ``rows`` as it is measured."""
    device = common.pick_device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    size = args.size or ("real" if device.type == "cuda" else "small")
    dims = SIZES[size]
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[
        args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    ops = args.ops.split(",") if args.ops else list(OPS)
    bw = common.copy_bandwidth(device)
    l2 = common.l2_bytes(device)
    working = 4 * l2 if l2 else 32 * 2**20  # CPU: beyond a typical last-level cache
    env = common.print_header("kernels vs torch references", device, {
        "shapes": f"{size}: {dims}, dtype {str(dtype)[6:]}",
        "floor": f"bytes (inputs read once + outputs written once) / {bw['copy_GBps']:.1f} GB/s measured copy "
                 f"bandwidth ({bw['copy_bytes'] / 2**20:.0f} MiB, read+write)",
    })
    rows.env = {**env, **bw}
    status = {b: backend_status(b, device) for b in ("torch", "triton", "ext")}
    status["unfused"] = status["triton"]  # F.linear + the Triton silu_mul kernel
    for b, (ok, why) in status.items():
        print(f"# backend {b}: {'available' if ok else 'UNAVAILABLE'} ({why})")
    if device.type == "cpu":
        print("# triton on CPU: not timed: TRITON_INTERPRET runs kernels in a Python interpreter, its timings are "
              "meaningless for the GPU kernel; rows say 'not timed on CPU'")
    graphs = device.type == "cuda" and not args.no_graphs
    with torch.inference_mode():
        for op in ops:
            for shape in SWEEPS[size][op]:
                case = Case(op, shape, dims, device, dtype)
                nsets = max(1, min(8, math.ceil(working / max(case.nbytes, 1))))
                sets = [case.make() for _ in range(nsets)]
                idx = [0]

                def before():
                    idx[0] = (idx[0] + 1) % nsets
                    case.restore(sets[idx[0]])

                base = dict(op=op, shape=case.label(), dtype=str(dtype)[6:], MB=case.nbytes / 1e6, input_sets=nsets)
                torch_ms = torch_graph = None
                for backend in BACKENDS[op]:
                    ok, why = status[backend]
                    if backend in ("triton", "unfused") and device.type == "cpu":
                        rows.append({**base, "backend": backend, "status": "not timed on CPU (interpreter)"})
                        continue
                    if not ok:
                        rows.append({**base, "backend": backend, "status": f"unavailable: {why}"})
                        continue
                    try:
                        check = compare(case, sets[0], backend) if backend != "torch" else "reference"
                        t = common.time_fn(lambda: case.call(sets[idx[0]], backend), device, warmup=args.warmup,
                                           reps=args.reps, budget_s=args.budget, before=before)
                    except Exception as exc:  # report and keep going
                        rows.append({**base, "backend": backend, "status": f"failed: {type(exc).__name__}: "
                                                                          f"{str(exc)[:120]}"})
                        continue
                    med = t["median_ms"]
                    row = {**base, "backend": backend, "status": "ok", "check": check, "median_us": med * 1e3,
                           "p10_us": t["p10_ms"] * 1e3, "p90_us": t["p90_ms"] * 1e3, "reps": t["reps"],
                           "GBps": case.nbytes / (med * 1e-3) / 1e9}
                    row["pct_copy"] = 100 * row["GBps"] / bw["copy_GBps"]
                    if backend == "torch":
                        torch_ms = med
                    row["speedup_vs_torch"] = torch_ms / med if torch_ms else float("nan")
                    if graphs:
                        row.update(graph_timing(case, sets, backend, device, args))
                        if backend == "torch":
                            torch_graph = row.get("graph_us")
                        if torch_graph and row.get("graph_us"):
                            row["graph_speedup_vs_torch"] = torch_graph / row["graph_us"]
                    rows.append(row)
                    print(f"{op:18s} {case.label():24s} {backend:6s} {med * 1e3:10.1f} us  {row['GBps']:8.1f} GB/s "
                          f"{row['pct_copy']:5.1f}% copy  x{row['speedup_vs_torch']:.2f} vs torch  [{check}]"
                          + (f"  graph {row['graph_us']:.1f} us" if row.get("graph_us") else ""), flush=True)
                del sets
    return rows, env, bw, size


HOST_READS = {  # torch references that read device values on the host: a CUDA graph cannot hold them
    ("inject_context_kv", "torch"): "reference reads cu_ctx_lens/cache_lens on the host",
    ("draft_attention", "torch"): "reference reads cache_lens on the host",
    ("verify_attention", "torch"): "reference reads cache_lens on the host",
    ("verify_sample", "torch"): "reference reads seed/offset on the host",
}


def graph_timing(case: Case, sets: list[dict], backend: str, device, args) -> dict:
    """Median CUDA-graph replay time, one graph per input set, replays rotated over the sets.
    Mutating ops (commit_round) restore their state inside the graph: the time includes those copies."""
    if (case.op, backend) in HOST_READS:
        return {"graph": f"not capturable: {HOST_READS[(case.op, backend)]}"}
    try:
        fns = []
        for x in sets:
            def fn(x=x):
                case.restore(x)
                case.call(x, backend)
            fns.append(fn)
        gs = [capture(f, "cuda") for f in fns]
    except Exception as exc:
        torch.cuda.synchronize()
        return {"graph": f"not capturable: {type(exc).__name__}: {str(exc)[:80]}"}
    i = [0]

    def before():
        i[0] = (i[0] + 1) % len(gs)

    t = common.time_fn(lambda: gs[i[0]].replay(), device, warmup=args.warmup, reps=args.reps, budget_s=args.budget,
                       before=before)
    us = t["median_ms"] * 1e3
    return {"graph_us": us, "graph_GBps": case.nbytes / (us * 1e-6) / 1e9,
            "graph": "incl. state restore" if case.op == "commit_round" else "ok"}


COLUMNS = ["op", "shape", "backend", "status", "median_us", "GBps", "pct_copy", "speedup_vs_torch", "graph_us",
           "graph_speedup_vs_torch", "check"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="auto")
    p.add_argument("--ops", help=f"comma list of {OPS}")
    p.add_argument("--size", choices=sorted(SIZES), help="default real on GPU, small on CPU")
    p.add_argument("--dtype", choices=["bf16", "fp32", "fp16"], help="default bf16 on GPU, fp32 on CPU")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=100)
    p.add_argument("--budget", type=float, default=0.5)
    p.add_argument("--no-graphs", action="store_true", help="GPU: skip the CUDA-graph replay timing")
    p.add_argument("--out")
    p.add_argument("--tag")
    args = p.parse_args(argv)
    device = common.pick_device(args.device)
    out = common.out_dir(args.out)
    stem = args.tag or f"kernels-{device.type}"
    rows, env, bw, size = run(args, common.RowLog(out / f"{stem}.partial.csv"))
    cols = [c for c in COLUMNS if any(c in r for r in rows)]
    print()
    print(common.table(rows, cols))
    print(f"# %copy = achieved GB/s over the measured copy bandwidth {bw['copy_GBps']:.1f} GB/s")
    path = rows.finish(out / f"{stem}.csv")
    print(f"# wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

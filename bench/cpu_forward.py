"""Where one SmolLM2 target forward's time goes on the CPU: the lean forward at 1 / 8 / 16 rows, whole and
with one part replaced by a stand-in, with the native CPU kernels on and off and ``cpu_linear``'s AMX path on and
off, in one run.

The forward is ``dflash.lean_target.LeanTarget`` on the "cpu" kernel backend (the verify step's and our
autoregressive step's target pass) through its ops (its native forward off: it would bypass the stand-ins), at 200
cached tokens. A part's cost is the whole forward's time minus the time
of the same forward with that part replaced by a stand-in that returns a precomputed tensor of the right shape (the
projections incl. the LM head: ``cpu_linear``; the attention: ``verify_attention``; the residual-add + RMSNorm
calls: ``add_rms_norm``, which still does the residual add). The parts interact (a forward without its weight
streaming keeps the KV cache in L3, for one), so their costs need not add up to the whole; "without projections"
is everything else measured directly. The configurations run interleaved, rep by rep; each cell is a median over
reps (a shared machine's speed can drift by 10-20 %: a difference under ~2 ms is noise).

native_forward: the whole forward as decoding runs it (the lean target's native forward, one C++ call for its layers,
where it applies), next to the op path's whole. The bf16-packed setting is the fp32 GEMM reading SmolLM2's
bf16-exact weights from their bf16 copies (``cpu_linear.bf16_rows``: the same bits).

Floor: the bytes of the weights a forward reads (every projection and the LM head: fp32, or bf16 on the AMX path and
the bf16-packed one) over the read bandwidth measured here (``torch.dot`` of a 1 GiB vector with itself, larger than the L3, 2
threads) - the time the projections cannot beat.

Usage: python bench/cpu_forward.py [--rows 1,8,16] [--reps 25] [--threads 2] [--read-mib 1024] [--out FILE.md]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

import torch  # noqa: E402

CONTEXT = 200


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,8,16")
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--read-mib", type=int, default=1024,
                    help="size of the vector read for the bandwidth floor (default 1024: past this machine's L3)")
    ap.add_argument("--out", default=None, help="also write the markdown table here")
    args = ap.parse_args(argv)

    from dflash import lean_target
    from dflash_apps import smollm2

    from dflash_kernels.cpu import linear as cpu_linear
    from dflash_kernels.cpu import native as cpu_native

    if common.smollm2_unavailable("cpu_forward.py"):
        return 1
    if cpu_native.ENV in os.environ:
        raise SystemExit(f"bench/cpu_forward.py: unset {cpu_native.ENV} (the run compares both settings)")
    torch.set_num_threads(args.threads)
    target, _ = smollm2.load(verbose=False)
    lt = lean_target.LeanTarget(target, [1, 27], batch=1, capacity=CONTEXT + 64, backend="cpu")
    real = {"linear": lt.linear, "attention": lean_target.verify_attention, "norm": lean_target.add_rms_norm}
    outputs: dict = {}

    def fake_linear(x, w, b=None):
        n = w.out_features if hasattr(w, "out_features") else w.shape[0]
        key = (tuple(x.shape), n)
        if key not in outputs:
            outputs[key] = torch.randn(*x.shape[:-1], n) * 0.1
        return outputs[key]

    def fake_attention(q, *args, **kwargs):
        key = ("attention", tuple(q.shape))
        if key not in outputs:
            outputs[key] = torch.randn(q.shape) * 0.1
        return outputs[key]

    def fake_norm(x, weight, eps=1e-6, *, residual=None, **kwargs):
        if residual is not None:
            residual.add_(x)
        key = ("norm", tuple(x.shape))
        if key not in outputs:
            outputs[key] = torch.randn(x.shape)
        return outputs[key]

    stand_ins = {"whole": {}, "projections": {"linear": fake_linear}, "attention": {"attention": fake_attention},
                 "norms": {"norm": fake_norm}}

    def forward(ids, start, parts: dict):
        lt.linear = parts.get("linear", real["linear"])
        lean_target.verify_attention = parts.get("attention", real["attention"])
        lean_target.add_rms_norm = parts.get("norm", real["norm"])
        try:
            t = time.perf_counter()
            with torch.inference_mode():
                lt.forward(ids, start, CONTEXT + ids.shape[1])
            return 1e3 * (time.perf_counter() - t)
        finally:
            lt.linear, lean_target.verify_attention, lean_target.add_rms_norm = (
                real["linear"], real["attention"], real["norm"])

    weight_bytes = sum(p.numel() * p.element_size() for name, p in target.named_parameters()
                       if p.dim() == 2 and "embed_tokens" not in name)
    if target.config.tie_word_embeddings:
        weight_bytes += target.lm_head.weight.numel() * target.lm_head.weight.element_size()
    vec = torch.randn(args.read_mib * 2**18)  # fp32: 2^18 values a MiB
    for _ in range(2):
        torch.dot(vec, vec)
    reads = []
    for _ in range(5):
        t = time.perf_counter()
        torch.dot(vec, vec)
        reads.append(time.perf_counter() - t)
    gbps = vec.numel() * 4 / statistics.median(reads) / 1e9
    del vec
    floor_ms = weight_bytes / (gbps * 1e9) * 1e3

    rows_list = common.parse_ints(args.rows)
    # (label, native CPU kernels on, AMX path on, bf16-packed weights on); the AMX rows only where the CPU has it
    settings = [("native + AMX", True, True, True)] * cpu_linear.amx_active() + [
        ("native, bf16-packed GEMM", True, False, True), ("native, fp32 GEMM", True, False, False),
        ("torch formulas", False, False, False)]
    times: dict = {}
    for rep in range(args.reps + 2):  # two warm-up reps, not kept
        for q in rows_list:
            ids = torch.randint(0, target.config.vocab_size, (1, q))
            start = torch.tensor([CONTEXT])
            for label, native, amx, bf16 in settings:
                with common.cpu_kernels(native=native, amx=amx, native_forward=False, bf16=bf16):  # stand-ins
                    for name, parts in stand_ins.items():  # need the ops
                        ms = forward(ids, start, parts)
                        if rep >= 2:
                            times.setdefault((q, label, name), []).append(ms)
                with common.cpu_kernels(native=native, amx=amx, bf16=bf16):  # the whole, as decoding runs it
                    ms = forward(ids, start, {})
                    if rep >= 2:
                        times.setdefault((q, label, "native forward"), []).append(ms)
        print(f"[cpu_forward] rep {rep + 1}/{args.reps + 2}", file=sys.stderr, flush=True)

    rows = []
    for q in rows_list:
        for label, _native, amx, bf16 in settings:
            med = {name: statistics.median(times[(q, label, name)]) for name in (*stand_ins, "native forward")}
            parts = {name: med["whole"] - med[name] for name in ("projections", "attention", "norms")}
            rows.append({"rows": q, "cpu kernels": label,
                         "native_forward_ms": round(med["native forward"], 1),
                         "native_forward_min_ms": round(min(times[(q, label, "native forward")]), 1),
                         "whole_ms": round(med["whole"], 1), "without_projections_ms": round(med["projections"], 1),
                         "projections_ms": round(parts["projections"], 1), "attention_ms": round(parts["attention"], 1),
                         "norms_ms": round(parts["norms"], 1),
                         "weights_floor_ms": round(floor_ms / 2 if amx or bf16 else floor_ms, 1)})
    env = common.environment(torch.device("cpu"))
    head = (f"SmolLM2-135M lean target forward, {CONTEXT} cached tokens, fp32, {args.reps} reps (medians); "
            f"weights {weight_bytes / 2**20:.0f} MiB fp32, read bandwidth {gbps:.1f} GB/s (torch.dot, {args.read_mib} MiB); "
            f"{env['hardware']}, torch {env['torch']}, commit {env['commit']}, {env['date']}")
    columns = ["rows", "cpu kernels", "native_forward_ms", "native_forward_min_ms", "whole_ms", "without_projections_ms", "projections_ms", "attention_ms",
               "norms_ms", "weights_floor_ms"]
    common.report(head, rows, columns, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

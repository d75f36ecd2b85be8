"""Short summary of a benchmark output folder (the CSVs of step_latency, draft_latency, kernels, e2e): the
headline numbers, as a few small tables. Used as the last step of bench/gpu_check.sh.

Usage: python bench/summarize.py DIR [--steps steps.tsv]
"""
from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def _read(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _f(x) -> float:
    try:
        return float(x)
    except (TypeError, ValueError):
        return float("nan")


def draft_summary(rows: list[dict]) -> str:
    """Batch 1 (else smallest), block 16 (else largest): ms per provider and % of memory floor."""
    if not rows:
        return ""
    batch = min(int(r["batch"]) for r in rows)
    blocks = sorted({int(r["block"]) for r in rows})
    pick = 16 if 16 in blocks else blocks[-1]
    out = []
    for model in sorted({r["model"] for r in rows}):
        for ctx in sorted({int(r["context"]) for r in rows if r["model"] == model}):
            sel = {r["provider"]: r for r in rows if r["model"] == model and int(r["batch"]) == batch
                   and int(r["block"]) == pick and int(r["context"]) == ctx}
            if not sel:
                continue
            row = {"model": model, "batch": batch, "B": pick, "ctx": ctx,
                   "floor_ms": _f(next(iter(sel.values()))["floor_mem_ms"])}
            for prov, short in (("reference", "ref"), ("fast-eager", "fast"), ("fast-graph", "graph")):
                r = sel.get(prov)
                row[f"{short}_ms"] = _f(r["median_ms"]) if r and r["status"] == "ok" else "n/a"
                row[f"{short}_%mem"] = _f(r.get("pct_mem_floor")) if r and r["status"] == "ok" else "n/a"
            out.append(row)
    # block-size curve at the smallest context: the paper's claim (flat for moderate B)
    ctx0 = min(int(r["context"]) for r in rows)
    best = "fast-graph" if any(r["provider"] == "fast-graph" and r["status"] == "ok" for r in rows) else "fast-eager"
    curve = {int(r["block"]): _f(r["median_ms"]) for r in rows if int(r["batch"]) == batch
             and int(r["context"]) == ctx0 and r["provider"] == best and r["model"] == rows[0]["model"]}
    text = common.table(out, ["model", "batch", "B", "ctx", "ref_ms", "fast_ms", "graph_ms", "floor_ms", "ref_%mem",
                              "fast_%mem", "graph_%mem"])
    text += f"\n{best} ms vs block size ({rows[0]['model']}, batch {batch}, ctx {ctx0}): " + \
            ", ".join(f"B{b}: {curve[b]:.3f}" for b in sorted(curve))
    return text


def step_latency_summary(rows: list[dict]) -> str:
    """Per model, batch, context and step: the eager and graph medians next to the accountant's H200
    predictions (CSV rows or step_latency's own)."""
    out: dict[tuple, dict] = {}
    for r in rows:
        key = (r["model"], int(r["batch"]), int(r["context"]), r["step"])
        w = out.setdefault(key, dict(zip(("model", "batch", "ctx", "step"), key), floor_ms=_f(r["floor_ms_h200"])))
        mode, ok = r["mode"], r["status"] == "ok"
        w[f"{mode}_ms"] = _f(r["median_ms"]) if ok else "n/a"
        w[f"pred_{mode}"] = _f(r["predicted_ms_h200"])
        w[f"{mode}/pred"] = _f(r["measured_over_predicted"]) if ok else "n/a"
    return common.table(list(out.values()), ["model", "batch", "ctx", "step", "eager_ms", "pred_eager", "eager/pred",
                                             "graph_ms", "pred_graph", "graph/pred", "floor_ms"]) + \
        "\n(pred_*, floor_ms: bench/traffic.py's H200 model, not a measurement; n/a: not run, see the CSV's status)"


def kernel_summary(rows: list[dict]) -> str:
    out = []
    for r in rows:
        if r.get("status") != "ok":
            if r.get("status", "").startswith(("failed", "unavailable")):
                out.append({"op": r["op"], "shape": r["shape"], "backend": r["backend"], "us": r["status"][:40]})
            continue
        us = _f(r.get("graph_us")) if r.get("graph_us") else _f(r["median_us"])
        out.append({"op": r["op"], "shape": r["shape"], "backend": r["backend"], "us": us,
                    "GB/s": _f(r.get("graph_GBps") or r.get("GBps")),
                    "%copy": 100 * _f(r.get("graph_GBps") or r.get("GBps")) / _f(r.get("copy_GBps")),
                    "x_torch": _f(r.get("graph_speedup_vs_torch") or r.get("speedup_vs_torch")),
                    "check": r.get("check", "")})
    return common.table(out, ["op", "shape", "backend", "us", "GB/s", "%copy", "x_torch", "check"]) + \
        "\n(us/GB/s from CUDA-graph replays where captured, else eager per-call medians)"


def e2e_summary(rows: list[dict]) -> str:
    out = []
    for r in rows:
        out.append({"pair": r["pair"], "runtime": r["name"], "tau": _f(r["tau"]), "tok/s": _f(r["tokens_per_s"]),
                    "x_AR": _f(r["speedup_vs_AR"]), "T_draft": _f(r["T_draft_ms"]), "T_verify": _f(r["T_verify_ms"]),
                    "T_other": _f(r["T_other_ms"]), "proj_T0": _f(r.get("proj_T=0")), "proj_T1": _f(r.get("proj_T=1")),
                    "bound_T0": _f(r.get("bound_T=0")), "same": r.get("same_as_AR")})
    return common.table(out, ["pair", "runtime", "tau", "tok/s", "x_AR", "T_draft", "T_verify", "T_other", "proj_T0",
                              "proj_T1", "bound_T0", "same"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("dir")
    p.add_argument("--steps", help="TSV of step, status, seconds, note")
    args = p.parse_args(argv)
    d = Path(args.dir)
    for pattern, title, fn in (("step_latency*.csv", "draft and verify steps vs the H200 prediction",
                                step_latency_summary), ("draft_latency*.csv", "draft step latency", draft_summary),
                               ("kernels*.csv", "kernels", kernel_summary), ("e2e*.csv", "end to end", e2e_summary)):
        for path in sorted(d.glob(pattern)):
            rows = _read(path)
            print(f"\n== {title} ({path.name}{'; INCOMPLETE: the step ran out of time' if 'partial' in path.name else ''})")
            print(fn(rows) if rows else "(empty)")
    if args.steps and Path(args.steps).is_file():
        print("\n== steps")
        with open(args.steps) as f:
            steps = [dict(zip(("step", "status", "seconds", "note"), line.rstrip("\n").split("\t"))) for line in f]
        print(common.table(steps, ["step", "status", "seconds", "note"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

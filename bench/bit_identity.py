"""Bit identity of every CPU runtime path between two versions of the code, for refactors that promise "same bits".

``dump OUT`` runs, in this process, on the installed ``dflash_kernels`` / ``dflash``:

* every public op of ``dflash_kernels`` on valid random inputs (the fuzz suite's case builders, ``tests/fuzz``),
  on each CPU backend it has (``cpu``, ``torch``, ``ext``, and ``triton`` under the interpreter);
* ``dflash.generate`` on tiny random pairs (the fuzz suite's ``generate`` case), both runtimes, both kernel
  backends, chains and trees;
* the SmolLM2 pair, when it is installed: the greedy tokens and acceptance lengths of ``generate`` on natural
  prompts (autoregressive, chain, trees of 7; ``cpu`` and ``torch`` kernels);

and saves every output (or the error it raised) with the cases themselves. ``dump OUT --cases BASE`` replays the
cases of an earlier dump, so that two versions see the same inputs. ``compare A B`` reports every output whose bits
differ (NaNs compare by their bit patterns) and exits 1 if any does.

Run the base version's dump from a checkout of the base commit (its own ``.venv``), then the new one's with
``--cases``; both dumps must come from the same machine (the native kernels choose their ISA at load).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported: Triton on the CPU

import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FUZZ = os.path.join(ROOT, "tests", "fuzz")
PROMPTS = ["Why does ice float on water? Explain briefly.",
           "Write a Python function that returns the n-th Fibonacci number.",
           "Give me three tips for writing a polite e-mail to a landlord."]
EXAMPLES = {"cpu": 12, "torch": 6, "ext": 6, "triton": 2}


def _fuzz_modules():
    """The fuzz suite's case builders and knob tables: ``helpers.fuzz.cases`` under tests/ (before tests/helpers
    existed, ``_cases`` beside the fuzz tests, importing its neighbours by bare name)."""
    for sub in ("", "fuzz", "kernels", "runtime"):
        path = os.path.join(ROOT, "tests", sub)
        if os.path.isdir(path) and path not in sys.path:
            sys.path.insert(0, path)
    try:
        from helpers.fuzz import cases
    except ImportError:
        import _cases as cases
    import test_fuzz_generate
    import test_fuzz_ops

    return cases, test_fuzz_ops, test_fuzz_generate


def _draw(strategy, n: int) -> list[dict]:
    """``n`` cases of a hypothesis strategy, the same ones every run (derandomized, no database)."""
    from hypothesis import HealthCheck, Phase, given, settings

    drawn: list[dict] = []

    @settings(max_examples=n, derandomize=True, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def collect(case):
        drawn.append(case)

    collect()
    return drawn[:n]


def op_cases() -> list[dict]:
    from hypothesis import strategies as st

    _, fuzz_ops, fuzz_generate = _fuzz_modules()
    cases = []
    for op, (_, backends, _groups) in fuzz_ops.KNOBS.items():
        for backend in backends:
            cases += _draw(fuzz_ops.case_strategy(op, "public", backend, "none"), EXAMPLES[backend])
    for runtime, kernels in fuzz_generate.RUNTIMES.items():
        for kernel in kernels:
            strategy = st.fixed_dictionaries(dict(
                fuzz_generate.KNOBS, **fuzz_generate.GROUPS["valid"], op=st.just("generate"), path=st.just("public"),
                backend=st.just(kernel), runtime=st.just(runtime), kernel_backend=st.just(kernel),
                seed=st.integers(0, 2**31 - 1), dtype=st.sampled_from(["fp32", "fp32", "bf16"])))
            cases += _draw(strategy, 8)
    return cases


def _as_tensors(result) -> list[torch.Tensor]:
    if isinstance(result, torch.Tensor):
        return [result.detach().clone()]
    if isinstance(result, (list, tuple)):
        return [t for r in result for t in _as_tensors(r)]
    if isinstance(result, (int, float, bool)):
        return [torch.tensor(result)]
    if hasattr(result, "sequences"):
        return _as_tensors(result.sequences) + [torch.tensor(result.acceptance_lengths).flatten()]
    return [torch.tensor(list(map(ord, repr(result)[:4000])))]


def run_op_case(case: dict) -> dict:
    cases_mod, _, _ = _fuzz_modules()
    op, b = cases_mod._make(case, None)
    if b.expect != "valid":
        return {"skipped": b.expect}
    torch.manual_seed(case["seed"])
    try:
        return {"out": _as_tensors(op.public(case["backend"]))}
    except Exception as e:  # noqa: BLE001 - an error is an outcome to compare
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}


def smollm2_runs() -> dict:
    """Greedy ``generate`` on the SmolLM2 pair: tokens and acceptance lengths per configuration."""
    try:
        import dflash
        try:
            from dflash_apps import demo, smollm2
        except ImportError:
            from dflash import demo, smollm2
    except ImportError as e:
        return {"unavailable": str(e)}
    if not smollm2.is_available():
        return {"unavailable": smollm2.unavailable_reason()}
    target, tok = smollm2.load(verbose=False)
    draft = dflash.DFlashDraftModel.from_pretrained(demo.DEFAULT_DRAFT)
    runs = {}
    for kernels in ("cpu", "torch"):
        runs[f"{kernels}/lean-target-forward"] = _lean_forward(target, tok, smollm2, kernels)
    for text in PROMPTS:
        ids = tok(smollm2.chat_prompt(tok, text), return_tensors="pt").input_ids
        for kernels in ("cpu", "torch"):
            for name, kw in (("ar", dict(block_size=1)), ("chain", {}), ("trees7", dict(tree_budget=7))):
                key = f"{kernels}/{name}/{text[:24]}"
                try:
                    out = dflash.generate(target, draft, ids, max_new_tokens=32, backend="fast",
                                          kernel_backend=kernels, stop_token_ids=smollm2.stop_token_ids(tok),
                                          **kw)
                    runs[key] = {"out": _as_tensors(out)}
                except Exception as e:  # noqa: BLE001
                    runs[key] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    return runs


def _lean_forward(model, tok, smollm2, kernels: str) -> dict:
    """The lean target's logits and tapped features: a prompt's prefill, a one-token step and an 8-row step."""
    from dflash.lean_target import LeanTarget

    try:
        lt = LeanTarget(model, [1, 10, 20], batch=1, capacity=256, backend=kernels)
        ids = tok(smollm2.chat_prompt(tok, PROMPTS[0]), return_tensors="pt").input_ids
        gen = torch.Generator().manual_seed(0)
        steps = [ids, torch.randint(0, model.config.vocab_size, (1, 1), generator=gen),
                 torch.randint(0, model.config.vocab_size, (1, 8), generator=gen)]
        out, start = [], 0
        with torch.inference_mode():
            for step in steps:
                logits, features = lt.forward(step, torch.tensor([start]), start + step.shape[1])
                out += [logits, features]
                start += step.shape[1]
        return {"out": _as_tensors(out)}
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}


def dump(path: str, cases_from: str | None) -> None:
    torch.set_num_threads(2)
    warnings.simplefilter("ignore")
    cases = torch.load(cases_from, weights_only=False)["cases"] if cases_from else op_cases()
    results = []
    for i, case in enumerate(cases):
        results.append(run_op_case(case))
        if i % 50 == 0:
            print(f"[bit_identity] case {i}/{len(cases)}", file=sys.stderr, flush=True)
    print("[bit_identity] SmolLM2 runs", file=sys.stderr, flush=True)
    torch.save({"cases": cases, "results": results, "smollm2": smollm2_runs()}, path)
    print(f"[bit_identity] wrote {path}: {len(cases)} cases", file=sys.stderr)


def _bits(t: torch.Tensor) -> torch.Tensor:
    if t.is_floating_point():
        return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t


def _same(a: dict, b: dict) -> str | None:
    if a.keys() != b.keys():
        return f"outcome {sorted(a)} vs {sorted(b)}: {a.get('error') or a.get('skipped')} / " \
               f"{b.get('error') or b.get('skipped')}"
    if "out" not in a:
        return None if a == b else f"{a} vs {b}"
    if len(a["out"]) != len(b["out"]):
        return f"{len(a['out'])} outputs vs {len(b['out'])}"
    for i, (x, y) in enumerate(zip(a["out"], b["out"])):
        if x.dtype != y.dtype or x.shape != y.shape:
            return f"output {i}: {x.dtype}{tuple(x.shape)} vs {y.dtype}{tuple(y.shape)}"
        if not torch.equal(_bits(x), _bits(y)):
            n = int((_bits(x) != _bits(y)).sum())
            return f"output {i}: {n} of {x.numel()} elements differ in their bits"
    return None


def compare(path_a: str, path_b: str) -> int:
    a, b = torch.load(path_a, weights_only=False), torch.load(path_b, weights_only=False)
    if a["cases"] != b["cases"]:
        print("the dumps ran different cases: make the second with --cases FIRST")
        return 2
    bad = 0
    outcomes = {"out": 0, "error": 0, "skipped": 0}
    for case, ra, rb in zip(a["cases"], a["results"], b["results"]):
        outcomes[next(iter(ra))] += 1
        problem = _same(ra, rb)
        if problem:
            bad += 1
            print(f"DIFF {case['op']}/{case['backend']} {json.dumps(case)}: {problem}")
    sa, sb = a["smollm2"], b["smollm2"]
    if "unavailable" in sa or "unavailable" in sb:
        print(f"SmolLM2 runs not compared: {sa.get('unavailable') or sb.get('unavailable')}")
    else:
        for key in sorted(set(sa) | set(sb)):
            problem = _same(sa.get(key, {"missing": key}), sb.get(key, {"missing": key}))
            if problem:
                bad += 1
                print(f"DIFF smollm2 {key}: {problem}")
    print(f"{len(a['cases'])} op/generate cases ({outcomes}), {len(sa)} SmolLM2 runs: "
          f"{'no difference' if not bad else f'{bad} differ'}")
    return 1 if bad else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump", help="run every case and save the outputs")
    d.add_argument("out")
    d.add_argument("--cases", help="replay the cases of this earlier dump")
    c = sub.add_parser("compare", help="compare two dumps bit for bit")
    c.add_argument("a")
    c.add_argument("b")
    args = ap.parse_args(argv)
    if args.cmd == "dump":
        dump(args.out, args.cases)
        return 0
    return compare(args.a, args.b)


if __name__ == "__main__":
    sys.exit(main())

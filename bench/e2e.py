"""End-to-end decoding: tokens/s and acceptance τ for the autoregressive baseline (block_size=1, same
machinery), the reference runtime and the fast runtime, with the per-round breakdown
T_draft / T_verify / T_other.

Pairs:
  random      random target + random draft (CPU default: a tiny Qwen3 pair; GPU: Qwen3-8B shapes,
              bf16). A random draft is almost never accepted (τ ≈ 1): those rows measure cost, not
              speed-up. The target's weights are dense random values of the real shapes, arranged so
              that its greedy continuation has a wide margin (see make_margin_target): outputs then
              do not depend on rounding, so AR and block runs agree token for token even in bf16.
  oracle-a    ORACLE MODE (labelled everywhere): the same models, but after the real draft step the
              proposals are replaced on the device by the target's own greedy continuation, correct
              for the first a-1 tokens and wrong after, so each round accepts a tokens (τ ≈ a). The
              draft and verify work is real; only the proposals are fake. Use: the cost side.
  smollm2     SmolLM2-135M-Instruct + the trained draft in dflash_apps/assets/smollm2-135m-dflash, real
              prompts, when both are installed (otherwise the output says why it is missing).

Per-round costs of the fast runtime are medians over rounds with the first round excluded (it
captures the CUDA graphs). Projected speed-up = τ·T_AR / (T_draft + T_verify + T_other) at the paper's
τ (6.49 for Qwen3-8B at T=0, 5.48 at T=1), from the measured per-round costs; the bandwidth-limited
bound is the same ratio with every step at its memory floor (target weights + KV per verify or AR
step; draft weights + fc + LM head + context KV per draft step) over the copy bandwidth measured now.

Usage: python bench/e2e.py [--pairs random,oracle-6,smollm2] [--block 16] [--prompt-len 512]
       [--max-new 256] [--out DIR]       (``dflash bench e2e`` runs this file)
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

import torch  # noqa: E402

PAPER_TAU = {"T=0": 6.49, "T=1": 5.48}  # Qwen3-8B-DFlash-b16, paper's acceptance lengths
TARGETS = {
    # hidden, layers, heads, kv heads, head dim, intermediate, vocab; draft: layers, intermediate
    "qwen3-8b": dict(hidden=4096, layers=36, heads=32, kv_heads=8, head_dim=128, inter=12288, vocab=151936,
                     draft_layers=5, draft_inter=12288),
    "cpu-tiny": dict(hidden=256, layers=8, heads=4, kv_heads=2, head_dim=64, inter=768, vocab=4096,
                     draft_layers=2, draft_inter=768),
    "smoke": dict(hidden=64, layers=4, heads=4, kv_heads=2, head_dim=16, inter=128, vocab=256,
                  draft_layers=1, draft_inter=128),
}
SMOLLM2_DRAFT = Path(__file__).resolve().parents[1] / "dflash_apps" / "assets" / "smollm2-135m-dflash"
SMOLLM2_PROMPTS = [
    "Explain why the sky is blue in three sentences.",
    "Write a short Python function that reverses a string, with a docstring.",
    "List five uses of a paperclip.",
]


# ------------------------------------------------------------------------------------------ models
def build_random_pair(spec: dict, device, dtype, block: int):
    from transformers import Qwen3Config

    from dflash import DFlashConfig

    tcfg = Qwen3Config(vocab_size=spec["vocab"], hidden_size=spec["hidden"], intermediate_size=spec["inter"],
                       num_hidden_layers=spec["layers"], num_attention_heads=spec["heads"],
                       num_key_value_heads=spec["kv_heads"], head_dim=spec["head_dim"], max_position_embeddings=40960,
                       tie_word_embeddings=False, rope_theta=1e6)
    dcfg = DFlashConfig(hidden_size=spec["hidden"], num_hidden_layers=spec["draft_layers"],
                        num_attention_heads=spec["heads"], num_key_value_heads=spec["kv_heads"],
                        head_dim=spec["head_dim"], intermediate_size=spec["draft_inter"],
                        num_target_layers=spec["layers"], block_size=block, mask_token_id=spec["vocab"] - 2,
                        vocab_size=spec["vocab"], max_position_embeddings=40960,
                        rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    target, draft = common.instantiate_random(tcfg, dcfg, device, dtype, norm_range=(0.8, 1.2))
    with torch.no_grad():
        make_margin_target(target)
    target.generation_config.eos_token_id = None
    return target, draft


def make_margin_target(target, seed: int = 0) -> None:
    """Give a random target a greedy continuation that does not depend on rounding.

    A plain random bf16 target has near-ties (top-2 logits one bf16 ulp apart) every few tokens, so
    runs with different block sizes (different GEMM shapes) legitimately diverge, and an oracle built
    from the AR run stops matching. Here the layers are dense random (std 0.002, every value nonzero:
    the cost of each step is unchanged), the embedding has std 1 and dominates the residual stream, and
    ``lm_head[perm[x]] = embed[x]``: the target's next token is ``perm[last token]`` with a margin of
    about H against O(sqrt(H)) for the others."""
    with torch.no_grad():
        for name, p in target.named_parameters():
            if p.dim() >= 2 and "embed_tokens" not in name and "lm_head" not in name:
                p.normal_(0, 0.002)
        emb = target.model.embed_tokens.weight
        emb.normal_(0, 1)
        gen = torch.Generator().manual_seed(seed)
        perm = torch.randperm(emb.shape[0], generator=gen).to(emb.device)
        target.lm_head.weight[perm] = emb.to(target.lm_head.weight.dtype)


def param_bytes(module, skip=()) -> int:
    return sum(p.numel() * p.element_size() for n, p in module.named_parameters() if not n.startswith(skip))


# ------------------------------------------------------------------------------------------ oracle
def oracle_fast_class(seq: torch.Tensor, accept: int, vocab: int):
    """DFlashEngine whose draft step runs for real, then overwrites the proposals on the device (no host
    read, so the step stays capturable): the first accept-1 are the target's greedy continuation
    ``seq`` [1 or batch, L] (full sequences, prompt included), the rest are wrong on purpose."""
    from dflash.engine import DFlashEngine

    class OracleFast(DFlashEngine):
        def draft_step(self):
            super().draft_step()
            j = torch.arange(self.block_size - 1, device=self.device)
            idx = (self.positions[:, None] + 1 + j).clamp(max=seq.shape[1] - 1)
            rows = seq if seq.shape[0] == self.batch else seq.expand(self.batch, -1)
            tok = rows.gather(1, idx)
            self.proposals.copy_(torch.where(j[None] < accept - 1, tok, (tok + 1) % vocab))

    return OracleFast


@contextlib.contextmanager
def oracle_draft(draft, seq: torch.Tensor, accept: int):
    """The reference loop's draft with its logits overridden the same way (class swapped for the call)."""
    from dflash.model import DFlashDraftModel

    class OracleDraft(DFlashDraftModel):
        def forward(self, position_ids, *args, **kwargs):
            hidden = super().forward(position_ids, *args, **kwargs)
            self._start = position_ids[0, -hidden.shape[1]]
            return hidden

        def compute_logits(self, hidden, output_head, *args):
            logits = super().compute_logits(hidden, output_head, *args)
            q = logits.shape[1]
            j = torch.arange(q, device=logits.device)
            idx = (self._start + 1 + j).clamp(max=seq.shape[1] - 1)
            tok = seq[0, idx]
            tok = torch.where(j < accept - 1, tok, (tok + 1) % logits.shape[-1])
            big = logits.detach().abs().amax() * 2 + 1
            return logits.scatter(-1, tok[None, :, None].expand(logits.shape[0], -1, 1),
                                  big.expand(logits.shape[0], q, 1).to(logits.dtype))

    old = draft.__class__
    draft.__class__ = OracleDraft
    try:
        yield draft
    finally:
        draft.__class__ = old


# ------------------------------------------------------------------------------------------ runs
def run_fast(target, draft, ids: torch.Tensor, max_new: int, block: int, stops, engine_cls=None,
             use_graphs=None) -> dict:
    """One request through the engine, timing every round (the first round captures the graphs)."""
    from dflash.api import as_target
    from dflash.engine import DFlashEngine
    from dflash.sampling import SamplingParams

    adapter = as_target(target, draft)
    cls = engine_cls or DFlashEngine
    p = ids.shape[0]
    cap = -(-(p + max_new) // 64) * 64
    engine = cls(adapter.model, draft, batch=1, capacity=cap, block_size=block, use_cuda_graphs=use_graphs)
    res = engine.generate([ids], [max_new], [list(stops)], SamplingParams(), seed=0)[0]
    rounds = [(dt, vt, wall, n) for (dt, vt, wall), n in zip(res.extra["round_times"], res.acceptance_lengths)]
    graphs = engine.graph_mode is not None
    return summarize(rounds, res.prefill_time, res.sequences[0], p, skip_first=graphs, runtime="fast",
                     graphs=graphs, backend=engine.backend)


def summarize(rounds, t_prefill, seq, prompt_len, *, skip_first: bool, runtime: str, graphs: bool, backend: str):
    used = rounds[1:] if skip_first and len(rounds) > 1 else rounds
    tokens = sum(r[3] for r in used)
    wall = sum(r[2] for r in used)
    return {
        "runtime": runtime, "graphs": graphs, "kernels": backend, "rounds": len(rounds),
        "tau": sum(r[3] for r in rounds) / max(1, len(rounds)),
        "tokens_per_s": tokens / wall if wall else float("nan"),
        "T_draft_ms": 1e3 * statistics.median(r[0] for r in used),
        "T_verify_ms": 1e3 * statistics.median(r[1] for r in used),
        "T_other_ms": 1e3 * statistics.median(max(0.0, r[2] - r[0] - r[1]) for r in used),
        "T_round_ms": 1e3 * statistics.median(r[2] for r in used),
        "prefill_ms": 1e3 * t_prefill, "generated": int(seq.shape[0] - prompt_len),
        "per_round": "median over rounds" + (", first round (graph capture) excluded" if skip_first else ""),
        "_seq": seq,
    }


def run_reference(target, draft, ids, max_new, block, stops) -> dict:
    from dflash import generate

    res = generate(target, draft, ids, max_new, stop_token_ids=stops, block_size=block, backend="reference")
    rounds = max(1, len(res.acceptance_lengths))
    decode_tokens = sum(res.acceptance_lengths)
    return {"runtime": "reference", "graphs": False, "kernels": "eager PyTorch (HF DynamicCache, DraftKVCache)",
            "rounds": len(res.acceptance_lengths), "tau": res.tau,
            "tokens_per_s": decode_tokens / res.decode_time if res.decode_time else float("nan"),
            "T_draft_ms": 1e3 * res.draft_time / rounds, "T_verify_ms": 1e3 * res.verify_time / rounds,
            "T_other_ms": 1e3 * res.other_time / rounds, "T_round_ms": 1e3 * res.decode_time / rounds,
            "prefill_ms": 1e3 * res.prefill_time, "generated": res.num_generated_tokens,
            "per_round": "mean over rounds (totals / rounds)", "_seq": res.sequences[0]}


def bandwidth_bound(target, draft, ctx: int, block: int, bw_gbps: float) -> dict:
    """Memory floors of an AR step, a verify step and a draft step at context ``ctx``."""
    tcfg, dcfg = target.config, draft.config
    elem = target.lm_head.weight.element_size()
    t_bytes = param_bytes(target, skip=("model.embed_tokens",))
    t_kv = tcfg.num_hidden_layers * ctx * tcfg.num_key_value_heads * getattr(tcfg, "head_dim", 0) * 2 * elem
    d_bytes = param_bytes(draft) + target.lm_head.weight.numel() * elem
    d_kv = dcfg.num_hidden_layers * ctx * dcfg.num_key_value_heads * dcfg.head_dim * 2 * elem
    bw = bw_gbps * 1e9
    ar = (t_bytes + t_kv) / bw
    rnd = (t_bytes + t_kv + d_bytes + d_kv) / bw
    return {"floor_AR_ms": ar * 1e3, "floor_round_ms": rnd * 1e3, "target_GB": t_bytes / 1e9, "draft_GB": d_bytes / 1e9}


def measure_pair(label, target, draft, prompts, max_new, block, stops, device, *, rows: common.RowLog,
                 oracle_accept=None, runtimes=("ar-fast", "ar-reference", "reference", "fast"), log=print,
                 ar_cache=None) -> None:
    """Runs every runtime on each prompt (after one short warm-up each); each runtime's row goes to ``rows`` as it
    finishes, completed by the prompt's lossless check. AR runs are shared between pairs of the same models
    through ``ar_cache``."""
    ar_cache = {} if ar_cache is None else ar_cache
    vocab = target.config.vocab_size
    for pi, ids in enumerate(prompts):
        ids = ids.to(device)
        res = {}
        # AR baseline first: its output is the target's greedy continuation (the oracle's source)
        for rt in runtimes:
            kind = "oracle" if oracle_accept else "draft"
            warm = min(max_new, 2 * block + 2)
            if rt == "ar-fast":
                fn = lambda m: run_fast(target, draft, ids, m, 1, stops)  # noqa: E731
            elif rt == "ar-reference":
                fn = lambda m: run_reference(target, draft, ids, m, 1, stops)  # noqa: E731
            elif oracle_accept:
                if "ar-fast" not in res and "ar-reference" not in res:
                    raise SystemExit("oracle pairs need an AR runtime first in --runtimes (its output is the oracle)")
                seq = res["ar-fast"]["_seq"] if "ar-fast" in res else res["ar-reference"]["_seq"]
                pad = torch.full((1, block + 2), 0, dtype=torch.long, device=device)
                seq = torch.cat([seq[None].to(device), pad], dim=1)
                if rt == "fast":
                    cls = oracle_fast_class(seq, oracle_accept, vocab)
                    fn = lambda m, cls=cls: run_fast(target, draft, ids, m, block, stops, engine_cls=cls)  # noqa: E731
                else:
                    def fn(m, seq=seq):
                        with oracle_draft(draft, seq, oracle_accept):
                            return run_reference(target, draft, ids, m, block, stops)
            elif rt == "fast":
                fn = lambda m: run_fast(target, draft, ids, m, block, stops)  # noqa: E731
            else:
                fn = lambda m: run_reference(target, draft, ids, m, block, stops)  # noqa: E731
            if rt.startswith("ar") and (pi, rt) in ar_cache:
                r = dict(ar_cache[(pi, rt)])
            else:
                fn(warm)  # warm-up: kernel compilation, cuBLAS handles, allocator
                r = fn(max_new)
                if rt.startswith("ar"):
                    ar_cache[(pi, rt)] = dict(r)
            res[rt] = r
            r.update(pair=label, prompt=pi, prompt_len=int(ids.shape[0]), block=1 if rt.startswith("ar") else block,
                     mode=("ar" if rt.startswith("ar") else f"{kind}" + (f"-{oracle_accept}" if oracle_accept else "")))
            r["name"] = rt
            rows.append(r)
            log(f"  {label} prompt {pi} {rt:12s} τ {r['tau']:5.2f}  {r['tokens_per_s']:8.1f} tok/s  "
                f"round {r['T_round_ms']:8.2f} ms (draft {r['T_draft_ms']:.2f}, verify {r['T_verify_ms']:.2f}, "
                f"other {r['T_other_ms']:.2f})", flush=True)
        # lossless check (greedy): every runtime's output equals the AR output, length included
        # (a runtime that stops early or overshoots max_new is not the same)
        ref_seq = res[runtimes[0]]["_seq"].cpu()
        for rt, r in res.items():
            seq = r["_seq"].cpu()
            r["same_as_AR"] = seq.shape == ref_seq.shape and bool(torch.equal(seq, ref_seq))
            ar = r if rt.startswith("ar") else res.get("ar-fast" if rt == "fast" else "ar-reference")
            if ar is None:
                r["speedup_vs_AR"] = float("nan")
                continue_proj = False
            else:
                r["speedup_vs_AR"] = r["tokens_per_s"] / ar["tokens_per_s"]
                continue_proj = True
            t_ar = ar["T_round_ms"] if continue_proj else float("nan")
            cost = r["T_draft_ms"] + r["T_verify_ms"] + r["T_other_ms"]
            for key, tau in PAPER_TAU.items():
                r[f"proj_{key}"] = tau * t_ar / cost if not rt.startswith("ar") else float("nan")
        rows.flush()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="auto")
    p.add_argument("--model", choices=sorted(TARGETS), help="random pair shapes (default GPU qwen3-8b, CPU cpu-tiny)")
    p.add_argument("--pairs", help="comma list of random, oracle-<a>, smollm2 "
                                   "(default GPU oracle-6,oracle-5; CPU random,oracle-6,smollm2)")
    p.add_argument("--runtimes", default="ar-fast,ar-reference,reference,fast")
    p.add_argument("--block", type=int, help="default 16 (GPU), 8 (CPU)")
    p.add_argument("--prompt-len", type=int, help="random prompts' length (default GPU 512, CPU 64)")
    p.add_argument("--prompts", type=int, default=1, help="random prompts per pair")
    p.add_argument("--max-new", type=int, help="default GPU 256, CPU 64")
    p.add_argument("--dtype", choices=["bf16", "fp32"], help="default bf16 GPU, fp32 CPU")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out")
    p.add_argument("--tag")
    args = p.parse_args(argv)
    device = common.pick_device(args.device)
    gpu = device.type == "cuda"
    if not gpu:
        torch.set_num_threads(args.threads)
    model = args.model or ("qwen3-8b" if gpu else "cpu-tiny")
    pairs = (args.pairs or ("oracle-6,oracle-5" if gpu else "random,oracle-6,smollm2")).split(",")
    runtimes = tuple(args.runtimes.split(","))
    block = args.block or (16 if gpu else 8)
    prompt_len = args.prompt_len or (512 if gpu else 64)
    max_new = args.max_new or (256 if gpu else 64)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if gpu else "fp32")]
    bw = common.copy_bandwidth(device)
    env = common.print_header("end-to-end decoding", device, {
        "setup": f"batch 1, block {block}, greedy (T=0), random prompts of {prompt_len} tokens, {max_new} new tokens; "
                 f"random pair '{model}' in {str(dtype)[6:]}",
        "ORACLE": "oracle-a rows: proposals replaced by the target's greedy continuation, right for a-1 tokens "
                  "then wrong: τ is chosen, not earned; they measure cost only",
        "projection": f"proj_T=0 / proj_T=1 = τ·T_AR/(T_draft+T_verify+T_other) at τ = {PAPER_TAU['T=0']} / "
                      f"{PAPER_TAU['T=1']} (paper, Qwen3-8B), T_AR = the same runtime's AR round",
        "bandwidth": f"{bw['copy_GBps']:.1f} GB/s measured copy (read+write)",
    })
    torch.manual_seed(0)
    out = common.out_dir(args.out)
    stem = args.tag or f"e2e-{device.type}"
    rows, notes = common.RowLog(out / f"{stem}.partial.csv", {**env, **bw}), []
    random_models = None
    ar_cache: dict = {}
    torch.manual_seed(1)
    for pair in pairs:
        if pair == "smollm2":
            smollm2_rows(block, max_new, device, runtimes, notes, rows)
            continue
        if pair != "random" and not pair.startswith("oracle-"):
            raise SystemExit(f"--pairs: unknown pair {pair!r}")
        if random_models is None:
            t0 = time.perf_counter()
            random_models = build_random_pair(TARGETS[model], device, dtype, block)
            print(f"# built random pair {model} in {time.perf_counter() - t0:.1f} s", flush=True)
        target, draft = random_models
        vocab = target.config.vocab_size
        gen = torch.Generator().manual_seed(1234)  # the same prompts for every pair (AR runs are shared)
        prompts = [torch.randint(0, vocab - 2, (prompt_len,), generator=gen) for _ in range(args.prompts)]
        accept = int(pair.split("-")[1]) if pair.startswith("oracle-") else None
        if accept is not None and not 1 <= accept <= block:
            raise SystemExit(f"--pairs {pair}: acceptance must be in 1..{block}")
        label = f"{model}-{pair}" if pair == "random" else f"{model}-ORACLE-{accept}"
        measure_pair(label, target, draft, prompts, max_new, block, [], device, oracle_accept=accept, rows=rows,
                     runtimes=runtimes, ar_cache=ar_cache)
    if random_models is not None:
        target, draft = random_models
        bound = bandwidth_bound(target, draft, prompt_len + max_new // 2, block, bw["copy_GBps"])
        for key, tau in PAPER_TAU.items():
            bound[f"bound_{key}"] = tau * bound["floor_AR_ms"] / bound["floor_round_ms"]
        print(f"# bandwidth bound ({model}, ctx ≈ {prompt_len + max_new // 2}): AR step ≥ {bound['floor_AR_ms']:.3f} ms, "
              f"round (verify + draft) ≥ {bound['floor_round_ms']:.3f} ms -> speed-up ≤ "
              f"{bound['bound_T=0']:.2f}x at τ {PAPER_TAU['T=0']}, ≤ {bound['bound_T=1']:.2f}x at τ {PAPER_TAU['T=1']} "
              f"(target {bound['target_GB']:.3f} GB, draft + LM head {bound['draft_GB']:.3f} GB per step)")
        for r in rows:
            if r["pair"].startswith(model):
                r.update({k: v for k, v in bound.items() if k.startswith(("bound_", "floor_"))})
    cols = ["pair", "prompt", "name", "block", "tau", "tokens_per_s", "speedup_vs_AR", "T_draft_ms", "T_verify_ms", "T_other_ms",
            "T_round_ms", "proj_T=0", "proj_T=1", "same_as_AR"]
    print()
    print(common.table(rows, cols))
    for n in notes:
        print(f"# {n}")
    print("# speedup_vs_AR: tokens/s over the same runtime's block_size=1 run (fast vs ar-fast, reference vs "
          "ar-reference); ORACLE rows: cost side only")
    path = rows.finish(out / f"{stem}.csv")
    print(f"# wrote {path}")
    return 0


def smollm2_rows(block, max_new, device, runtimes, notes, rows: common.RowLog) -> None:
    """The trained SmolLM2 pair's rows into ``rows``, or a note saying why it is unavailable."""
    from dflash_apps import smollm2

    why = smollm2.unavailable_reason()
    draft_path = Path(os.environ.get("DFLASH_SMOLLM2_DRAFT", SMOLLM2_DRAFT))
    if why is None and not (draft_path / "config.json").is_file():
        why = f"no trained draft at {draft_path} (the training issue ships it)"
    if why is not None:
        msg = f"smollm2 pair: UNAVAILABLE: {why}"
        print(f"# {msg}")
        notes.append(msg)
        return
    from dflash.model import DFlashDraftModel

    target, tok = smollm2.load(verbose=False)
    target = target.to(device)
    draft = DFlashDraftModel.from_pretrained(draft_path, dtype=target.lm_head.weight.dtype, device=device)
    stops = smollm2.stop_token_ids(tok)
    prompts = [torch.tensor(tok(smollm2.chat_prompt(tok, t), add_special_tokens=False)["input_ids"])
               for t in SMOLLM2_PROMPTS]
    measure_pair("smollm2-135m", target, draft, prompts, max_new, block or draft.config.block_size, stops,
                 device, rows=rows, runtimes=runtimes)


if __name__ == "__main__":
    sys.exit(main())

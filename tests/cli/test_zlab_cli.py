"""z-lab's ``dflash generate`` / ``dflash benchmark`` end to end on the embedded SmolLM2 pair, and their
argument errors (exit 2, one line on stderr, nothing on stdout). The SmolLM2 runs are few and short."""
from __future__ import annotations

import io
import json
import re
import sys

import pytest
import torch

from dflash_apps import cli, smollm2, zlab_cli

needs_smollm2 = pytest.mark.skipif(not smollm2.is_available(), reason=smollm2.unavailable_reason() or "")
PROMPT = "What is 2 + 3?"


@pytest.fixture(scope="module")
def pair():
    """The embedded pair exactly as the CLI loads it."""
    target, tok, draft, device = zlab_cli._load(zlab_cli.EMBEDDED, str(zlab_cli.EMBEDDED_DRAFT), "cpu", system=None)
    return target, tok, draft


def expected_text(pair, prompt: str, max_new: int) -> str:
    from dflash import generate

    target, tok, draft = pair
    ids = zlab_cli._encode(tok, [{"role": "user", "content": prompt}], torch.device("cpu"))
    res = generate(target, draft, ids, max_new, stop_token_ids=zlab_cli._stop_ids(target, tok), backend="reference")
    return tok.decode(res.sequences[0, ids.shape[1]:], skip_special_tokens=True, clean_up_tokenization_spaces=False)


def run(argv, capsys, stdin=None, monkeypatch=None):
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


@needs_smollm2
def test_generate_equals_dflash_generate(pair, capsys):
    code, out, err = run(["generate", "transformers", "--model", "smollm2", "--draft", "smollm2", "--max-new-tokens",
                          "12", "--backend", "fast", PROMPT], capsys)
    assert code == 0
    assert out == expected_text(pair, PROMPT, 12) + "\n"
    summary = [line for line in err.splitlines() if line.startswith("[dflash]")]
    assert len(summary) == 1 and "tau" in summary[0] and "tokens/s" in summary[0]


@needs_smollm2
def test_generate_reads_stdin_and_batch_file(pair, capsys, monkeypatch, tmp_path):
    code, out, _ = run(["generate", "transformers", "--model", "smollm2", "--max-new-tokens", "6",
                        "--backend", "reference"], capsys, stdin="Name a color.\n", monkeypatch=monkeypatch)
    assert code == 0 and out == expected_text(pair, "Name a color.", 6) + "\n"
    batch = tmp_path / "prompts.txt"
    batch.write_text("Name a color.\n\nWhat is 2 + 3?\n")
    code, out, _ = run(["generate", "transformers", "--model", "smollm2", "--max-new-tokens", "6",
                        "--backend", "reference", "--batch-file", str(batch)], capsys)
    rows = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and [r["prompt"] for r in rows] == ["Name a color.", "What is 2 + 3?"]
    assert [r["completion"] for r in rows] == [expected_text(pair, r["prompt"], 6) for r in rows]


@needs_smollm2
def test_benchmark_on_a_shipped_set(capsys, tmp_path):
    out_file = tmp_path / "rows.jsonl"
    code, out, _ = run(["benchmark", "transformers", "--model", "smollm2", "--dataset", "mt-bench", "--max-samples",
                        "1", "--max-new-tokens", "6", "--output", str(out_file)], capsys)
    assert code == 0
    for key in ("Baseline throughput", "DFlash throughput", "Decoding speedup", "Average acceptance length (tau)",
                "Acceptance length histogram"):
        assert key in out
    rows = [json.loads(line) for line in out_file.read_text().splitlines()]
    assert [(r["sample"], r["turn"]) for r in rows] == [(0, 0), (0, 1)]  # both mt-bench turns
    assert all(1 <= r["dflash"]["tokens"] <= 6 and r["baseline"]["tokens"] >= 1 for r in rows)


@pytest.mark.parametrize("argv, message", [
    (["generate", "mlx", "--model", "m", "Hi"], "backend 'mlx' is not supported by dflash-kernels"),
    (["generate", "openai", "--model", "m", "--base-url", "http://x", "Hi"], "backend 'openai' is not supported"),
    (["benchmark", "sglang", "--model", "m"], "SGLang serves DFlash itself"),
    (["benchmark", "vllm", "--model", "m"], "vLLM serves DFlash itself"),
    (["generate", "transformers", "--model", "no/such/folder", "--draft", "d", "Hi"],
     "--model 'no/such/folder': no config.json there"),
    (["generate", "transformers", "--model", "smollm2", "--draft", "no/such/draft", "Hi"],
     "--draft 'no/such/draft': no config.json there"),
    (["generate", "transformers", "--model", "smollm2", "--max-new-tokens", "0", "Hi"], "--max-new-tokens must be >= 1"),
    (["generate", "transformers", "--model", "smollm2", "--block-size", "0", "Hi"], "--block-size must be >= 1"),
    (["generate", "transformers", "--model", "smollm2", "--temperature", "-1", "Hi"], "--temperature must be >= 0"),
    (["generate", "transformers", "--model", "smollm2", "--top-p", "1.5", "Hi"], r"--top-p must be in \(0, 1\]"),
    (["generate", "transformers", "--model", "smollm2", "--top-k", "-2", "Hi"], "--top-k must be >= 0"),
    (["generate", "transformers", "--model", "smollm2", "  "], "PROMPT is empty"),
    (["generate", "transformers", "--model", "smollm2", "--batch-file", "no/such/file"], "--batch-file: cannot read"),
    (["generate", "transformers", "--model", "other"], "--draft is required"),
    (["generate", "transformers", "--model", "smollm2", "--device", "foo", "Hi"], "--device 'foo' is not a device"),
    (["generate", "transformers", "--model", "smollm2", "--device", "mps", "Hi"], "--device 'mps' is not a device"),
    (["benchmark", "transformers", "--model", "smollm2", "--dataset", "gsm8k", "--device", "cuda:99"],
     r"--device 'cuda:99': this machine has \d+ CUDA device"),
    (["benchmark", "transformers", "--model", "smollm2", "--dataset", "gsm8k", "--max-samples", "0"],
     "--max-samples must be >= 1"),
], ids=lambda v: "-".join(v[:2]) if isinstance(v, list) else None)
def test_bad_arguments(argv, message, capsys, monkeypatch):
    code, out, err = run(argv, capsys, stdin="", monkeypatch=monkeypatch)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "error:" in err
    assert re.search(message, err), err


def test_corrupt_draft_weights(capsys, tmp_path):
    """A draft folder whose model.safetensors is not a safetensors file: exit 2, one line naming --draft, no
    traceback, and the target is not loaded first."""
    (tmp_path / "config.json").write_bytes((zlab_cli.EMBEDDED_DRAFT / "config.json").read_bytes())
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 1000)  # a header length of 2**64 - 1 bytes
    code, out, err = run(["generate", "transformers", "--model", "smollm2", "--draft", str(tmp_path), "Hi"], capsys)
    assert code == 2 and out == ""
    assert err == f"dflash generate: error: --draft {str(tmp_path)!r}: {tmp_path / 'model.safetensors'}: not a " \
                  "readable safetensors file (Error while deserializing header: header too large); the download " \
                  "is likely truncated or corrupt: fetch this file again\n"


def test_empty_stdin(capsys, monkeypatch):
    code, out, err = run(["generate", "transformers", "--model", "smollm2"], capsys, stdin="", monkeypatch=monkeypatch)
    assert code == 2 and out == "" and "no prompt on stdin" in err


@pytest.mark.parametrize("name", zlab_cli.DATASETS)
def test_shipped_prompt_sets(name):
    items = zlab_cli.load_prompt_set(name, None)
    assert len(items) >= 4 and all(turns and all(t.strip() for t in turns) for turns in items)
    assert len(zlab_cli.load_prompt_set(name, 2)) == 2

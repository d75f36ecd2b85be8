"""bench/vllm_peers.py end to end at its smallest: one prompt, 4 tokens, vLLM DFlash with the plugin and our chain,
each in its worker process; the table it prints says both decoded the same tokens and our ops ran."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

# A module inside vLLM: tests/vllm itself would import as an empty namespace package "vllm".
pytest.importorskip("vllm.entrypoints.llm", reason="vLLM is not installed here (make test-vllm builds .venv-vllm)")

ROOT = Path(__file__).resolve().parents[2]


def test_one_prompt_through_vllm_with_the_plugin_and_our_chain(tmp_path):
    out = tmp_path / "peers.md"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "vllm_peers.py"), "--prompts", "1", "--max-new-tokens",
                           "4", "--reps", "1", "--batches", "1", "--configs", "vLLM DFlash + plugin,ours chain",
                           "--out", str(out)], env=dict(os.environ), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    table = [[cell.strip() for cell in line.strip().strip("|").split("|")]
             for line in out.read_text().splitlines() if line.startswith("| ")]
    rows = {row[0]: dict(zip(table[0], row)) for row in table[1:]}
    plugged, ours = rows["vLLM DFlash + plugin"], rows["ours chain"]
    assert plugged["tokens"] == ours["tokens"] == "4"
    assert plugged["= ours chain"] == ours["= ours chain"] == "1/1"
    assert plugged["ours ran"].startswith("add_rms_norm ") and "inject_context_kv " in plugged["ours ran"]
    assert float(plugged["tok/s"].split()[0]) > 0 and float(plugged["τ"]) >= 1

"""Smoke test of the benchmark scripts (bench/): each runs at its smallest CPU setting and writes
its CSV, so the scripts cannot rot. Timings are not checked (see bench/README.md for real runs)."""
from __future__ import annotations

import csv
import os
import shutil
from pathlib import Path

import pytest

from helpers.bench import bench_module


def _rows(path: Path) -> list[dict]:
    assert path.is_file(), f"{path} was not written"
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows, f"{path} is empty"
    return rows


def test_draft_latency_smoke(tmp_path, capsys):
    draft_latency = bench_module("draft_latency")

    assert draft_latency.main(["--device", "cpu", "--models", "tiny", "--contexts", "48", "--blocks", "1,4",
                               "--warmup", "1", "--reps", "3", "--budget", "0.05", "--out", str(tmp_path)]) == 0
    rows = _rows(tmp_path / "draft_latency-cpu.csv")
    by = {(r["provider"], r["block"]): r for r in rows}
    for block in ("1", "4"):
        for prov in ("reference", "fast-eager"):
            r = by[(prov, block)]
            assert r["status"] == "ok" and float(r["median_ms"]) > 0 and float(r["pct_mem_floor"]) > 0
        assert by[("fast-graph", block)]["status"].startswith("unavailable")  # said, not skipped
    out = capsys.readouterr().out
    assert "fast-graph: UNAVAILABLE" in out and "memory floor" in out
    assert not (tmp_path / "draft_latency-cpu.partial.csv").exists()


def test_kernels_smoke_through_cli(tmp_path, capsys):
    from dflash_apps import cli

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "kernels", "--device", "cpu", "--size", "tiny", "--ops", "verify_greedy,commit_round,"
                  "fused_context,verify_attention,add_rms_norm,silu_mul", "--warmup", "1", "--reps", "3", "--budget",
                  "0.05", "--out", str(tmp_path)])
    assert exit_info.value.code in (0, None)
    rows = _rows(tmp_path / "kernels-cpu.csv")
    ok = {(r["op"], r["backend"]): r for r in rows if r["status"] == "ok"}
    for op in ("fused_context", "verify_greedy", "commit_round", "verify_attention", "add_rms_norm", "silu_mul"):
        assert (op, "torch") in ok and float(ok[op, "torch"]["GBps"]) > 0, op
    for r in rows:
        if r["backend"] == "triton":
            assert r["status"] != "ok"  # never timed on CPU (interpreter), and the row says so
        if r["backend"] == "ext" and r["status"] == "ok":
            assert r["check"] == "equal"
    assert "not timed on CPU" in capsys.readouterr().out


@pytest.mark.slow
def test_e2e_smoke(tmp_path):
    e2e = bench_module("e2e")

    assert e2e.main(["--device", "cpu", "--model", "smoke", "--pairs", "random,oracle-3,smollm2", "--block", "4",
                     "--prompt-len", "8", "--max-new", "12", "--out", str(tmp_path)]) == 0
    rows = _rows(tmp_path / "e2e-cpu.csv")
    names = {(r["pair"], r["name"]) for r in rows}
    assert ("smoke-ORACLE-3", "fast") in names and ("smoke-random", "ar-fast") in names
    for r in rows:
        assert r["same_as_AR"] == "True", r  # greedy decoding is lossless in every runtime: same tokens, same length
        if r["pair"].startswith("smoke-"):  # random pairs have no stop tokens: every runtime emits all 12
            assert int(r["generated"]) == 12, r
    oracle_fast = next(r for r in rows if r["pair"] == "smoke-ORACLE-3" and r["name"] == "fast")
    assert float(oracle_fast["tau"]) > 2


def test_draft_latency_through_cli_writes_csv_and_png(tmp_path):
    """matplotlib is a declared dependency: the PNG is always written next to the CSV."""
    from dflash_apps import cli

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "draft-latency", "--device", "cpu", "--models", "tiny", "--contexts", "48", "--blocks",
                  "1,4", "--warmup", "1", "--reps", "3", "--budget", "0.05", "--out", str(tmp_path)])
    assert exit_info.value.code in (0, None)
    _rows(tmp_path / "draft_latency-cpu.csv")
    png = tmp_path / "draft_latency-cpu.png"
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000


def test_step_latency_through_cli(tmp_path):
    """Both steps timed eagerly on the tiny pair, each row next to the accountant's prediction for the
    same configuration; graph rows say they are unavailable on CPU but still carry the prediction."""
    traffic = bench_module("traffic")

    from dflash_apps import cli

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "step-latency", "--device", "cpu", "--batch", "1", "--contexts", "48", "--warmup", "1",
                  "--reps", "3", "--budget", "0.05", "--out", str(tmp_path)])
    assert exit_info.value.code in (0, None)
    rows = {(r["step"], r["mode"]): r for r in _rows(tmp_path / "step_latency-cpu.csv")}
    assert set(rows) == {(s, m) for s in ("draft", "verify") for m in ("eager", "graph")}
    for (step, mode), r in rows.items():
        assert (r["model"], r["capacity"], r["block"]) == ("tiny", "64", "16")
        assert float(r["predicted_ms_h200"]) > float(r["floor_ms_h200"]) > 0
        if mode == "graph":
            assert r["status"].startswith("unavailable")
            continue
        assert r["status"] == "ok" and float(r["median_ms"]) > 0
        assert float(r["measured_over_predicted"]) == pytest.approx(float(r["median_ms"]) / float(r["predicted_ms_h200"]))
    # the accountant's rows (an eager prediction includes host time measured in the run: compared by its counts)
    eager = {s["step"]: s for s in traffic.measure("tiny", 1, 48, 64, 16, graphs=False)}
    for step in ("draft", "verify"):
        assert int(rows[step, "eager"]["launches"]) == eager[step]["launches"]
        assert float(rows[step, "eager"]["bytes_GB"]) == pytest.approx(eager[step]["bytes"] / 1e9)
    assert not (tmp_path / "step_latency-cpu.partial.csv").exists()


def _markdown_cells(text: str) -> list[list[str]]:
    """The cells of a markdown table's lines (header, separator, rows)."""
    return [[c.strip() for c in line.strip("| ").split("|")] for line in text.splitlines() if line.startswith("|")]


def _smollm2_bench_table(script: str, argv: list[str], out) -> tuple[str, list[str], list[list[str]]]:
    """Run ``bench/<script>.py``'s main on the SmolLM2 pair (skip without it) writing its table to ``out``; it must
    exit 0. Returns the file's text, the table's header and its rows."""
    from dflash_apps import smollm2

    if smollm2.unavailable_reason():
        pytest.skip(smollm2.unavailable_reason())
    module = bench_module(script)
    assert module.main([*argv, "--out", str(out)]) == 0
    text = out.read_text(encoding="utf-8")
    cells = _markdown_cells(text)
    return text, cells[0], cells[2:]


def test_tree_bench_smoke(tmp_path, capsys):
    """bench/tree.py on the SmolLM2 pair at its smallest: HF generate, the chain and one tree budget, one
    held-out prompt; every row's output identical to HF's, the markdown table written."""
    text, header, table = _smollm2_bench_table(
        "tree", ["--budgets", "3", "--prompts", "1", "--max-new-tokens", "6", "--reps", "1", "--threads", "1",
                 "--without-native", "--without-amx"], tmp_path / "tree.md")
    rows = {r[0]: r for r in table}
    assert set(rows) == {"HF generate", "chain", "tree 3", "chain (torch formulas)", "tree 3 (torch formulas)",
                         "chain (fp32 GEMM)", "tree 3 (fp32 GEMM)"}, text
    assert os.environ.get("DFLASH_CPU_NATIVE") is None, "the bench must restore the environment"
    from dflash_kernels.cpu import linear as cpu_linear

    assert cpu_linear.set_amx(True) is True, "the bench must restore the AMX setting"
    for r in rows.values():
        assert r[header.index("identical_to_hf")] == "yes" and r[header.index("vs_hf")].endswith("x"), text
    assert "shipped draft" in text


@pytest.mark.slow
def test_tree_bench_prompt_sets_and_sampling(tmp_path):
    """--prompt-set picks the prompts (natural by default) and the header names the set; sampled runs (temperature
    0.7, top-p 0.9) report τ and speed with "n/a" for identity; a bad set or count is refused before any model
    loads."""
    tree = bench_module("tree")
    from dflash_apps.train.natural_prompts import natural_eval_prompts
    from dflash_apps.train.prompts import eval_prompts

    argv = ["--budgets", "2", "--prompts", "1", "--max-new-tokens", "5", "--reps", "1", "--threads", "1"]
    text, header, table = _smollm2_bench_table("tree", argv + ["--temperature", "0.7", "--top-p", "0.9"],
                                               tmp_path / "sampled.md")
    assert "temperature 0.7, top-p 0.9, 1 natural-set prompts" in text
    assert [r[header.index("identical_to_hf")] for r in table] == ["n/a"] * 3, text
    assert all(float(r[header.index("tau")]) >= 1 for r in table[1:]), text
    text, header, table = _smollm2_bench_table("tree", argv + ["--prompt-set", "template"], tmp_path / "t.md")
    assert "greedy, 1 template-set prompts" in text
    assert [r[header.index("identical_to_hf")] for r in table] == ["yes"] * 3, text
    assert natural_eval_prompts(1) != eval_prompts(1)
    n = len(natural_eval_prompts())
    with pytest.raises(ValueError, match=f"number of prompts must be in 1..{n} for the natural set, got {n + 1}"):
        tree.main(["--prompts", str(n + 1), "--out", str(tmp_path / "never.md")])
    with pytest.raises(SystemExit):
        tree.main(["--prompt-set", "wild"])
    assert not (tmp_path / "never.md").exists()


@pytest.mark.slow
def test_tree_bench_compares_drafts(tmp_path):
    """Two drafts in one run: each gets its chain and budgets, labelled by folder, vs_chain against its own chain."""
    from dflash_apps import smollm2

    if smollm2.unavailable_reason():
        pytest.skip(smollm2.unavailable_reason())
    tree = bench_module("tree")

    other = tmp_path / "other-draft"
    shutil.copytree(tree.DRAFT, other)
    out = tmp_path / "tree.md"
    assert tree.main(["--budgets", "2", "--prompts", "1", "--max-new-tokens", "5", "--reps", "1", "--threads", "1",
                      "--draft", str(tree.DRAFT), "--draft", str(other), "--out", str(out)]) == 0
    text = out.read_text(encoding="utf-8")
    cells = _markdown_cells(text)
    header, rows = cells[0], {r[0]: r for r in cells[2:]}
    assert set(rows) == {"HF generate", "shipped draft: chain", "shipped draft: tree 2", "other-draft: chain",
                         "other-draft: tree 2"}, text
    for lab in ("shipped draft", "other-draft"):  # the same weights: the same tokens and rounds
        assert rows[f"{lab}: chain"][header.index("vs_chain")] == "1.00x", text
        assert rows[f"{lab}: tree 2"][header.index("tau")] == rows["shipped draft: tree 2"][header.index("tau")]
    with pytest.raises(SystemExit, match="different names"):
        tree.main(["--draft", str(tree.DRAFT), "--draft", str(tree.DRAFT)])


@pytest.mark.slow
def test_tree_bench_runs_a_dflash2_draft_as_a_chain(tmp_path):
    """A DFlash2 draft beside the shipped DFlash draft: its chain only (no trees from a DFlash2 draft), named as
    DFlash2 in the header, output identical to HF's."""
    import dataclasses

    from dflash import DFlash2DraftModel, DFlashConfig
    from dflash.config import DFlash2Settings
    from dflash_apps import smollm2

    if smollm2.unavailable_reason():
        pytest.skip(smollm2.unavailable_reason())
    tree = bench_module("tree")
    base = DFlashConfig.from_json_file(tree.DRAFT)
    config = dataclasses.replace(base, draft_vocab_size=None, dflash2=DFlash2Settings(2, 16, 8, 8))
    DFlash2DraftModel(config).save_pretrained(tmp_path / "d2")
    out = tmp_path / "tree.md"
    assert tree.main(["--budgets", "2", "--prompts", "1", "--max-new-tokens", "5", "--reps", "1", "--threads", "1",
                      "--draft", str(tree.DRAFT), "--draft", str(tmp_path / "d2"), "--out", str(out)]) == 0
    text = out.read_text(encoding="utf-8")
    cells = _markdown_cells(text)
    header, rows = cells[0], {r[0]: r for r in cells[2:]}
    assert set(rows) == {"HF generate", "shipped draft: chain", "shipped draft: tree 2", "d2: chain"}, text
    assert all(r[header.index("identical_to_hf")] == "yes" for r in rows.values()), text
    assert "d2 (DFlash2, 2 layers, B = 8)" in text


def test_cpu_forward_bench_smoke(tmp_path):
    """bench/cpu_forward.py at one row, one rep: every setting of the native kernels, the AMX path and the
    bf16-packed weights, every part's column, the native forward, the weights' floor (halved for bf16 storage); the
    environment restored."""
    # a 16 MiB read: the suite's process must stay small (test_traffic bounds its peak memory)
    text, header, rows = _smollm2_bench_table(
        "cpu_forward", ["--rows", "1", "--reps", "1", "--threads", "1", "--read-mib", "16"], tmp_path / "forward.md")
    from dflash_kernels.cpu import linear as cpu_linear

    amx = ["native + AMX"] if cpu_linear.amx_active() else []
    assert [r[header.index("cpu kernels")] for r in rows] == amx + ["native, bf16-packed GEMM", "native, fp32 GEMM",
                                                                    "torch formulas"], text
    assert all(float(r[header.index(c)]) > 0 for r in rows
               for c in ("whole_ms", "native_forward_ms", "weights_floor_ms")), text
    floors = [float(r[header.index("weights_floor_ms")]) for r in rows]
    assert floors[len(amx)] < floors[-1], text  # bf16 bytes under fp32's
    assert "MiB" in text and os.environ.get("DFLASH_CPU_NATIVE") is None


@pytest.mark.slow
def test_greedy_head_bench_smoke(tmp_path):
    """bench/greedy_head.py at its smallest, on the bf16-packed route (--without-amx): two row counts, one rep, a
    short context; both heads timed (the run itself asserts the screened argmax equals the logits' argmax) and the
    int8 screen's exact groups counted."""
    from dflash_kernels.cpu import linear as cpu_linear

    rows_arg = f"1,{cpu_linear.INT8_SCREEN_MAX_ROWS}"  # (past that row count the whole head: no exact groups)
    text, header, rows = _smollm2_bench_table(
        "greedy_head", ["--rows", rows_arg, "--reps", "1", "--context", "24", "--threads", "1", "--without-amx"],
        tmp_path / "head.md")
    assert [r[header.index("rows")] for r in rows] == rows_arg.split(",") and "AMX off" in text, text
    assert all(float(r[header.index("logits_then_argmax_ms")]) > 0 and float(r[header.index("screened_argmax_ms")]) > 0
               for r in rows), text
    if cpu_linear.available():
        assert all(1 <= float(r[header.index("exact_groups_a_row")]) < 3072 for r in rows), text


@pytest.mark.slow
def test_first_call_bench_smoke(tmp_path):
    """bench/first_call.py at its smallest: one round of fresh processes (HF, trees of 3), a few tokens; outputs
    identical, the table written."""
    text, header, table = _smollm2_bench_table(
        "first_call", ["--pairs", "1", "--tree-budgets", "3", "--max-new-tokens", "6", "--threads", "1"],
        tmp_path / "first.md")
    rows = {r[0]: r for r in table}
    assert set(rows) == {"HF generate", "DFlash tree 3"}, text
    assert all(r[header.index("identical_to_hf")] == "yes" for r in rows.values()), text
    assert rows["DFlash tree 3"][header.index("vs_hf_first")].endswith("x"), text

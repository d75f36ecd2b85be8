"""bench/gpu_check.sh, the one script for a GPU session: its CPU dry run (the caps within the budget, every step's
plumbing and rows written as it runs, the summary last, at most 8 files under $OUT), its budget skip, one build
only, the toolchain checks it starts with, and the row log the benchmarks write as they go."""
from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.bench import bench_module

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_check.sh"
toolchain = bench_module("toolchain")

STEPS = ["caps", "toolchain", "build", "prewarm", "graphs_e2e", "ext_gpu", "kernels_real", "step_latency",
         "draft_latency", "e2e", "kernels"]
NVCC_13_0 = "nvcc: NVIDIA (R) Cuda compiler driver\nCuda compilation tools, release 13.0, V13.0.88\n"


@pytest.mark.parametrize("nvcc,text,cuda,status,words", [
    ("/cuda/bin/nvcc", NVCC_13_0, "13.0", 0, ["ok: nvcc 13.0 (/cuda/bin/nvcc)", "CUDA 13.0"]),
    ("/cuda/bin/nvcc", NVCC_13_0, "13.2", 0, ["WARNING", "nvcc 13.0", "CUDA 13.2", "minor"]),
    ("/cuda/bin/nvcc", NVCC_13_0.replace("13.0", "12.8"), "13.0", 2,
     ["MISMATCH", "nvcc 12.8", "CUDA 13.0", "CUDA_HOME to a CUDA 13.x toolkit", "build is skipped"]),
    ("/cuda/bin/nvcc", "garbage", "13.0", 1, ["no 'release X.Y'", "garbage"]),
    (None, None, "13.0", 1, ["no nvcc found", "CUDA_HOME"]),
    ("/cuda/bin/nvcc", NVCC_13_0, None, 1, ["CPU-only build"]),
])
def test_toolchain_compare(nvcc, text, cuda, status, words):
    got, report = toolchain.compare(nvcc, text, "2.11.0", cuda)
    assert got == status, report
    for w in words:
        assert w in report, (w, report)


def run_script(out: Path, **env) -> subprocess.CompletedProcess:
    full = {**os.environ, "GPU_CHECK_DRY_RUN": "1", "OUT": str(out), "PY": sys.executable, **env}
    return subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=full, capture_output=True, text=True, timeout=300)


def steps(out: Path) -> list[dict]:
    with open(out / "steps.tsv", newline="") as f:
        return [dict(zip(("step", "status", "seconds", "note"), row)) for row in csv.reader(f, delimiter="\t")]


@pytest.mark.slow
def test_dry_run(tmp_path):
    """The CPU dry run: the caps add up to the budget, every step after the build runs and writes rows while it
    runs (the rows journal), the commit comes from DFLASH_COMMIT, at most 8 files come back, the summary is last."""
    proc = run_script(tmp_path, DFLASH_COMMIT="feedbeef")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    all_rows = steps(tmp_path)
    rows = {r["step"]: r for r in all_rows if not r["step"].startswith("prewarm/")}
    assert list(rows) == STEPS
    assert rows["caps"]["status"] == "ok" and "of the 420s budget" in rows["caps"]["note"], rows["caps"]
    assert rows["toolchain"]["status"] == "NO-CUDA" and "CPU-only" in rows["toolchain"]["note"]  # CPU torch here
    assert rows["build"]["status"] == "SKIPPED" and "setup.py build_ext --inplace" in rows["build"]["note"]
    for name in STEPS[3:]:
        assert rows[name]["status"] == "ok", rows[name]
        assert int(re.match(r"rows (\d+)", rows[name]["note"]).group(1)) >= 1, rows[name]
    jobs = {r["step"]: r["status"] for r in all_rows if r["step"].startswith("prewarm/")}
    assert jobs == {f"prewarm/{j}": "ok" for j in ("tests_graphs", "tests_kernels", "tests_ext", "step_latency",
                                                   "draft_latency", "e2e", "kernels")}, jobs
    assert re.search(r"\b1 passed\b", rows["graphs_e2e"]["note"]) and "skipped" in rows["ext_gpu"]["note"]
    # the summary comes last: tables, the steps, the toolchain line, the verdict
    out = proc.stdout
    assert out.index("################ summary") < out.index("== draft and verify steps vs the H200 prediction") \
        < out.index("== end to end") < out.index("== steps")
    assert "commit feedbeef" in out
    assert out.rstrip().splitlines()[-1].startswith(f"gpu_check: {len(STEPS) - 2} ok, 1 skipped, 1 with a problem")
    # what the device tool brings back: at most 8 plain files, none in a subfolder, no partial file left over
    files = sorted(p.name for p in tmp_path.iterdir())
    assert all((tmp_path / f).is_file() for f in files) and len(files) <= 8, files
    assert {"gpu_check.log", "steps.tsv", "tests.csv", "step_latency-gpu_check.csv", "draft_latency-gpu_check.csv",
            "e2e-gpu_check.csv", "kernels-gpu_check.csv"} <= set(files)
    with open(tmp_path / "tests.csv", newline="") as f:
        tests = list(csv.DictReader(f))
    assert {t["step"] for t in tests} == {"graphs_e2e", "ext_gpu", "kernels_real"}
    assert all(t["test"].startswith("tests/gpu/test_gpu.py::") for t in tests if t["step"] != "ext_gpu"), tests
    assert all(t["outcome"] in ("passed", "skipped") for t in tests)
    with open(tmp_path / "kernels-gpu_check.csv", newline="") as f:
        assert {r["commit"] for r in csv.DictReader(f)} == {"feedbeef"}
    log = (tmp_path / "gpu_check.log").read_text()
    assert "commit: feedbeef" in log and "== kernels_real (timeout" in log and "prewarm job tests_ext" in log


def test_caps_add_up_to_the_budget_or_the_run_says_so(tmp_path):
    """Under a budget smaller than the caps' sum the caps row is a problem and every step is SKIPPED (with the
    reason), the summary still printed."""
    proc = run_script(tmp_path, GPU_CHECK_BUDGET_S="1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = steps(tmp_path)
    assert [r["step"] for r in rows] == STEPS
    assert rows[0]["status"] == "OVER-BUDGET" and "410s, over the 1s budget" in rows[0]["note"]
    for r in rows[3:]:
        assert r["status"] == "SKIPPED" and "of the 1s budget left" in r["note"], r
    assert "== steps" in proc.stdout and proc.stdout.rstrip().splitlines()[-1].startswith("gpu_check: 0 ok")


@pytest.mark.parametrize("cxx,text,has_h,ok,words", [
    ("/usr/bin/g++", "g++ (Debian 12.2.0-14) 12.2.0\nCopyright", True, True, ["g++ (Debian 12.2.0-14) 12.2.0", "/inc"]),
    (None, None, True, False, ["no host C++ compiler", "skipped"]),
    ("/usr/bin/g++", "g++ 12", False, False, ["no Python.h in /inc", "development headers", "skipped"]),
])
def test_toolchain_host_prerequisites(cxx, text, has_h, ok, words):
    got, report = toolchain.host_prerequisites(cxx, text, "/inc", has_h)
    assert got == ok, report
    for w in words:
        assert w in report, (w, report)


def test_one_build_only():
    """No step after `build` compiles again: no second setup.py/pip/CMake/nvcc build, and tests/ext
    runs without its two build checks."""
    code = [line for line in SCRIPT.read_text().splitlines() if not line.lstrip().startswith("#")]
    builds = [line for line in code if re.search(r"build_ext|pip install|\bcmake\b|\bnvcc |csrc/tests/gpu_check", line)]
    assert len(builds) == 1 and "BUILD=(" in builds[0], builds
    ext = [line for line in code if "tests/ext" in line]
    assert len(ext) == 1 and "-m gpu" in ext[0] and "not nvcc_compiles and not cmake_build" in ext[0], ext


def test_row_log_is_on_disk_after_every_row(tmp_path):
    """A benchmark killed at its timeout leaves every finished row: each row rewrites the partial CSV."""
    common = bench_module("common")

    partial = tmp_path / "x.partial.csv"
    rows = common.RowLog(partial, {"commit": "abc"})
    for i in range(3):
        rows.append({"i": i, "_seq": [1, 2], **({"late": "y"} if i == 2 else {})})
        with open(partial, newline="") as f:
            got = list(csv.DictReader(f))
        assert [r["i"] for r in got] == [str(j) for j in range(i + 1)] and all(r["commit"] == "abc" for r in got)
        assert "_seq" not in got[0]
    assert got[-1]["late"] == "y" and got[0]["late"] == ""
    rows[0]["done"] = 1  # a row completed in place later
    rows.flush()
    with open(partial, newline="") as f:
        assert next(csv.DictReader(f))["done"] == "1"
    final = rows.finish(tmp_path / "x.csv")
    assert not partial.exists() and final.read_text().count("\n") == 4

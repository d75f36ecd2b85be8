"""Build checks: torch-free CUDA sources compile with plain nvcc (sm_90), the C ABI header is plain C,
and the CMake build (host + CUDA libraries, ctest) works. Nothing here needs a GPU."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_kernels import _ext

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "csrc"
CU_FILES = sorted(CSRC.rglob("*.cu"))
CUDA_HOME = _ext._cuda_home()
NVCC = os.path.join(CUDA_HOME, "bin", "nvcc") if CUDA_HOME else None
ARCHS = [a for a in re.split(r"[;,\s]+", os.environ.get("DFLASH_CUDA_ARCHS", "90")) if a]


def _run(cmd, **kw):
    proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc


def test_cuda_sources_are_torch_free():
    assert CU_FILES, "no .cu files found under csrc/"
    for f in CU_FILES + [CSRC / "include" / "dflash_kernels.h", CSRC / "include" / "dflash_kernels_detail.h"]:
        includes = re.findall(r'#\s*include\s*[<"]([^>"]+)[>"]', f.read_text())
        bad = [i for i in includes if i.split("/")[0] in ("torch", "ATen", "c10", "caffe2", "pybind11", "Python.h")]
        assert not bad, f"{f.relative_to(ROOT)} includes {bad}: .cu files and the C ABI must stay torch-free"


@pytest.mark.skipif(NVCC is None, reason="nvcc not found (set CUDA_HOME or put nvcc on PATH): CUDA compile check skipped")
@pytest.mark.parametrize("cu", CU_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_nvcc_compiles_torch_free_cu(cu, tmp_path):
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in ARCHS]
    _run([NVCC, "-std=c++17", "-O3", *gencode, f"-I{CSRC / 'include'}", "-Werror", "all-warnings",
          "-c", str(cu), "-o", str(tmp_path / "k.o")])
    assert (tmp_path / "k.o").stat().st_size > 0


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")
def test_c_abi_header_is_plain_c():
    src = CSRC / "tests" / "abi_is_plain_c.c"
    cc = shutil.which("cc") or shutil.which("gcc")
    _run([cc, "-std=c99", "-Wall", "-Werror", "-pedantic", f"-I{CSRC / 'include'}", "-fsyntax-only", str(src)])


@pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake not found: CMake build + ctest skipped")
def test_cmake_build_and_ctest(tmp_path):
    build = tmp_path / "build"
    cfg = ["cmake", "-S", str(ROOT), "-B", str(build), f"-DDFLASH_CUDA_ARCHS={';'.join(ARCHS)}"]
    if shutil.which("ninja"):
        cfg += ["-G", "Ninja"]
    if NVCC:
        cfg += [f"-DCMAKE_CUDA_COMPILER={NVCC}"]
    if os.environ.get("DFLASH_TEST_CMAKE_TORCH") == "1":  # +~40 s: also build/load the torch ops library
        import torch.utils

        cfg += ["-DDFLASH_TORCH=ON", f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}",
                f"-DDFLASH_TEST_PYTHON={sys.executable}"]
    else:
        cfg += ["-DDFLASH_TORCH=OFF"]
    _run(cfg)
    _run(["cmake", "--build", str(build), "-j", os.environ.get("MAX_JOBS", "2")])
    out = _run(["ctest", "--test-dir", str(build), "--output-on-failure"]).stdout
    assert "100% tests passed" in out, out
    if NVCC:
        assert any(build.glob("libdflash_kernels_cuda*")), "the CUDA library was not built"


def test_cuda_home_follows_wrapper_scripts(tmp_path, monkeypatch):
    """nvcc on PATH may be a shell wrapper (`exec /opt/cuda-x/bin/nvcc "$@"`): the toolkit root is
    the wrapped nvcc's, not the wrapper's parent (torch's guess)."""
    root = tmp_path / "cuda-13.0"
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "nvcc").write_bytes(b"\x7fELF fake")
    (root / "bin" / "nvcc").chmod(0o755)
    wrapper_dir = tmp_path / "wrap" / "bin"
    wrapper_dir.mkdir(parents=True)
    (wrapper_dir / "nvcc").write_text(f'#!/bin/sh\nexec {root}/bin/nvcc "$@"\n')
    (wrapper_dir / "nvcc").chmod(0o755)
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("PATH", str(wrapper_dir))
    assert _ext._cuda_home() == str(root)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "nowhere"))  # invalid: ignored
    assert _ext._cuda_home() == str(root)
    monkeypatch.setenv("CUDA_HOME", str(root))
    assert _ext._cuda_home() == str(root)

"""First step of bench/gpu_check.sh: can the extension build run here? It needs an nvcc of the CUDA major
version torch was built with (torch's extension builder refuses another major version and only warns about
another minor one), a host C++ compiler for nvcc and torch's headers, and the Python headers (``Python.h``).
Each is reported on its own line, then one verdict line, before the build.

Usage: python bench/toolchain.py   (prints the versions, the toolkit root, g++ and the Python include dir, then the
verdict)
Exit status: 0 the build can go ahead (same version, or only the minor differs: a warning is printed);
1 no CUDA build is possible (CPU-only torch, or no nvcc found); 2 major-version mismatch; 3 no host compiler or
no Python.h.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def nvcc_release(version_text: str) -> tuple[int, int] | None:
    """(major, minor) from ``nvcc --version`` output ('... release 13.0, V13.0.88'), else None."""
    m = re.search(r"release (\d+)\.(\d+)", version_text)
    return (int(m.group(1)), int(m.group(2))) if m else None


def compare(nvcc: str | None, nvcc_version_text: str | None, torch_version: str, torch_cuda: str | None) -> tuple[int, str]:
    """(exit status, one-line report) for an nvcc path and its ``--version`` text against torch's CUDA."""
    if torch_cuda is None:
        return 1, f"torch {torch_version} is a CPU-only build: no CUDA extension can be built"
    if nvcc is None:
        return 1, (f"no nvcc found for torch {torch_version} (CUDA {torch_cuda}): set CUDA_HOME to a CUDA "
                   f"{torch_cuda.split('.')[0]}.x toolkit root")
    have = nvcc_release(nvcc_version_text or "")
    if have is None:
        return 1, f"{nvcc} --version printed no 'release X.Y': {(nvcc_version_text or '').strip()[-200:]!r}"
    want = tuple(int(x) for x in torch_cuda.split(".")[:2])
    line = f"nvcc {have[0]}.{have[1]} ({nvcc}) vs torch {torch_version} built with CUDA {torch_cuda}"
    if have[0] != want[0]:
        return 2, (f"MISMATCH: {line}: torch refuses to build extensions across CUDA major versions; "
                   f"set CUDA_HOME to a CUDA {want[0]}.x toolkit (the extension build is skipped)")
    if have != want:
        return 0, f"WARNING: {line}: minor versions differ (torch builds anyway; a link or runtime error would point here)"
    return 0, f"ok: {line}"


def host_prerequisites(cxx: str | None, cxx_version_text: str | None, python_include: str,
                       has_python_h: bool) -> tuple[bool, str]:
    """(whether the host side of the build can run, one-line report) for the C++ compiler found (its path and
    ``--version`` text) and the Python include directory."""
    problems = []
    if cxx is None:
        problems.append("no host C++ compiler (g++ or $CXX) on PATH")
    if not has_python_h:
        problems.append(f"no Python.h in {python_include} (install the Python development headers)")
    first = (cxx_version_text or "").strip().splitlines()[:1]
    line = f"host compiler {cxx} ({first[0] if first else 'no version'}), Python headers {python_include}"
    if problems:
        return False, "; ".join(problems) + ": the extension build is skipped"
    return True, line


def find_cuda_home() -> str | None:
    """The toolkit setup.py builds with: $CUDA_HOME, else the nvcc on PATH (wrappers resolved), else
    /usr/local/cuda. gpu_check.sh exports the printed ``cuda_home`` as CUDA_HOME, so the build uses
    the nvcc checked here."""
    sys.path.insert(0, str(ROOT))
    from dflash_kernels._ext import _cuda_home

    home = _cuda_home()
    if home is None and (Path("/usr/local/cuda") / "bin" / "nvcc").exists():
        home = "/usr/local/cuda"
    return home


def main() -> int:
    from importlib.metadata import version

    import torch

    print(f"python {sys.version.split()[0]} torch {torch.__version__} (CUDA {torch.version.cuda}) "
          f"triton {version('triton')} transformers {version('transformers')}")
    home = find_cuda_home()
    print(f"cuda_home: {home or ''}")
    nvcc = str(Path(home) / "bin" / "nvcc") if home else None
    text = None
    if nvcc is not None and torch.version.cuda is not None:
        proc = subprocess.run([nvcc, "--version"], capture_output=True, text=True)
        text = proc.stdout + proc.stderr
    status, report = compare(nvcc, text, torch.__version__, torch.version.cuda)
    cxx = shutil.which(os.environ.get("CXX", "g++"))
    cxx_text = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout if cxx else None
    include = sysconfig.get_paths()["include"]
    host_ok, host_report = host_prerequisites(cxx, cxx_text, include, (Path(include) / "Python.h").is_file())
    print(f"host: {host_report}")
    if status == 0 and not host_ok:
        status, report = 3, f"{report}; {host_report}"
    print(f"toolchain: {report}")
    return status


if __name__ == "__main__":
    sys.exit(main())

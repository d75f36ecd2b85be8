import os
import re
import subprocess
import sys

import pytest
import triton

SCRIPT = os.path.join(os.path.dirname(__file__), "aot_compile_sm90.py")
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
PACKAGE = os.path.join(os.path.dirname(__file__), "..", "..", "dflash_kernels")


def _launched_kernels() -> set[str]:
    """Names of the @triton.jit functions the launchers launch (``*_kernel``; the others are jit helpers)."""
    names = set()
    for f in os.listdir(PACKAGE):
        if f.endswith(".py"):
            src = open(os.path.join(PACKAGE, f)).read()
            names |= set(re.findall(r"@triton\.jit(?:\([^)]*\))?\s*\ndef (\w+_kernel)\(", src))
    return names


@pytest.mark.skipif(not os.path.exists(PTXAS), reason="Triton's bundled ptxas is missing")
def test_every_kernel_compiles_for_sm90():
    """The interpreter does not check GPU compile rules; build every kernel's cubin for sm_90 instead."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    listed = subprocess.run([sys.executable, SCRIPT, "--list"], env=env, capture_output=True, text=True, timeout=300)
    assert listed.returncode == 0, listed.stdout[-3000:] + listed.stderr[-3000:]
    plan = [line.split("\t", 1) for line in listed.stdout.splitlines() if line.strip()]
    kernels = _launched_kernels()
    assert len(kernels) >= 10, kernels  # the source scan itself works
    assert kernels <= {name for name, _ in plan}, f"kernels with no sm_90 compile config: {kernels - {n for n, _ in plan}}"
    res = subprocess.run([sys.executable, SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    for _, label in plan:  # one " ok " line per planned config, whatever their number
        assert re.search(rf"^{re.escape(label)}\s+ok ", res.stdout, re.M), (label, res.stdout)
    assert res.stdout.count(" ok ") == len(plan), res.stdout

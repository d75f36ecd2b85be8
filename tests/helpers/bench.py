"""The benchmark scripts of bench/ as modules, for the tests that run or inspect them in-process."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[2] / "bench"


def bench_module(name: str) -> ModuleType:
    """``bench/<name>.py`` imported as the module ``name`` (once: later calls return the same module). bench/ is not
    a package: the scripts find their sibling modules (``common``) themselves, as they do when run as scripts."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]

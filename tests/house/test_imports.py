"""The packages import in layers: no module reaches itself through imports (function-level imports
included), and the kernel library never imports the runtime."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("dflash", "dflash_kernels")
COMPILED = ("dflash_kernels._C",)  # extension modules: they import nothing of ours


def module_names() -> dict[str, Path | None]:
    names = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            names[".".join(parts)] = path
    return names | {name: None for name in COMPILED}


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports anywhere in its body.

    ``from pkg import name`` points at ``pkg.name`` when that is a module, else at ``pkg``; the
    implicit import of a module's parent packages is not an edge (every submodule would then close a
    circle through its package's ``__init__``)."""
    modules = module_names()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        if path is None:
            continue
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 = on the current path, 2 = finished
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_circles():
    cycle = find_cycle(import_graph())
    assert cycle is None, " -> ".join(cycle)


def test_the_checker_finds_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


INTEGRATIONS = "dflash_kernels.integrations"  # adapters for other engines: above the kernels and the runtime


def test_kernel_library_does_not_import_the_runtime():
    """The ops never import the runtime; only the integrations (which bring the runtime's checkpoint rules to
    another engine) may, and nothing but the engines' plugin hooks imports them."""
    graph = import_graph()
    offenders = {m: sorted(t for t in targets if t.split(".")[0] == "dflash")
                 for m, targets in graph.items()
                 if m.split(".")[0] == "dflash_kernels" and not m.startswith(INTEGRATIONS)}
    assert not any(offenders.values()), offenders
    importers = {m for m, targets in graph.items() for t in targets
                 if t.startswith(INTEGRATIONS) and not m.startswith(INTEGRATIONS)}
    assert not importers, importers

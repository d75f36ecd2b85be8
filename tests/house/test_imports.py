"""The packages import in layers: no module reaches itself through imports (function-level imports
included), the kernel library (its CPU wing included) never imports the runtime, and the runtime reaches the
kernels by their public names only. The op files name no backend in their code: each backend's wing registers its
bodies with the dispatcher."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("dflash_apps", "dflash", "dflash_kernels")
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


def imports_into(graph: dict[str, set[str]], importer, target) -> dict[str, list[str]]:
    """module -> the imports it makes that match, for the modules ``importer(name)`` selects and the targets
    ``target(name)`` selects (only modules with such imports)."""
    found = {m: sorted(t for t in targets if target(t)) for m, targets in graph.items() if importer(m)}
    return {m: targets for m, targets in found.items() if targets}


def test_the_import_filter_finds_an_import():
    graph = {"dflash.engine": {"dflash_kernels._dispatch", "dflash_kernels.tree"}, "dflash.api": {"dflash.engine"}}
    assert imports_into(graph, lambda m: m.startswith("dflash."), private_kernel_module) == {
        "dflash.engine": ["dflash_kernels._dispatch"]}


INTEGRATIONS = "dflash_kernels.integrations"  # adapters for other engines, loaded by their plugin hooks


def test_kernel_library_does_not_import_the_runtime():
    """The kernel library, the integrations included, never imports the runtime or the apps (what both need, e.g.
    the RoPE rule of a config, lives in the kernels); nothing but the engines' plugin hooks imports the
    integrations."""
    graph = import_graph()
    offenders = imports_into(graph, lambda m: m.split(".")[0] == "dflash_kernels",
                             lambda t: t.split(".")[0] in ("dflash", "dflash_apps"))
    assert not offenders, offenders
    importers = {m for m, targets in graph.items() for t in targets
                 if t.startswith(INTEGRATIONS) and not m.startswith(INTEGRATIONS)}
    assert not importers, importers


def in_runtime(module: str) -> bool:
    return module.split(".")[0] == "dflash"


def private_kernel_module(module: str) -> bool:
    """A module of the kernel library that is not public: some part of its dotted name starts with ``_``."""
    parts = module.split(".")
    return parts[0] == "dflash_kernels" and any(p.startswith("_") for p in parts[1:])


def test_cpu_wing_does_not_import_the_runtime():
    """The CPU wing is part of the kernels: it builds on the ops and the native code, never on the runtime."""
    offenders = imports_into(import_graph(), lambda m: m.startswith("dflash_kernels.cpu"), in_runtime)
    assert not offenders, offenders
    assert "dflash_kernels.cpu.attention" in import_graph()  # the wing is where this test looks


def test_runtime_imports_no_private_kernel_module():
    """The runtime uses what ``dflash_kernels`` exports (``unobserved_eager``, ``backend_traits``, the ops and the
    wing's modules), never a private ``_`` module of it (``_dispatch``, ``_triton_utils``, ``_ext``)."""
    offenders = imports_into(import_graph(), in_runtime, private_kernel_module)
    assert not offenders, offenders


def backend_names_in_code(path: Path) -> list[str]:
    """The places where the file's code (not its docstrings) names the ``"cpu"`` backend: the string anywhere but
    in a device check (``x.device.type == "cpu"``) or a default device argument."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Constant) and node.value == "cpu"):
            continue
        parent = parents[node]
        device_check = isinstance(parent, ast.Compare) and any(
            isinstance(side, ast.Attribute) and side.attr == "type" for side in [parent.left, *parent.comparators])
        if not (device_check or isinstance(parent, ast.arguments)):
            found.append((node.lineno, f"{path.name}:{node.lineno}: {ast.unparse(parent)}"))
    return [hit for _, hit in sorted(found)]


DISPATCHER = "_dispatch.py"  # the one place that resolves backends by name
BUILD = "_ext.py"  # the native build's description: which sources a CPU or a CUDA build compiles


def test_op_files_do_not_branch_on_the_cpu_backend():
    """Each op's CPU body lives in the CPU wing and is registered there; the op files branch on no backend name."""
    found = [hit for path in sorted((ROOT / "dflash_kernels").glob("*.py")) if path.name not in (DISPATCHER, BUILD)
             for hit in backend_names_in_code(path)]
    assert not found, found


def test_the_backend_finder_tells_branches_from_device_checks(tmp_path):
    source = tmp_path / "op.py"
    source.write_text('"""The "cpu" backend."""\n'
                      'def f(x, chosen, device="cpu"):\n'
                      '    if x.device.type == "cpu":\n'
                      '        return 1\n'
                      '    if chosen == "cpu":\n'
                      '        return 2\n'
                      'BACKENDS = ("triton", "cpu")\n', encoding="utf-8")
    assert backend_names_in_code(source) == ["op.py:5: chosen == 'cpu'", "op.py:7: ('triton', 'cpu')"]

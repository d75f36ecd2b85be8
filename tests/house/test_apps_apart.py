"""The applications live in ``dflash_apps``, apart from the runtime: the runtime ``dflash`` and the ops library
``dflash_kernels`` never reach the apps (by an import statement or a module name in a string), the runtime
package holds Python modules only, every ``dflash`` subcommand is a function of ``dflash_apps``, and a built
wheel ships the apps' assets in ``dflash_apps`` and points the ``dflash`` console script at it."""
from __future__ import annotations

import ast
import importlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from dflash_apps import cli

ROOT = Path(__file__).resolve().parents[2]
APPS = "dflash_apps"
LOWER = ("dflash", "dflash_kernels")  # the runtime and the ops library: below the apps


def names_of_apps(path: Path) -> list[str]:
    """Every place in ``path`` that names the apps package: imported modules and string constants (an
    ``importlib.import_module("dflash_apps...")`` or a ``"dflash_apps.x:f"`` entry), as ``line: name``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = [node.value]
        else:
            continue
        found += [f"{node.lineno}: {name}" for name in names if name == APPS or name.startswith(APPS + ".")]
    return found


def test_the_checker_sees_imports_and_module_strings(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("import dflash_apps.demo\nfrom dflash_apps import cli\nx = 'dflash_apps.zlab_cli:main'\n"
                      "import dflash_kernels\ny = 'dflash_apps_like'\n")
    assert names_of_apps(source) == ["1: dflash_apps.demo", "2: dflash_apps", "3: dflash_apps.zlab_cli:main"]


@pytest.mark.parametrize("package", LOWER)
def test_runtime_and_kernels_do_not_reach_the_apps(package):
    offenders = {str(path.relative_to(ROOT)): names for path in sorted((ROOT / package).rglob("*.py"))
                 if (names := names_of_apps(path))}
    assert not offenders, offenders


def test_runtime_package_is_python_modules_only():
    """Assets, data and the apps' modules belong to dflash_apps: the runtime folder holds .py files only."""
    tracked = subprocess.run(["git", "ls-files", "dflash"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    assert tracked and not [name for name in tracked if not name.endswith(".py")], tracked
    moved = {"cli", "zlab_cli", "demo", "smollm2", "train"}
    assert not {Path(name).parts[1].removesuffix(".py") for name in tracked} & moved, tracked


@pytest.mark.parametrize("command", sorted(cli.SUBCOMMANDS))
def test_every_subcommand_is_a_function_of_the_apps(command):
    module, function = cli.SUBCOMMANDS[command][0].split(":")
    assert module.split(".")[0] == APPS, module
    assert callable(getattr(importlib.import_module(module), function))


def test_wheel_ships_the_apps_with_their_assets(tmp_path):
    """A wheel built from the tracked files (pure Python: DFLASH_BUILD_EXT=0): every tracked asset is inside
    dflash_apps, the runtime ships no app module and no data, and ``dflash`` runs dflash_apps.cli:main."""
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split("\0")
    src = tmp_path / "src"
    for name in filter(None, tracked):
        if name.split("/")[0] in ("setup.py", "pyproject.toml", "README.md", "dflash", APPS, "dflash_kernels"):
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            (src / name).write_bytes((ROOT / name).read_bytes())
    env = {**os.environ, "DFLASH_BUILD_EXT": "0"}
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                           "--disable-pip-version-check", "-w", str(tmp_path / "dist"), str(src)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    with zipfile.ZipFile(wheel) as z:
        shipped = set(z.namelist())
        entry_points = next(z.read(n).decode() for n in shipped if n.endswith(".dist-info/entry_points.txt"))
    assets = {name for name in tracked if name.startswith(f"{APPS}/assets/")}
    assert assets and assets <= shipped, sorted(assets - shipped)
    runtime = sorted(name for name in shipped if name.startswith("dflash/"))
    assert runtime == sorted(name for name in tracked if name.startswith("dflash/")), runtime
    assert "dflash = dflash_apps.cli:main" in entry_points.splitlines(), entry_points

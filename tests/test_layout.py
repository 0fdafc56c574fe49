"""The package layout shows the data flow: numerics -> training -> verdicts -> reports -> jobs ->
(commands, cli, plugin, __init__). A module may import its own package and those before it, never one after;
numerics imports nothing else of precision_suite. Every import counts, function-local and
TYPE_CHECKING ones too (docs/architecture.md)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import precision_suite

PACKAGE_ROOT = Path(precision_suite.__file__).resolve().parent
# rank of each layer; the leaf modules files and version import nothing of the package
ORDER = {
    "files": 0,
    "version": 0,
    "numerics": 1,
    "training": 2,
    "verdicts": 3,
    "reports": 4,
    "jobs": 5,
    "commands": 6,
    "cli": 6,
    "plugin": 6,
    "__init__": 6,
}
PACKAGES = ("numerics", "training", "verdicts", "reports", "jobs")


def layer(dotted: str) -> str:
    """The layer of a module `precision_suite.<layer>[.<module>]`; "__init__" for the package itself."""
    parts = dotted.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imported_modules(source: str) -> list[tuple[int, str]]:
    """(line, dotted name) of every precision_suite module `source` imports, at any depth."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [
                (node.lineno, alias.name)
                for alias in node.names
                if alias.name.split(".")[0] == "precision_suite"
            ]
        elif (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and node.module
            and node.module.split(".")[0] == "precision_suite"
        ):
            if node.module == "precision_suite":  # `from precision_suite import x`: x may be a layer
                found += [
                    (node.lineno, f"precision_suite.{alias.name}")
                    if alias.name in ORDER
                    else (node.lineno, "precision_suite")
                    for alias in node.names
                ]
            else:
                found.append((node.lineno, node.module))
        elif isinstance(node, ast.ImportFrom) and node.level > 0:
            found.append((node.lineno, "<relative import>"))
    return found


def module_layer(path: Path) -> str:
    relative = path.relative_to(PACKAGE_ROOT)
    return relative.parts[0] if len(relative.parts) > 1 else relative.stem


def violations(path: Path, source: str | None = None) -> list[str]:
    """What `path` (or `source`, as if it were that module) imports against the order."""
    own = module_layer(path)
    problems = []
    for line, name in imported_modules(path.read_text(encoding="utf-8") if source is None else source):
        where = f"{path.relative_to(PACKAGE_ROOT.parent)}:{line} imports {name}"
        if name == "<relative import>":
            problems.append(f"{where}: write absolute imports")
        elif own == "numerics" and layer(name) != "numerics":
            problems.append(f"{where}: numerics imports nothing else of precision_suite")
        elif ORDER[layer(name)] > ORDER[own] or (ORDER[own] == 0 and name != f"precision_suite.{own}"):
            problems.append(f"{where}: {own} may not import {layer(name)}, which comes after it")
    return problems


MODULES = sorted(PACKAGE_ROOT.rglob("*.py"))


def test_every_module_has_a_layer():
    assert {module_layer(path) for path in MODULES} <= set(ORDER)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE_ROOT)))
def test_imports_flow_one_way(path):
    assert violations(path) == []


def test_a_planted_upward_import_is_caught():
    planted = PACKAGE_ROOT / "training" / "planted.py"
    source = "import numpy\n\n\ndef f():\n    from precision_suite.verdicts import judge\n"
    assert violations(planted, source) == [
        "precision_suite/training/planted.py:5 imports precision_suite.verdicts: "
        "training may not import verdicts, which comes after it"
    ]
    assert violations(PACKAGE_ROOT / "numerics" / "planted.py", "from precision_suite import files\n")


@pytest.mark.parametrize("package", PACKAGES)
def test_each_package_imports(package):
    importlib.import_module(f"precision_suite.{package}")

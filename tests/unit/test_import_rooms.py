"""Rooms import down only (issues 28, 39): the base package ``zserve`` (public API, protocol, config, client, the
models, the batching policy, the generator) never imports the broker, the workers, the frontends or the deployment;
and those four never import one another. Read from the source with ``ast``, so an import inside a function counts as
much as one at the top, and so does a module named to ``importlib.import_module`` as a string constant (naming a
module hides no edge)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "zserve"
UPPER = ("zserve.broker", "zserve.workers", "zserve.frontends", "zserve.deploy")
# Each room's folder and its package, and the rooms above or beside it that it must not import. The base room is
# zserve/ without the four rooms' folders, and without cli.py: the command line is the top, it may import any room.
ROOMS = {
    "zserve": (PKG, set(UPPER)),
    "zserve.broker": (PKG / "broker", {"zserve.workers", "zserve.frontends", "zserve.deploy"}),
    "zserve.workers": (PKG / "workers", {"zserve.broker", "zserve.frontends", "zserve.deploy"}),
    "zserve.frontends": (PKG / "frontends", {"zserve.broker", "zserve.workers", "zserve.deploy"}),
    # deployment names the processes it starts by module name (argv strings), never by import
    "zserve.deploy": (PKG / "deploy", {"zserve.broker", "zserve.workers", "zserve.frontends"}),
}
NOT_BASE = [PKG / "cli.py", *(PKG / room.rsplit(".", 1)[1] for room in UPPER)]
KNOWN_EDGES: set[tuple[str, str]] = set()


def _module_name(path: Path, folder: Path, package: str) -> str:
    parts = list(path.relative_to(folder).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([package, *parts])


def imported_modules(path: Path, module: str) -> set[str]:
    """Every module ``path`` (module ``module``) imports, anywhere in it: absolute names, relative ones
    resolved, ``from zserve import broker`` as ``zserve.broker``, and string constants given to import_module."""
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")
                keep = len(parts) - node.level + (1 if is_package else 0)
                base = ".".join(parts[:keep] + ([base] if base else []))
            out.add(base)
            out.update(f"{base}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                out.add(node.args[0].value)
    return out


def _known(edge: tuple[str, str]) -> bool:
    return any(edge[0] == rel and (edge[1] == name or edge[1].startswith(name + ".")) for rel, name in KNOWN_EDGES)


def _violations(package: str) -> list[tuple[str, str]]:
    folder, above = ROOMS[package]
    found = []
    for path in sorted(folder.rglob("*.py")):
        if package == "zserve" and any(path == other or other in path.parents for other in NOT_BASE):
            continue
        rel = str(path.relative_to(ROOT))
        for name in imported_modules(path, _module_name(path, folder, package)):
            if any(name == room or name.startswith(room + ".") for room in above):
                found.append((rel, name))
    return found


@pytest.mark.parametrize("package", list(ROOMS))
def test_a_room_imports_no_room_above_or_beside_it(package):
    unexpected = [edge for edge in _violations(package) if not _known(edge)]
    assert not unexpected, f"{package} imports what it must not (file, module): {unexpected}"


def test_known_edges_still_exist():
    """A known edge that is gone is taken off the list, so that it cannot come back unnoticed."""
    found = {edge for package in ROOMS for edge in _violations(package)}
    assert KNOWN_EDGES <= found, f"gone, remove from KNOWN_EDGES: {KNOWN_EDGES - found}"


def test_the_reader_sees_imports_inside_functions_and_relative_ones(tmp_path):
    source = tmp_path / "mod.py"
    source.write_text(
        "import importlib\n"
        "def f():\n"
        "    from zserve.generator.generator import Generator\n"
        "    from zserve import broker\n"
        "    from . import frontends\n"
        "    return importlib.import_module('zserve.frontends.app')\n"
    )
    names = imported_modules(source, "zserve.mod")
    assert {"zserve.generator.generator", "zserve.broker", "zserve.frontends", "zserve.frontends.app"} <= names

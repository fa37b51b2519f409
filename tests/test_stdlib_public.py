"""The package uses the standard library through its public API only.

No ``_``-prefixed name of ``multiprocessing``, ``concurrent.futures``, ``threading``,
``atexit`` or ``asyncio`` (their modules, or their objects' attributes), and no
assignment into those modules: what works only because of an interpreter's
internals breaks on its next release. Failures name file:line.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest

import aioloader

pytestmark = pytest.mark.timeout(60)

PKG = Path(aioloader.__file__).resolve().parent
ROOTS = ("multiprocessing", "concurrent.futures", "threading", "atexit", "asyncio")
# Documented names that start with an underscore: namedtuple's API, os._exit.
DOCUMENTED = {"_fields", "_replace", "_asdict", "_make", "_field_defaults", "_exit"}


def _modules() -> list[object]:
    found = []
    for root in ROOTS:
        mod = importlib.import_module(root)
        found.append(mod)
        for info in pkgutil.walk_packages(getattr(mod, "__path__", []), f"{root}."):
            try:
                found.append(importlib.import_module(info.name))
            except ImportError:  # a platform's own module (Windows, for instance)
                continue
    return found


def _own_names() -> set[str]:
    """The private attributes aioloader's own objects set (``self._lock = ...``)."""
    names: set[str] = set()
    for path in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and node.attr.startswith("_"):
                if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                    names.add(node.attr)
    return names


def _private_names() -> set[str]:
    """Every single-underscore name of those modules and of the classes they define,
    but those aioloader's own objects have too, and the documented ones."""
    return _stdlib_private() - _own_names() - DOCUMENTED


def _stdlib_private() -> set[str]:
    names: set[str] = set()
    for mod in _modules():
        for name, obj in vars(mod).items():
            if name.startswith("_") and not name.startswith("__"):
                names.add(name)
            if inspect.isclass(obj) and obj.__module__ == getattr(mod, "__name__", None):
                names.update(n for n in dir(obj) if n.startswith("_") and not n.startswith("__"))
                # attributes set in __init__ (self._processes = ...) are not in dir(cls)
                try:
                    src = inspect.getsource(obj)
                except (OSError, TypeError):
                    continue
                for node in ast.walk(ast.parse(_dedent(src))):
                    if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                        names.add(node.attr)
    return names


def _dedent(src: str) -> str:
    import textwrap

    return textwrap.dedent(src)


def _stdlib_aliases(tree: ast.AST) -> set[str]:
    """Names a module binds to those standard modules (``import threading``,
    ``import concurrent.futures as cf``, ``from multiprocessing import util``)."""
    aliases: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if any(a.name == r or a.name.startswith(r + ".") for r in ROOTS):
                    aliases.add(a.asname or a.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if any(node.module == r or node.module.startswith(r + ".") or r.startswith(node.module + ".") for r in ROOTS):
                for a in node.names:
                    aliases.add(a.asname or a.name)
    return aliases


def _root(node: ast.expr) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def offences(path: Path, private: set[str]) -> list[str]:
    tree = ast.parse(path.read_text())
    aliases = _stdlib_aliases(tree)
    where = path.relative_to(PKG.parent) if path.is_relative_to(PKG.parent) else path.name
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if any(node.module == r or node.module.startswith(r + ".") for r in ROOTS):
                for a in node.names:
                    if a.name.startswith("_"):
                        found.append(f"{where}:{node.lineno}: from {node.module} import {a.name}")
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            base = node.value
            own = isinstance(base, ast.Name) and base.id in ("self", "cls")
            if (_root(node) in aliases and node.attr not in DOCUMENTED) or (node.attr in private and not own):
                found.append(f"{where}:{node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) >= 2:
                arg = node.args[1]
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value in private:
                    found.append(f"{where}:{node.lineno}: {node.func.id}(..., {arg.value!r})")
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Attribute) and _root(t) in aliases:
                    found.append(f"{where}:{node.lineno}: assigns {ast.unparse(t)} (patches the standard library)")
    return found


def test_no_private_name_of_the_standard_library() -> None:
    private = _private_names()
    assert "_processes" in private and "_register_atexit" in private  # the scan sees what it must
    bad = [o for path in sorted(PKG.rglob("*.py")) for o in offences(path, private)]
    assert not bad, "private standard-library names used:\n" + "\n".join(bad)


def test_the_scan_catches_each_kind(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "import threading\nimport concurrent.futures as cf\nfrom multiprocessing import forkserver\n"
        "from multiprocessing.util import _exit_function\n"
        "threading._register_atexit(print)\n"
        "def f(ex):\n    return ex._processes, getattr(ex, '_max_workers', 0)\n"
        "forkserver.os = None\n"
        "class Own:\n    def __init__(self):\n        self._processes = 1\n"
    )
    got = offences(sample, _private_names())
    text = "\n".join(got)
    for needle in ("import _exit_function", "._register_atexit", "._processes", "'_max_workers'", "assigns forkserver.os"):
        assert needle in text, (needle, text)
    assert ":11:" not in text  # an object's own private attribute is its business

"""House rules: the public surface is pinned, and imports flow one way."""

from __future__ import annotations

import ast
from pathlib import Path

import aioloader

PKG = Path(aioloader.__file__).resolve().parent
# Code that runs inside workers must not need an event loop.
WORKER_SIDE = [
    "_worker.py",
    "_seeding.py",
    "_collate.py",
    "_sampler.py",
    "errors.py",
    "recordio.py",
    "transforms.py",
    # the shared-memory package: workers import all of it (the encoder names the decoder)
    "_shm/__init__.py",
    "_shm/_names.py",
    "_shm/_mapping.py",
    "_shm/_arena.py",
    "_shm/_encode.py",
    "_shm/_decode.py",
]


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.add(("." * node.level) + (node.module or ""))
    return names


def test_public_names_sorted_complete_and_public_module() -> None:
    assert aioloader.__all__ == sorted(aioloader.__all__)
    for name in aioloader.__all__:
        obj = getattr(aioloader, name)
        assert not getattr(obj, "__module__", "aioloader").startswith("aioloader._"), name
    public = {n for n in dir(aioloader) if not n.startswith("_") and n[0].isupper()}
    assert public <= set(aioloader.__all__) | {"DataLoader"}


def test_worker_side_modules_never_import_asyncio() -> None:
    for name in WORKER_SIDE:
        path = PKG / name
        if path.exists():
            bad = {m for m in imports_of(path) if m.split(".")[0] in ("asyncio", "uvloop")}
            assert not bad, f"{name} imports {bad}"



def test_every_shared_memory_module_is_checked() -> None:
    listed = {n for n in WORKER_SIDE if n.startswith("_shm/")}
    assert {f"_shm/{p.name}" for p in (PKG / "_shm").glob("*.py")} == listed

def test_package_ships_py_typed() -> None:
    assert (PKG / "py.typed").exists()

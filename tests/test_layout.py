"""House rules: the public surface is pinned, and imports flow one way."""

from __future__ import annotations

import ast
import importlib
import pickle
import types
from pathlib import Path

import aioloader

PKG = Path(aioloader.__file__).resolve().parent
# Code that runs inside workers must not need an event loop.
# The formats layer (_formats/) is worker-side as a whole, and so are its public faces.
# So is the shared-memory package (workers import all of it: the encoder names the decoder).
WORKER_SIDE = [
    "_worker/*.py",
    "_seeding.py",
    "_validate.py",
    "_collate.py",
    "_plan/*.py",
    "errors.py",
    "recordio.py",
    "datasets.py",
    "transforms.py",
    "_formats/*.py",
    "_shm/*.py",
]
# Public modules that re-export the formats layer, and the names each must keep.
PUBLIC_FACES = {
    "aioloader.recordio": [
        "MAGIC",
        "MAX_RECORD_SIZE",
        "Buffer",
        "IRHeader",
        "IndexedRecordReader",
        "IndexedRecordWriter",
        "RecordIOError",
        "RecordReader",
        "RecordWriter",
        "StrPath",
        "pack_header",
        "unpack_header",
    ],
    "aioloader.datasets": [
        "IMG_EXTENSIONS",
        "ImageDecodeError",
        "ImageFolder",
        "ImageRecordDataset",
        "Label",
        "RecordFileDataset",
        "RecordIOError",
        "StrPath",
        "SyntheticJpegDataset",
        "Transform",
    ],
    "aioloader.transforms": [
        "CenterCrop",
        "Compose",
        "ImageLike",
        "Interpolation",
        "Normalize",
        "RandomHorizontalFlip",
        "RandomResizedCrop",
        "Resize",
        "ToArray",
        "sample_rng",
    ],
    "aioloader.sources": ["follow_lines", "read_files", "watch_folder"],
    "aioloader.io": [
        "BucketNotFoundError",
        "NoCredentialsError",
        "ObjectStore",
        "ObjectStoreError",
        "StoreSetupError",
        "StoreTimeoutError",
        "TransientStoreError",
        "read_file",
    ],
}


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
    paths = [p for pattern in WORKER_SIDE for p in sorted(PKG.glob(pattern))]
    assert PKG / "_formats" / "rio_read.py" in paths
    for path in paths:
        bad = {m for m in imports_of(path) if m.split(".")[0] in ("asyncio", "uvloop")}
        assert not bad, f"{path.relative_to(PKG)} imports {bad}"


def test_formats_layer_imports_only_below_it() -> None:
    # Bytes on disk -> samples: the formats layer needs nothing of the loaders or the CLI.
    for path in sorted((PKG / "_formats").glob("*.py")):
        for name in imports_of(path):
            if name.startswith("..") and not name.startswith("..."):
                assert name in ("..errors", ".._seeding"), f"{path.name} imports {name}"
            assert not name.startswith("aioloader"), f"{path.name} imports {name} (use a relative import)"


def test_cli_is_imported_by_nothing_but_main() -> None:
    for path in sorted(PKG.rglob("*.py")):
        if path.parent.name == "_cli" or path.name == "__main__.py":
            continue
        assert not any("_cli" in name for name in imports_of(path)), (
            f"{path.relative_to(PKG)} imports the CLI"
        )


def test_public_faces_keep_their_names_and_say_so() -> None:
    for module, names in PUBLIC_FACES.items():
        mod = importlib.import_module(module)
        missing = [n for n in names if not hasattr(mod, n)]
        assert not missing, f"{module} lost {missing}"
        for name in mod.__all__:
            obj = getattr(mod, name)
            if isinstance(obj, (type, types.FunctionType)):
                # reprs, tracebacks and pickles name the public module, not the private one
                assert obj.__module__ in (module, "aioloader.errors"), (module, name, obj.__module__)
                assert pickle.loads(pickle.dumps(obj)) is obj


def test_package_ships_py_typed() -> None:
    assert (PKG / "py.typed").exists()


def _module_graph() -> dict[str, set[str]]:
    """Module -> the aioloader modules it imports, at any depth of its code."""
    mods: dict[str, Path] = {}
    for path in PKG.rglob("*.py"):
        parts = path.relative_to(PKG.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = path
    graph: dict[str, set[str]] = {name: set() for name in mods}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text())
        typing_only = {
            id(n)
            for block in ast.walk(tree)
            if isinstance(block, ast.If) and ast.unparse(block.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
            for n in ast.walk(block)
        }
        for node in ast.walk(tree):
            if id(node) in typing_only:  # for annotations only: no import at run time
                continue
            found: list[str] = []
            if isinstance(node, ast.Import):
                found = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*up, base] if base else up)
                found = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            graph[name].update(t for t in found if t in mods and t != name and t != "aioloader")
    return graph


def test_no_import_circle() -> None:
    graph = _module_graph()
    state: dict[str, int] = {}

    def visit(name: str, trail: list[str]) -> None:
        state[name] = 1
        for dep in sorted(graph[name]):
            if state.get(dep) == 1:
                cycle = trail[trail.index(dep) :] if dep in trail else [dep]
                raise AssertionError("import circle: " + " -> ".join([*cycle, dep]))
            if dep not in state:
                visit(dep, [*trail, dep])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


def test_imports_flow_down_faces_engine_pool_worker_side() -> None:
    # The pool never reaches up into the engine or a face; the engine never into a face.
    graph = _module_graph()
    faces = {"aioloader.loader", "aioloader.stream", "aioloader.serving", "aioloader._facade", "aioloader._iterloader"}
    for name, deps in graph.items():
        if name.startswith("aioloader._pool"):
            bad = {d for d in deps if d.startswith("aioloader._engine") or d in faces}
            assert not bad, f"{name} imports {bad}"
        if name.startswith("aioloader._engine"):
            assert not deps & faces, f"{name} imports {deps & faces}"
        if name.startswith("aioloader._worker"):
            # The worker side needs only what lies below it: shared memory, seeding,
            # the errors. Nothing of the consumer's side.
            bad = {d for d in deps if not d.startswith(WORKER_BELOW)}
            assert not bad, f"{name} imports {bad}"
    assert any(name.startswith("aioloader._worker.") for name in graph)


# What the worker package may import, besides itself.
WORKER_BELOW = ("aioloader._worker", "aioloader._shm", "aioloader._seeding", "aioloader.errors")

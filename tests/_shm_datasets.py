"""Datasets, containers and worker functions for the shared-memory transport tests.
Module level, so that forkserver and spawn workers can import them."""

from __future__ import annotations

import os
import sys
import zlib
from collections import OrderedDict, namedtuple
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from aioloader import _shm

from ._datasets import wait_to_be_killed


class Meta(NamedTuple):
    index: int
    vec: np.ndarray


def image(i: int, shape: tuple[int, ...] = (3, 64, 64), dtype: Any = np.float32) -> np.ndarray:
    """A sample whose every byte depends on ``i`` and on its position."""
    n = int(np.prod(shape))
    return ((np.arange(n, dtype=np.int64) * 7 + i * 1_000_003) % 251).astype(dtype).reshape(shape)


class ImageDataset:
    """Sample i: a large float32 image (48 KiB) and its index."""

    def __init__(self, n: int, shape: tuple[int, ...] = (3, 64, 64)) -> None:
        self.n = n
        self.shape = shape

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"img": image(i, self.shape), "label": i}


class NestedDataset:
    """Every kind of leaf and container default_collate handles, large and small."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {
            "img": image(i, (3, 64, 64), np.uint8),
            "pair": (image(i, (4,), np.float32), image(i, (32, 32), np.float64)),
            "meta": Meta(i, image(i, (64, 128), np.int16)),
            "od": OrderedDict([("z", image(i, (2, 4096), np.int32)), ("a", float(i))]),
            "label": i,
            "name": f"sample-{i}",
            "lst": [image(i, (8192,), np.float16), None],
        }


def odd_collate(samples: list[dict[str, Any]]) -> Any:
    """A user collate_fn whose output has Fortran-ordered, strided, nested and repeated arrays."""
    imgs = np.stack([s["img"] for s in samples])
    return OrderedDict(
        [
            ("fortran", np.asfortranarray(imgs.reshape(len(samples), -1))),
            ("strided", imgs[:, :, 1:, ::2]),
            ("plain", imgs),
            ("small", np.array([s["label"] for s in samples])),
            ("nested", [(imgs * 2, "x")]),
            ("again", imgs),  # the same array as "plain"
        ]
    )


class Bomb:
    """Blocks the worker while it pickles its result, i.e. after the batch was written
    into shared memory and before the descriptor left: the state a worker dies in when
    it is killed mid-write. The first one to be pickled writes ``marker`` (its pid) and
    blocks until the process is killed; later ones (the retry) pickle as a string."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        try:
            fd = os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        except FileExistsError:
            return (str, ("bomb",))
        with os.fdopen(fd, "w") as f:
            f.write(str(os.getpid()))
        wait_to_be_killed(120)
        return (str, ("bomb",))


class BombDataset(ImageDataset):
    """ImageDataset whose sample ``bomb_index`` carries a :class:`Bomb`."""

    def __init__(self, n: int, marker: str, bomb_index: int = 0) -> None:
        super().__init__(n)
        self.marker = marker
        self.bomb_index = bomb_index

    def __getitem__(self, i: int) -> dict[str, Any]:
        sample = super().__getitem__(i)
        sample["tag"] = Bomb(self.marker) if i == self.bomb_index else None
        return sample


CONSUMER_SCRIPT = """
import sys
from aioloader import DataLoader
from tests._shm_datasets import BombDataset

if __name__ == "__main__":
    ds = BombDataset(64, sys.argv[1], bomb_index=0)
    with DataLoader(ds, batch_size=8, num_workers=2, prefetch=4, transport="shm") as loader:
        for batch in loader:
            pass
"""


# ----------------------------------------------------------------------------- checks
def shm_backed(a: Any) -> bool:
    """Whether array ``a`` views a slab (its ``base`` chain ends in the slab's export),
    or tensor ``a``'s memory lies in a slab this process has mapped."""
    if not isinstance(a, np.ndarray):
        ptr = a.data_ptr()
        slabs = list(_shm._decode._slabs.values())
        return any(s.addr <= ptr < s.addr + s.mapping.size for s in slabs)
    base: Any = a
    while base is not None:
        if type(base) is _shm._Export:
            return True
        base = getattr(base, "base", None)
    return False


def assert_same(a: Any, b: Any, path: str = "batch") -> None:
    """Same structure, container types and their attributes, dtypes, shapes, memory
    order and bytes."""
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    torch = sys.modules.get("torch")
    if isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert a.flags.c_contiguous == b.flags.c_contiguous, path
        assert a.flags.f_contiguous == b.flags.f_contiguous, path
        if a.dtype.hasobject:
            assert a.tolist() == b.tolist(), path
        else:
            assert a.tobytes(order="A") == b.tobytes(order="A"), path
    elif torch is not None and isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape, a.stride(), a.requires_grad) == (
            b.dtype,
            b.shape,
            b.stride(),
            b.requires_grad,
        ), path
        assert torch.equal(a, b), path
    elif isinstance(a, Mapping):
        assert list(a) == list(b), path
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for k, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{k}]")
    else:
        assert a == b, path
    if not isinstance(a, np.ndarray) and hasattr(a, "__dict__"):
        assert vars(a) == vars(b), f"{path}: attributes differ"


# ------------------------------------------------------------------ collate exactness
Pair = namedtuple("Pair", "a b")


class PairWithDict(Pair):
    """A namedtuple subclass whose instances have a ``__dict__``: still built by the
    generated ``__new__``, so its large leaves may be stacked into shared memory."""


class PairCustomNew(Pair):
    """Its ``__new__`` records what it was given: built from placeholders instead of the
    stacked arrays, ``kind`` would say so."""

    def __new__(cls, a: Any, b: Any) -> PairCustomNew:
        self = super().__new__(cls, a, b)
        self.kind = type(a).__name__
        return self


class Tagged(dict):  # type: ignore[type-arg]
    """A mapping whose constructor looks at its values (as a user's class may)."""

    def __init__(self, items: Any) -> None:
        super().__init__(items)
        self.kinds = {k: type(v).__name__ for k, v in self.items()}


class TaggedList(list):  # type: ignore[type-arg]
    """A list subclass: ``default_collate`` turns a batch of them into a plain list."""


def collate_in_worker(encoder: _shm.ShmEncoder, samples: Sequence[Any]) -> Any:
    """What a worker does with ``default_collate`` under ``transport="shm"``."""
    return encoder(_shm.ShmCollate(encoder)(samples))


# Schemas, drawn by the tests: a leaf is ``(kind, *params)``, a container is
# ``(kind, children)`` with children a list (sequences, pairs) or a list of
# ``(key, child)`` (mappings). A mutation ``(position, path, how)`` alters the node at
# ``path`` in the sample at batch ``position``, so that batches may mismatch.
CONTAINERS = {
    "list": list,
    "tuple": tuple,
    "tlist": TaggedList,
    "dict": dict,
    "od": OrderedDict,
    "tagged": Tagged,
    "pair": Pair,
    "pair_dict": PairWithDict,
    "pair_new": PairCustomNew,
}
MAPPINGS = ("dict", "od", "tagged")


def paths(schema: Any, path: str = "") -> list[str]:
    """Every node's path in ``schema``, the root's being ``""``."""
    out = [path]
    if schema[0] in CONTAINERS:
        kids = schema[1] if schema[0] in MAPPINGS else enumerate(schema[1])
        for key, child in kids:
            out += paths(child, f"{path}/{key}")
    return out


def _leaf(schema: Any, seed: int, how: str | None) -> Any:
    kind = schema[0]
    if how == "type":
        return 7
    if kind in ("array", "tensor", "pil"):
        _, shape, dtype = schema
        if how == "shape":
            shape = (*shape[:-1], shape[-1] + 1) if shape else (2,)
        if how == "dtype":
            dtype = {"array": "<f8", "tensor": "float64", "pil": "RGB"}[kind]
        if kind == "pil":
            from PIL import Image

            channels = {"L": 1, "RGB": 3}[dtype]
            raw = (np.arange(shape[0] * shape[1] * channels) * 7 + seed) % 251
            return Image.frombytes(dtype, shape, raw.astype(np.uint8).tobytes())
        data = (np.arange(int(np.prod(shape)), dtype=np.int64) * 7 + seed) % 97
        if kind == "array":
            return data.astype(dtype).reshape(shape)
        import torch

        return torch.from_numpy(data.reshape(shape).copy()).to(getattr(torch, dtype))
    from fractions import Fraction

    return {
        "int": lambda: seed % 1000,
        "float": lambda: seed / 7,
        "bool": lambda: seed % 2 == 0,
        "np_float": lambda: np.float32(seed % 1000),
        "fraction": lambda: Fraction(seed % 1000, 7),
        "str": lambda: f"s{seed}",
        "bytes": lambda: b"b%d" % seed,
        "none": lambda: None,
        "range": lambda: range(seed % 5),
    }[kind]()


def _node(schema: Any, pos: int, path: str, mutation: tuple[int, str, str] | None) -> Any:
    how = mutation[2] if mutation is not None and mutation[:2] == (pos, path) else None
    kind = schema[0]
    if kind not in CONTAINERS:
        return _leaf(schema, zlib.crc32(f"{pos}{path}".encode()), how)
    if how == "type":
        return 7
    cls = CONTAINERS[kind]
    if kind in MAPPINGS:
        items = [(k, _node(c, pos, f"{path}/{k}", mutation)) for k, c in schema[1]]
        if how == "structure":
            items = items[1:] if items else [("z", 1)]
        return cls(items)
    values = [_node(c, pos, f"{path}/{k}", mutation) for k, c in enumerate(schema[1])]
    if how == "structure":
        return (*values, 1)
    return cls(*values) if kind.startswith("pair") else cls(values)


def build_samples(schema: Any, n: int, mutation: tuple[int, str, str] | None) -> list[Any]:
    """``n`` samples following ``schema``, each with its own values."""
    return [_node(schema, pos, "", mutation) for pos in range(n)]


def collate_built(
    encoder: _shm.ShmEncoder, schema: Any, n: int, mutation: tuple[int, str, str] | None
) -> Any:
    """:func:`collate_in_worker` on samples built here: tensors are made in the worker
    rather than sent to it (sending them would start torch's fd-sharing thread in the
    test process)."""
    return collate_in_worker(encoder, build_samples(schema, n, mutation))

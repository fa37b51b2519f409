"""Datasets for the shared-memory transport tests. Module level, so that forkserver and
spawn workers can import them."""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from typing import Any, NamedTuple

import numpy as np


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
    """A user collate_fn whose output has Fortran-ordered, strided and nested arrays."""
    imgs = np.stack([s["img"] for s in samples])
    return OrderedDict(
        [
            ("fortran", np.asfortranarray(imgs.reshape(len(samples), -1))),
            ("strided", imgs[:, :, 1:, ::2]),
            ("plain", imgs),
            ("small", np.array([s["label"] for s in samples])),
            ("nested", [(imgs * 2, "x")]),
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
        # Wait to be killed. Bounded, so that a broken test cannot hang forever.
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            time.sleep(0.01)
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

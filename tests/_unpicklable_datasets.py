"""Datasets and functions whose samples, or whose own members, will not pickle.

Module-level, so that worker processes import them by name."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class Meta:
    id: int
    lock: Any = None


class LockInSample:
    """Sample ``i``: ``{"x": [i, i, i], "meta": Meta(i)}``; sample ``bad``'s ``Meta`` holds a lock."""

    def __init__(self, n: int, bad: int) -> None:
        self.n = n
        self.bad = bad

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        lock = threading.Lock() if i == self.bad else None
        return {"x": np.full(3, i, dtype=np.int64), "meta": Meta(i, lock)}


def lock_at_six(x: int) -> dict[str, Any]:
    """A stream's ``fn``: item 6's result holds a lock."""
    return {"x": x, "lock": threading.Lock() if x == 6 else None}


class HoldsAFile:
    """A dataset that keeps a file open in ``self.files['labels']`` (text or binary)."""

    def __init__(self, path: str, mode: str) -> None:
        self.files = {"labels": open(path, mode)}  # kept open: the point of the test

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        return i

    def close(self) -> None:
        self.files["labels"].close()


class FileReader:
    """A stream's ``fn`` that keeps a file open (``self.handle``)."""

    def __init__(self, path: str, mode: str) -> None:
        self.handle = open(path, mode)  # kept open: the point of the test

    def __call__(self, x: int) -> int:
        return x


try:
    from torch.utils.data import IterableDataset
except ImportError:  # pragma: no cover - the tests that need it skip
    IterableDataset = object  # type: ignore[assignment,misc]


class LockInStream(IterableDataset):  # type: ignore[misc]
    """Ten samples ``{"x": i, "lock": ...}``; sample 6 holds a lock."""

    def __iter__(self) -> Any:
        for i in range(10):
            yield {"x": i, "lock": threading.Lock() if i == 6 else None}

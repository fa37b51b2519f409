"""Datasets and worker functions for ``bench_suite.py``.

They live in an importable module (not in the script) because worker processes started
with ``forkserver`` or ``spawn`` must find them by name when they unpickle the dataset.
"""

from __future__ import annotations

import time
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Barrier
from typing import Any

import numpy as np

__all__ = ["Head", "IntDataset", "jpeg_dataset", "load_batch", "produce_only", "set_worker_dataset"]


class IntDataset:
    """``n`` samples that are just their own index: measures the loader, not the data."""

    def __init__(self, n: int) -> None:
        self.n = int(n)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        if not 0 <= index < self.n:
            raise IndexError(index)
        return int(index)


class Head:
    """The first ``n`` samples of ``dataset``."""

    def __init__(self, dataset: Any, n: int) -> None:
        self.dataset = dataset
        self.n = min(int(n), len(dataset))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> Any:
        if not 0 <= index < self.n:
            raise IndexError(index)
        return self.dataset[index]


def jpeg_dataset(root: str, limit: int | None = None) -> Any:
    """The demo's workload: decode a JPEG, random-resized-crop to 224, random flip."""
    from aioloader._formats.synthetic import train_transform
    from aioloader.datasets import ImageFolder

    ds = ImageFolder(root, transform=train_transform())
    return ds if limit is None else Head(ds, limit)


def produce_only(
    dataset: Any,
    indices: np.ndarray,
    passes: int,
    barrier: Barrier,
    out: Queue[tuple[float, float, int]],
) -> None:
    """The bound: build every sample of ``indices`` ``passes`` times and send nothing back.

    Runs in a forked process; one warm-up sample first, then waits on ``barrier`` so that
    all producers start together, and reports ``(start, end, samples)``.
    """
    dataset[int(indices[0])]
    barrier.wait()
    start = time.perf_counter()
    n = 0
    for _ in range(passes):
        for i in indices:
            dataset[int(i)]
            n += 1
    out.put((start, time.perf_counter(), n))


# The dataset of this worker process, set once by the pool's initializer (SPDL's process
# pool in ``_bench_peers``), so that a task carries only its indices.
_worker_dataset: Any = None


def set_worker_dataset(dataset: Any) -> None:
    """Process-pool initializer: keep ``dataset`` for :func:`load_batch`."""
    global _worker_dataset
    _worker_dataset = dataset


def load_batch(indices: np.ndarray) -> Any:
    """Build and collate (numpy, as aioloader does) the samples at ``indices``."""
    from aioloader import default_collate

    return default_collate([_worker_dataset[int(i)] for i in indices])

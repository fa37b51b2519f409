"""The cold-start workload's dataset: its module imports torch, as most real dataset
modules do (a transform, a tensor conversion), so that a worker that imports it afresh
pays for torch's import before its first batch."""

from __future__ import annotations

import torch  # the import is the point (and ShardedInts uses it)
from _bench_datasets import IntDataset


class TorchModuleInts(IntDataset):
    """Ints, from a module that imports torch."""


class ShardedInts(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    """``0..n-1`` as an iterable dataset, split between the workers as torch's docs show
    (worker ``w`` of ``k`` yields ``w, w + k, ...``)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):  # type: ignore[no-untyped-def]
        info = torch.utils.data.get_worker_info()
        w, k = (0, 1) if info is None else (info.id, info.num_workers)
        return iter(range(w, self.n, k))

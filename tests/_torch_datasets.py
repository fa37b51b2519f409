"""Datasets that use torch. torch is imported at module level, as a real torch dataset's
module would: aioloader seeds torch's generator only once torch is imported."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ._datasets import RangeDataset


class TorchAugmentedDataset(RangeDataset):
    def __getitem__(self, i: int) -> Any:
        return torch.rand(3) + i, i


class NumpyTorchDataset(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """A torch dataset whose samples are numpy and Python numbers, as many torch
    datasets are: ``size`` floats per sample (64x64 of them reach shared memory)."""

    def __init__(self, n: int, size: int = 3) -> None:
        self.n = n
        self.size = size

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return {"x": np.full(self.size, i, dtype=np.float32), "y": i % 4, "w": i / 2, "name": f"s{i}"}


class MixedSamples(RangeDataset):
    """Not a torch dataset: a tensor beside a numpy array and Python numbers."""

    def __getitem__(self, i: int) -> Any:
        return torch.full((2,), float(i)), np.arange(3, dtype=np.int16) + i, i, float(i)


class WorkerInfoDataset(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Each sample reports what ``torch.utils.data.get_worker_info()`` says where it loads."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        info = torch.utils.data.get_worker_info()
        if info is None:
            return {"i": i, "id": -1, "num_workers": -1, "seed": -1, "same": False}
        return {
            "i": i,
            "id": info.id,
            "num_workers": info.num_workers,
            "seed": info.seed,
            "same": type(info.dataset) is WorkerInfoDataset and info.dataset.n == self.n,
        }


_seen_at_init: tuple[int, int, int] | None = None


def record_worker_info(worker_id: int) -> None:
    """A worker_init_fn that keeps what get_worker_info() said, for InitSeenDataset."""
    global _seen_at_init
    info = torch.utils.data.get_worker_info()
    _seen_at_init = (worker_id, info.id, info.num_workers) if info is not None else (worker_id, -1, -1)


class InitSeenDataset(RangeDataset):
    def __getitem__(self, i: int) -> Any:
        return _seen_at_init


def describe_sample(sample: Any) -> tuple[str, int]:
    """A collate_fn for batch_size=None: it must be given the sample itself."""
    return type(sample).__name__, len(sample)


class CountingIterable(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    """A torch IterableDataset that also defines __len__ (which torch allows)."""

    def __len__(self) -> int:
        return 3

    def __iter__(self) -> Any:
        return iter(range(3))

"""Datasets that use torch. torch is imported at module level, as a real torch dataset's
module would: aioloader seeds torch's generator only once torch is imported."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ._datasets import RangeDataset, first_to_claim, wait_to_be_killed


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


class ShardedRange(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    """``0..n-1``, split between the workers by ``get_worker_info()`` as torch's docs show;
    samples ``(tensor([i.]), i)``. ``log``: a file each sample's index is appended to as
    it is produced; ``fail_at``: raise ``ValueError`` instead of producing that sample;
    ``kill_at``: SIGKILL the worker at that sample, once (``marker`` says it happened)."""

    def __init__(
        self,
        n: int,
        *,
        log: str | None = None,
        fail_at: int | None = None,
        kill_at: int | None = None,
        marker: str | None = None,
        block_at: int | None = None,
        has_len: bool = True,
    ) -> None:
        self.n = n
        self.log = log
        self.fail_at = fail_at
        self.kill_at = kill_at
        self.marker = marker
        self.block_at = block_at
        self.has_len = has_len

    def __len__(self) -> int:
        if not self.has_len:
            raise TypeError("ShardedRange(has_len=False) has no len()")
        return self.n

    def __iter__(self) -> Any:
        import os
        import signal
        import threading

        info = torch.utils.data.get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        for i in range(wid, self.n, nw):
            if i == self.fail_at:
                raise ValueError(f"sample {i} is bad")
            if i == self.kill_at and self.marker is not None and first_to_claim(self.marker):
                os.kill(os.getpid(), signal.SIGKILL)
            if i == self.block_at:
                threading.Event().wait()  # stuck for good: only a timeout ends it
            if self.log is not None:
                with open(self.log, "a") as f:
                    f.write(f"{i}\n")
            yield torch.tensor([float(i)]), i


class HangsOnceUnpickled(ShardedRange):
    """``ShardedRange(n)`` whose first unpickling outside the process that made it (an
    O_EXCL marker decides) never returns: a worker stuck in its start."""

    def __init__(self, n: int, marker: str) -> None:
        import os

        super().__init__(n)
        self.hang_marker = marker
        self.home = os.getpid()

    def __setstate__(self, state: dict[str, Any]) -> None:
        import os

        self.__dict__.update(state)
        if os.getpid() != self.home and first_to_claim(self.hang_marker):
            wait_to_be_killed(120)  # the pool kills it long before


class WorkerReport(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    """Each worker yields ``per_worker`` samples describing itself: torch's worker info
    and a draw from each global generator."""

    def __init__(self, per_worker: int = 2) -> None:
        self.per_worker = per_worker
        self.init_ids: list[int] = []

    def __iter__(self) -> Any:
        import os
        import random

        info = torch.utils.data.get_worker_info()
        for _ in range(self.per_worker):
            yield {
                "id": info.id if info else -1,
                "num_workers": info.num_workers if info else 0,
                "seed": info.seed if info else -1,
                "dataset_is_self": info is not None and info.dataset is self,
                "init_ids": list(info.dataset.init_ids) if info else [],
                "draws": (random.random(), float(np.random.rand()), float(torch.rand(1))),
                "pid": os.getpid(),
            }


def record_init(worker_id: int) -> None:
    """A worker_init_fn that records its id on the worker's copy of the dataset."""
    info = torch.utils.data.get_worker_info()
    info.dataset.init_ids.append(worker_id)


def _rebuilt_in(consumer_pid: int, i: int) -> int:
    import os

    if os.getpid() == consumer_pid:
        raise ValueError(f"sample {i} cannot be rebuilt in the main process")
    return i


class FailsInMain:
    """A sample that pickles in a worker but cannot be unpickled in the main process."""

    def __init__(self, consumer_pid: int, i: int) -> None:
        self.consumer_pid, self.i = consumer_pid, i

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuilt_in, (self.consumer_pid, self.i))


class UnreadableAt(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    """Ints; worker 0's sample ``at`` reaches the main process as a :class:`FailsInMain`."""

    def __init__(self, n: int, at: int) -> None:
        import os

        self.n, self.at, self.consumer_pid = n, at, os.getpid()

    def __iter__(self) -> Any:
        info = torch.utils.data.get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        for i in range(wid, self.n, nw):
            yield FailsInMain(self.consumer_pid, i) if i == self.at else i


class TorchThreads(RangeDataset):
    """Sample ``i`` is ``(torch.get_num_threads(), i)``: the intra-op threads where it was read."""

    def __getitem__(self, i: int) -> Any:
        return torch.get_num_threads(), i

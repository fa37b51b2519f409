"""Datasets and helpers shared by the tests. Module level, so that forkserver and spawn
workers can import them."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

import aioloader


def first_to_claim(marker: str) -> bool:
    """Whether this call made ``marker`` (``O_EXCL``): of every process that tries, one wins."""
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def wait_to_be_killed(bound: float) -> None:
    """Block until the test kills this process; the bound only turns a broken test's
    hang into a failure."""
    threading.Event().wait(bound)


class RangeDataset:
    """Sample i is (a small float32 array derived from i, i)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        return np.array([i, 2 * i, 3 * i], dtype=np.float32), i


class RecordingDataset(RangeDataset):
    """Appends every index it loads to a file (one line each), from inside the worker."""

    def __init__(self, n: int, log: str) -> None:
        super().__init__(n)
        self.log = log

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        with open(self.log, "a") as f:
            f.write(f"{i} {os.getpid()}\n")
        return super().__getitem__(i)


class SlowDataset(RangeDataset):
    """Busy work per sample, to keep workers occupied (not used for synchronisation)."""

    def __init__(self, n: int, work_s: float) -> None:
        super().__init__(n)
        self.work_s = work_s

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        end = time.perf_counter() + self.work_s
        while time.perf_counter() < end:
            pass
        return super().__getitem__(i)


class AugmentedDataset(RangeDataset):
    """Random augmentation from every RNG a user might reach for."""

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        base = np.full(4, i, dtype=np.float64)
        noise = np.array(
            [random.random(), np.random.rand(), aioloader.sample_rng().random(), np.random.randint(0, 1000)]
        )
        return base + noise, i


class FailingDataset(RangeDataset):
    """Raises ``exc_type`` at the chosen indices."""

    def __init__(self, n: int, bad: set[int], exc_type: type[Exception] = KeyError) -> None:
        super().__init__(n)
        self.bad = set(bad)
        self.exc_type = exc_type

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        if i in self.bad:
            raise self.exc_type(f"sample {i} is bad")
        return super().__getitem__(i)


class Unpicklable(Exception):
    def __init__(self, a: int, b: int) -> None:  # unpickling calls __init__(msg) and fails
        super().__init__(f"custom {a} {b}")
        self.lock = __import__("threading").Lock()


class UnpicklableErrorDataset(RangeDataset):
    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        if i == 3:
            raise Unpicklable(1, 2)
        return super().__getitem__(i)


class ShapeMismatchDataset(RangeDataset):
    def __getitem__(self, i: int) -> Any:
        return np.zeros((5 if i == 6 else 3,), dtype=np.float32), i


class CrashDataset(RangeDataset):
    """Kills its own worker the first time (per marker file) it loads an index in ``crash_at``.

    ``always=True`` crashes on every attempt. The marker file is created before the
    crash, so a test can wait on it.
    """

    def __init__(
        self, n: int, crash_at: set[int], marker_dir: str, always: bool = False, how: str = "kill"
    ) -> None:
        super().__init__(n)
        self.crash_at = set(crash_at)
        self.marker_dir = marker_dir
        self.always = always
        self.how = how

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        if i in self.crash_at:
            marker = Path(self.marker_dir) / f"crashed-{i}"
            if self.always or first_to_claim(str(marker)):
                with open(marker, "a") as f:
                    f.write("x")
                if self.how == "exit":
                    os._exit(3)
                os.kill(os.getpid(), signal.SIGKILL)
        return super().__getitem__(i)


class HangDataset(RangeDataset):
    """Blocks at ``hang_at`` until the worker is killed; with ``marker`` only the first
    time (the marker file records that it happened)."""

    def __init__(self, n: int, hang_at: int, marker: str | None = None) -> None:
        super().__init__(n)
        self.hang_at = hang_at
        self.marker = marker

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        if i == self.hang_at and (self.marker is None or first_to_claim(self.marker)):
            threading.Event().wait()  # a stuck sample: only a kill ends it
        return super().__getitem__(i)


class GatedDataset(RangeDataset):
    """Sample ``gate_at`` waits until ``release`` exists; it writes ``arrived`` first."""

    def __init__(self, n: int, gate_at: int, arrived: str, release: str) -> None:
        super().__init__(n)
        self.gate_at = gate_at
        self.arrived = arrived
        self.release = release

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        if i == self.gate_at:
            Path(self.arrived).touch()
            deadline = time.monotonic() + 60
            while not os.path.exists(self.release) and time.monotonic() < deadline:
                time.sleep(0.002)  # waiting on a file the test writes
        return super().__getitem__(i)


class PidDataset(RangeDataset):
    def __getitem__(self, i: int) -> Any:
        return os.getpid(), i


def failing_collate(samples: list[Any]) -> Any:
    raise ValueError("collate says no")


def failing_init(worker_id: int) -> None:
    raise RuntimeError(f"init of worker {worker_id} failed")


def record_init(worker_id: int) -> None:
    os.environ["AIOLOADER_TEST_WORKER_ID"] = str(worker_id)


class InitIdDataset(RangeDataset):
    def __getitem__(self, i: int) -> Any:
        return int(os.environ.get("AIOLOADER_TEST_WORKER_ID", "-1")), i


class StatefulSampler:
    """A custom sampler with its own state: a seeded shuffle that advances per epoch."""

    def __init__(self, n: int, seed: int = 0) -> None:
        self.n = n
        self.rng = np.random.default_rng(seed)

    def __iter__(self) -> Any:
        return iter(self.rng.permutation(self.n).tolist())

    def __len__(self) -> int:
        return self.n

    def state_dict(self) -> dict[str, Any]:
        return {"rng": self.rng.bit_generator.state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rng.bit_generator.state = state["rng"]


class AugmentedCrashDataset(AugmentedDataset):
    """AugmentedDataset whose worker dies the first time it loads ``crash_at``."""

    def __init__(self, n: int, crash_at: int, marker: str) -> None:
        super().__init__(n)
        self.crash_at = crash_at
        self.marker = marker

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        if i == self.crash_at and first_to_claim(self.marker):
            os.kill(os.getpid(), signal.SIGKILL)
        return super().__getitem__(i)


class KillableDataset(RangeDataset):
    """Sample ``gate_at``, the first time it is loaded (no ``marker`` file yet), writes the
    pid of its worker to ``marker`` and then blocks until that worker is killed: a test
    waits for the file and kills the pid, so the kill lands while the batch is running.
    Later loads of ``gate_at`` (the retry, once the file exists) return at once."""

    def __init__(self, n: int, gate_at: int, marker: str) -> None:
        super().__init__(n)
        self.gate_at = gate_at
        self.marker = marker

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        if i == self.gate_at and first_to_claim(f"{self.marker}.claimed"):
            tmp = f"{self.marker}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                f.write(str(os.getpid()))
            os.replace(tmp, self.marker)  # the test sees the whole pid or nothing
            wait_to_be_killed(60)
            raise RuntimeError(f"worker {os.getpid()} holding sample {i} was never killed")
        return super().__getitem__(i)


def small_bench_dataset() -> SlowDataset:
    """Factory for ``python -m aioloader bench tests._datasets:small_bench_dataset``."""
    return SlowDataset(96, 0.0005)


class HeavyDataset(RangeDataset):
    """Carries ``nbytes`` of its own (a lookup table, say): the dataset is big, its
    samples are not. Used to show that a batch task stays small anyway."""

    def __init__(self, n: int, nbytes: int) -> None:
        super().__init__(n)
        self.table = np.ones(nbytes, dtype=np.uint8)

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        arr, idx = super().__getitem__(i)
        return arr * self.table[i % len(self.table)], idx


class BatchedRange:
    """Read through ``__getitems__``: sample ``i`` is ``[i, size of the call that read it]``.

    ``__getitem__`` serves only the per-sample fallback (``single=True``); otherwise it
    raises, so a per-sample read shows as an error. ``bad`` indices raise ``KeyError``
    from both, the batched read naming no culprit."""

    def __init__(self, n: int, bad: set[int] = frozenset(), single: bool = False) -> None:  # type: ignore[assignment]
        self.n, self.bad, self.single = n, set(bad), single

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        if i in self.bad:
            raise KeyError(f"sample {i} is bad")
        if not self.single:
            raise AssertionError(f"dataset[{i}] was called: the batch should be read with __getitems__")
        return np.array([i, 1])

    def __getitems__(self, indices: list[int]) -> list[np.ndarray]:
        assert type(indices) is list and all(type(i) is int for i in indices), indices
        if self.bad.intersection(indices):
            raise KeyError("one sample of this batch is bad")
        return [np.array([i, len(indices)]) for i in indices]


class ShortBatches(BatchedRange):
    """A ``__getitems__`` that drops the last sample of each batch (a bug to be named)."""

    def __getitems__(self, indices: list[int]) -> list[np.ndarray]:
        return super().__getitems__(indices)[:-1]


class Draws:
    """Sample ``i``: ``[i, a draw from numpy's global generator, a draw from
    sample_rng(), 0]``, read one sample at a time."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        return np.array([i, np.random.randint(1 << 30), aioloader.sample_rng().integers(1 << 30), 0])


class BatchedDraws(Draws):
    """:class:`Draws` read a batch at a time: the same draws, in the same order, with
    ``sample_rng(i)``; the last column is 1."""

    def __getitems__(self, indices: list[int]) -> list[np.ndarray]:
        return [
            np.array([i, np.random.randint(1 << 30), aioloader.sample_rng(i).integers(1 << 30), 1])
            for i in indices
        ]


class BatchedNoIndex(Draws):
    """A ``__getitems__`` that asks ``sample_rng()`` without an index (an error)."""

    def __getitems__(self, indices: list[int]) -> list[np.ndarray]:
        return [self[i] for i in indices]

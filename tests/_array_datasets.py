"""Datasets holding large numpy arrays, for the shared dataset-array tests. Module level,
so that forkserver and spawn workers can import them."""

from __future__ import annotations

import os
from typing import Any

import numpy as np


class ArrayDataset:
    """Sample ``i``: ``(i, checksum of the whole array, worker pid)``. Every sample reads
    every page of the array, so each worker that builds one maps all of it."""

    def __init__(self, mib: int, n: int = 16) -> None:
        self.data = np.arange(mib * 2**20 // 8, dtype=np.int64)
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        return np.array([i, int(self.data.sum()), os.getpid()], dtype=np.int64)


class WritingDataset(ArrayDataset):
    """Each sample writes ``-1`` over element ``i`` of its worker's view of the array and
    returns how many elements that worker sees as ``-1`` and whether the write held."""

    def __getitem__(self, i: int) -> np.ndarray:
        self.data[i] = -1
        return np.array([i, int((self.data == -1).sum()), os.getpid(), int(self.data[i])], dtype=np.int64)


class DieOnceDataset(ArrayDataset):
    """Sample ``victim`` kills its worker the first time it is built (a marker file says
    whether it has been)."""

    def __init__(self, mib: int, n: int, marker: str, victim: int) -> None:
        super().__init__(mib, n)
        self.marker = marker
        self.victim = victim

    def __getitem__(self, i: int) -> np.ndarray:
        if i == self.victim:
            try:
                fd = os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                pass
            else:
                os.close(fd)
                os._exit(3)
        return super().__getitem__(i)


def add_array(x: Any, table: np.ndarray) -> Any:
    """A stream's ``fn`` with a large array bound to it (see the test)."""
    return int(table[int(x)])


def segment_names(pid: int) -> list[str]:
    """The data segments consumer ``pid`` has in ``/dev/shm`` now."""
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"aioloader_{pid}_{pid}_"))


def mapping_of(pid: int, name: str) -> dict[str, int]:
    """``/proc/PID/smaps`` figures (bytes) summed over process ``pid``'s mappings of
    ``/dev/shm/name``; empty if it maps none."""
    out: dict[str, int] = {}
    inside = False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            fields = line.split()
            if fields and "-" in fields[0] and ":" not in fields[0]:
                inside = len(fields) >= 6 and fields[5] == f"/dev/shm/{name}"
            elif inside and len(fields) == 3 and fields[2] == "kB":
                key = fields[0].rstrip(":")
                out[key] = out.get(key, 0) + int(fields[1]) * 1024
    return out


def rollup(pid: int) -> dict[str, int]:
    """``/proc/PID/smaps_rollup`` figures in bytes."""
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            fields = line.split()
            if len(fields) == 3 and fields[2] == "kB":
                out[fields[0].rstrip(":")] = int(fields[1]) * 1024
    return out


CONSUMER_SCRIPT = """
import sys
from aioloader import DataLoader
from tests._array_datasets import ArrayDataset

if __name__ == "__main__":
    with DataLoader(ArrayDataset(4, 8), batch_size=1, num_workers=2) as loader:
        assert len(list(loader)) == 8
        print(" ".join(map(str, loader.worker_pids())), flush=True)
        sys.stdin.read()  # until the test kills this process
"""


class CountingDataset:
    """Counts the samples built, in every worker, in one ``multiprocessing.Value``; also
    takes a ``multiprocessing`` lock around its own work (two primitives torch passes to
    its workers at process start)."""

    def __init__(self, n: int, counter: Any, lock: Any) -> None:
        self.n = n
        self.counter = counter
        self.lock = lock

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        with self.lock, self.counter.get_lock():
            self.counter.value += 1
        return i


class ReportingDataset:
    """Puts each index on a ``multiprocessing`` queue and writes ``10 * i`` into slot ``i``
    of a shared ``Array``."""

    def __init__(self, queue: Any, slots: Any) -> None:
        self.queue = queue
        self.slots = slots

    def __len__(self) -> int:
        return len(self.slots)

    def __getitem__(self, i: int) -> int:
        self.queue.put(i)
        self.slots[i] = 10 * i
        return i

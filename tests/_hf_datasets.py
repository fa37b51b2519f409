"""Helpers for tests/test_hf_datasets.py: parquet files made on the spot, and a map-style
wrapper that logs how each batch was read. Module level, so that forkserver and spawn
workers can import them when they unpickle the dataset."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np


def x_of(ids: Any) -> np.ndarray:
    """The ``x`` column for ``ids``: three float32 values a row derives from its id."""
    ids = np.asarray(ids, dtype=np.float32)
    return np.stack([ids, ids + 0.5, -ids], axis=-1)


def write_parquet_shards(root: Path, rows: int, shards: int) -> list[str]:
    """``rows`` rows split over ``shards`` parquet files, in id order: shard ``s`` holds
    ids ``s * rows // shards`` up to the next shard's first id. Columns: ``id`` (int64),
    ``label`` (int64), ``x`` (three float32) and ``name`` (a string)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root.mkdir(parents=True, exist_ok=True)
    files = []
    bounds = [s * rows // shards for s in range(shards + 1)]
    for s in range(shards):
        ids = np.arange(bounds[s], bounds[s + 1], dtype=np.int64)
        table = pa.table(
            {
                "id": ids,
                "label": ids % 5,
                "x": pa.array(list(x_of(ids)), type=pa.list_(pa.float32(), 3)),
                "name": [f"row{i}" for i in ids],
            }
        )
        path = root / f"part-{s:02d}.parquet"
        pq.write_table(table, path)
        files.append(str(path))
    return files


class CountingReads:
    """A map-style dataset that forwards to ``dataset`` and logs every read to ``log``.

    Each call appends one line (``getitems i j ...`` or ``getitem i``). Each sample also
    carries ``via`` (which method read it) and ``call`` (``pid:n``, the same for every
    sample of one call), so a batch tells which calls built it."""

    def __init__(self, dataset: Any, log: str) -> None:
        self.dataset = dataset
        self.log = log
        self.calls = 0

    def __len__(self) -> int:
        return len(self.dataset)

    def _note(self, line: str) -> str:
        self.calls += 1
        with open(self.log, "a") as f:  # one short line per write: appends do not interleave
            f.write(line + "\n")
        return f"{os.getpid()}:{self.calls}"

    def __getitem__(self, index: int) -> dict[str, Any]:
        call = self._note(f"getitem {int(index)}")
        return {**self.dataset[int(index)], "via": "getitem", "call": call}

    def __getitems__(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        keys = [int(i) for i in indices]
        call = self._note("getitems " + " ".join(map(str, keys)))
        return [{**row, "via": "getitems", "call": call} for row in self.dataset.__getitems__(keys)]


def read_log(log: str) -> list[tuple[str, list[int]]]:
    """The calls :class:`CountingReads` logged: (method, indices) in the order written."""
    if not os.path.exists(log):
        return []
    out = []
    with open(log) as f:
        for line in f.read().splitlines():
            method, *keys = line.split()
            out.append((method, [int(k) for k in keys]))
    return out

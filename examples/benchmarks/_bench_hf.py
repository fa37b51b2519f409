"""The HuggingFace ``datasets`` workloads of ``bench_suite.py``: a map-style table in
memory, and a stream over local parquet shards.

Nothing reaches the hub: the child processes run offline. The module is importable so
that workers started by ``forkserver`` or ``spawn`` can unpickle the datasets.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

# Read by ``datasets`` at import: set before it is imported anywhere in this process.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

__all__ = ["hf_map_dataset", "hf_stream_dataset", "write_parquet_shards"]

FEATURES = 16  # float32 values a row


def _columns(ids: np.ndarray) -> dict[str, Any]:
    x = np.repeat(ids.astype(np.float32)[:, None], FEATURES, axis=1)
    return {"id": ids, "label": ids % 10, "x": x}


def hf_map_dataset(rows: int) -> Any:
    """``rows`` rows in memory (``Dataset.from_dict``), numpy format: a sample is a dict
    of an int64 id, an int64 label and 16 float32 values."""
    import datasets

    return datasets.Dataset.from_dict(_columns(np.arange(rows, dtype=np.int64))).with_format("numpy")


def write_parquet_shards(root: Path, rows: int, shards: int) -> list[str]:
    """The rows of :func:`hf_map_dataset`, split in order over ``shards`` parquet files
    under ``root``; files already there are kept."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root.mkdir(parents=True, exist_ok=True)
    bounds = [s * rows // shards for s in range(shards + 1)]
    files = []
    for s in range(shards):
        path = root / f"part-{s:02d}-of-{shards:02d}.parquet"
        if not path.exists():
            cols = _columns(np.arange(bounds[s], bounds[s + 1], dtype=np.int64))
            x = pa.FixedSizeListArray.from_arrays(pa.array(cols["x"].ravel()), FEATURES)
            tmp = path.with_suffix(".tmp")
            pq.write_table(pa.table({"id": cols["id"], "label": cols["label"], "x": x}), tmp)
            tmp.rename(path)
        files.append(str(path))
    return files


def hf_stream_dataset(files: list[str]) -> Any:
    """``load_dataset("parquet", streaming=True)`` over ``files``, numpy format. Each of
    torch's workers reads its own shards (``datasets`` asks ``get_worker_info()``)."""
    import datasets

    ds = datasets.load_dataset("parquet", data_files=files, split="train", streaming=True)
    return ds.with_format("numpy")

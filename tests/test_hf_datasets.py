"""HuggingFace ``datasets`` as inputs (issue 51): map-style tables and streaming
shards, read from parquet files the test writes, through ``for`` and ``async for``,
with 0 and 2 workers, and resumed mid-epoch.

Nothing reaches the hub: the offline switches are on and every cache is in ``tmp_path``.
``datasets`` is imported by the first test that runs, not at collection (pyarrow and
pandas cost a second)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tqdm

import aioloader

from ._datasets import RangeDataset
from ._hf_datasets import CountingReads, read_log, write_parquet_shards, x_of
from .conftest import TORCH_REQUIRED_ON, _collect_sync

if importlib.util.find_spec("datasets") is None:
    if sys.version_info[:2] == TORCH_REQUIRED_ON:
        pytest.fail(
            'datasets is not installed, and on Python 3.11 these tests must run (pip install -e ".[dev]")',
            pytrace=False,
        )
    pytest.skip("datasets is not installed (CI installs it with the dev extra)", allow_module_level=True)

WORKERS = [pytest.param(0, id="thread"), pytest.param(2, id="processes")]
ROWS = 50
BATCH = 8  # 50 rows: six full batches and one of two


@pytest.fixture(scope="module")
def hf() -> Any:
    """The ``datasets`` package. Importing it starts jemalloc's background thread
    (pyarrow's), which does not keep the pool from forking its zygote."""
    import datasets

    return datasets


@pytest.fixture(autouse=True)
def offline_hf(hf: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """No hub, and every cache under ``tmp_path``. ``datasets`` reads the environment
    once, at import, so its config module is patched too."""
    home = tmp_path / "hf"
    for name, value in {
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(home),
        "HF_DATASETS_CACHE": str(home / "datasets"),
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(hf.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hf.config, "HF_DATASETS_OFFLINE", True)
    monkeypatch.setattr(hf.config, "HF_CACHE_HOME", str(home))
    monkeypatch.setattr(hf.config, "HF_DATASETS_CACHE", home / "datasets")
    monkeypatch.setattr(hf.config, "HF_MODULES_CACHE", home / "modules")
    # Every tqdm bar, even a disabled one, starts tqdm's monitor thread, which never ends.
    monkeypatch.setattr(tqdm.tqdm, "monitor_interval", 0)
    was_disabled = hf.utils.are_progress_bars_disabled()
    hf.disable_progress_bars()
    yield home
    if not was_disabled:
        hf.enable_progress_bars()


def map_dataset(hf: Any, tmp_path: Path, how: str) -> Any:
    """A map-style HF dataset of ``ROWS`` rows from three parquet files, numpy format."""
    files = write_parquet_shards(tmp_path / "parquet", ROWS, 3)
    cache = str(tmp_path / "hf" / "datasets")
    if how == "load_dataset":
        ds = hf.load_dataset("parquet", data_files=files, split="train", cache_dir=cache)
    else:
        ds = hf.Dataset.from_parquet(files, cache_dir=cache)
    return ds.with_format("numpy")


def streaming_dataset(hf: Any, tmp_path: Path, rows: int, shards: int = 4) -> Any:
    """A streaming HF dataset over ``shards`` parquet files, numpy format. (Not shuffled:
    ``datasets`` then sleeps 5 s at the end of every pass over parquet shards.)"""
    files = write_parquet_shards(tmp_path / "parquet", rows, shards)
    ds = hf.load_dataset("parquet", data_files=files, split="train", streaming=True)
    return ds.with_format("numpy")


def ids(batches: list[Any]) -> list[list[int]]:
    return [b["id"].tolist() for b in batches]


def check_batches(
    batches: list[Any], sizes: list[int], array_type: type = np.ndarray, extra: tuple[str, ...] = ()
) -> None:
    """Each batch has the given size, the parquet's columns (then ``extra``) as
    ``array_type`` of its dtypes and shapes, and rows whose values match their ids."""
    assert [len(b["id"]) for b in batches] == sizes
    for b in batches:
        n = len(b["id"])
        assert list(b) == ["id", "label", "x", "name", *extra]
        assert {type(b[k]) for k in ("id", "label", "x")} == {array_type}
        got = {k: np.asarray(b[k]) for k in ("id", "label", "x")}
        assert (got["id"].dtype, got["id"].shape) == (np.dtype(np.int64), (n,))
        assert (got["label"].dtype, got["label"].shape) == (np.dtype(np.int64), (n,))
        assert (got["x"].dtype, got["x"].shape) == (np.dtype(np.float32), (n, 3))
        np.testing.assert_array_equal(got["label"], got["id"] % 5)
        np.testing.assert_array_equal(got["x"], x_of(got["id"]))
        assert list(b["name"]) == [f"row{i}" for i in got["id"]]


def head_and_state(
    loader: Any, collect: Callable[..., list[Any]], k: int
) -> tuple[list[Any], dict[str, Any]]:
    """The first ``k`` batches through the face ``collect`` stands for, and the state
    taken right after the k-th, while the iteration is still open. The state goes
    through JSON, as a checkpoint would."""
    if collect is _collect_sync:
        head = []
        for b in loader:
            head.append(b)
            if len(head) == k:
                return head, json.loads(json.dumps(loader.state_dict()))
        raise AssertionError(f"the epoch ended before {k} batches")

    async def main() -> tuple[list[Any], dict[str, Any]]:
        head = []
        async for b in loader:
            head.append(b)
            if len(head) == k:
                return head, json.loads(json.dumps(loader.state_dict()))
        raise AssertionError(f"the epoch ended before {k} batches")

    return asyncio.run(main())


def plan_order(n: int, **kwargs: Any) -> list[list[int]]:
    """The indices of each batch of epochs 0 and 1 for a dataset of length ``n``: the plan
    depends on the length, the batching and the seed alone."""
    with aioloader.DataLoader(RangeDataset(n), **kwargs) as loader:
        return [b[1].tolist() for _ in range(2) for b in loader]


# --------------------------------------------------------------------------- map-style


@pytest.mark.parametrize("num_workers", WORKERS)
@pytest.mark.parametrize("how", ["load_dataset", "from_parquet"])
def test_map_style_reads_every_row_once_per_epoch_in_the_plans_order(
    hf: Any, tmp_path: Path, collect: Callable[..., list[Any]], num_workers: int, how: str
) -> None:
    ds = map_dataset(hf, tmp_path, how)
    kwargs = {"batch_size": BATCH, "shuffle": True, "seed": 7}
    expected = plan_order(ROWS, **kwargs)
    with aioloader.DataLoader(ds, num_workers=num_workers, **kwargs) as loader:
        epochs = [collect(loader), collect(loader)]
    assert ids(epochs[0]) + ids(epochs[1]) == expected
    for batches in epochs:
        assert sorted(i for b in ids(batches) for i in b) == list(range(ROWS))
        check_batches(batches, [BATCH] * 6 + [2])
    assert ids(epochs[0]) != ids(epochs[1])  # each epoch has its own order


@pytest.mark.parametrize("num_workers", WORKERS)
def test_map_style_resumes_mid_epoch_exactly(
    hf: Any, tmp_path: Path, collect: Callable[..., list[Any]], num_workers: int
) -> None:
    ds = map_dataset(hf, tmp_path, "load_dataset")
    kwargs = {"batch_size": BATCH, "shuffle": True, "seed": 3, "num_workers": num_workers}
    with aioloader.DataLoader(ds, **kwargs) as loader:
        full = ids(collect(loader))
        loader.set_epoch(0)
        head, state = head_and_state(loader, collect, 3)
    with aioloader.DataLoader(ds, **kwargs) as resumed:
        resumed.load_state_dict(state)
        tail = collect(resumed)
    assert ids(head) == full[:3]
    assert ids(head) + ids(tail) == full
    check_batches(tail, [BATCH] * 3 + [2])


@pytest.mark.parametrize("num_workers", WORKERS)
def test_map_style_reads_each_batch_with_one_getitems_call(
    hf: Any, tmp_path: Path, collect: Callable[..., list[Any]], num_workers: int
) -> None:
    """A dataset with ``__getitems__`` is read with one call per batch, as torch reads
    it, and ``__getitem__`` is never called (issue 51's batched reads)."""
    log = str(tmp_path / "reads.log")
    ds = CountingReads(map_dataset(hf, tmp_path, "load_dataset"), log)
    with aioloader.DataLoader(
        ds, BATCH, shuffle=True, seed=1, num_workers=num_workers, prefetch_next_epoch=False
    ) as loader:
        batches = collect(loader)
    check_batches(batches, [BATCH] * 6 + [2], extra=("via", "call"))
    calls = read_log(log)
    assert [m for m, _ in calls if m != "getitems"] == []
    assert sorted(keys for _, keys in calls) == sorted(ids(batches))
    for b in batches:
        assert set(b["via"]) == {"getitems"}
        assert len(set(b["call"])) == 1
    assert len({b["call"][0] for b in batches}) == len(batches)


# --------------------------------------------------------------------------- streaming


def torch_ids(ds: Any, num_workers: int) -> list[list[int]]:
    """torch's batches of ``ds``, with aioloader's collate: the order to match."""
    import torch

    loader = torch.utils.data.DataLoader(
        ds, batch_size=BATCH, num_workers=num_workers, collate_fn=aioloader.default_collate
    )
    return [b["id"].tolist() for b in loader]


@pytest.mark.torch
@pytest.mark.parametrize("num_workers", WORKERS)
def test_streaming_each_worker_reads_its_own_shards_in_torchs_order(
    hf: Any, tmp_path: Path, collect: Callable[..., list[Any]], num_workers: int
) -> None:
    import torch

    rows, shards = 52, 4  # 13 rows a shard: batches cross shard ends
    ds = streaming_dataset(hf, tmp_path, rows, shards)
    expected = torch_ids(ds, num_workers)  # before aioloader starts threads: torch forks
    with aioloader.DataLoader(ds, batch_size=BATCH, num_workers=num_workers) as loader:
        batches = collect(loader)
        again = collect(loader)
    assert ids(batches) == expected
    assert ids(again) == expected
    assert sorted(i for b in ids(batches) for i in b) == list(range(rows))
    # A torch IterableDataset: batches are tensors, as torch's own collate makes them.
    check_batches(batches, [len(b) for b in expected], torch.Tensor)
    if num_workers == 2:  # worker w reads shards w and w + 2, and nothing else
        parities = [{i // (rows // shards) % 2 for i in b} for b in ids(batches)]
        assert all(len(p) == 1 for p in parities), ids(batches)
        assert {p.pop() for p in parities} == {0, 1}


@pytest.mark.torch
@pytest.mark.parametrize("num_workers", WORKERS)
def test_streaming_resumes_mid_epoch_exactly(
    hf: Any, tmp_path: Path, collect: Callable[..., list[Any]], num_workers: int
) -> None:
    import torch

    rows = 60
    ds = streaming_dataset(hf, tmp_path, rows)
    with aioloader.DataLoader(ds, batch_size=BATCH, num_workers=num_workers) as loader:
        full = ids(collect(loader))
        head, state = head_and_state(loader, collect, 3)  # epoch 1 repeats epoch 0
    assert state["epoch"] == 1
    with aioloader.DataLoader(ds, batch_size=BATCH, num_workers=num_workers) as resumed:
        resumed.load_state_dict(state)
        tail = collect(resumed)
    assert ids(head) == full[:3]
    assert ids(head) + ids(tail) == full
    assert sorted(i for b in full for i in b) == list(range(rows))
    check_batches(tail, [len(b) for b in full[3:]], torch.Tensor)

"""Datasets holding multiprocessing primitives (Value, Lock, Queue): they pickle only while
a process starts, so the loader's own pool passes them to its workers then, as torch's
DataLoader does; everywhere else the error says why and what to do."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import multiprocessing as mp
from typing import Any

import pytest

import aioloader
from aioloader.errors import DatasetPickleError

from ._array_datasets import CountingDataset, ReportingDataset
from ._datasets import RangeDataset


def _epoch(loader: Any, mode: str) -> list[int]:
    if mode == "for":
        return sorted(x for b in loader for x in b.tolist())

    async def main() -> list[int]:
        return sorted([x async for b in loader for x in b.tolist()])

    return asyncio.run(main())


@pytest.mark.parametrize("mode", ["for", "async-for"])
@pytest.mark.parametrize("method", ["forkserver", "spawn", "fork"])
def test_workers_share_the_primitives_of_the_dataset(mode: str, method: str) -> None:
    ctx = mp.get_context(method)
    ds = CountingDataset(12, ctx.Value("i", 0), ctx.Lock())
    with aioloader.DataLoader(ds, 3, num_workers=2, mp_context=method, prefetch_next_epoch=False) as loader:
        assert _epoch(loader, mode) == list(range(12))
        assert loader.stats().restarts == 0
    assert ds.counter.value == 12  # the workers' increments landed in this process's Value


def test_queues_and_arrays_reach_the_workers_too() -> None:
    ctx = mp.get_context("forkserver")
    queue, slots = ctx.Queue(), ctx.Array("i", 6)
    with aioloader.DataLoader(
        ReportingDataset(queue, slots), 2, num_workers=2, prefetch_next_epoch=False
    ) as loader:
        assert _epoch(loader, "for") == list(range(6))
        assert sorted(queue.get(timeout=30) for _ in range(6)) == list(range(6))
    assert list(slots) == [0, 10, 20, 30, 40, 50]
    queue.close()
    queue.join_thread()


def test_a_primitive_of_another_start_method_is_named_before_any_worker_starts() -> None:
    fork = mp.get_context("fork")
    ds = CountingDataset(4, fork.Value("i", 0), fork.Lock())
    with aioloader.DataLoader(ds, 2, num_workers=2, mp_context="forkserver") as loader:
        with pytest.raises(DatasetPickleError, match=r"dataset \(CountingDataset\).*get_context") as info:
            next(iter(loader))
        assert "fork context" in str(info.value)
        assert loader.worker_pids() == []


def test_a_borrowed_executor_cannot_take_them_and_says_so() -> None:
    ctx = mp.get_context("forkserver")
    ds = CountingDataset(4, ctx.Value("i", 0), ctx.Lock())
    with cf.ThreadPoolExecutor(1) as ex, aioloader.DataLoader(ds, 2, executor=ex) as loader:
        with pytest.raises(DatasetPickleError, match="borrowed executor cannot"):
            next(iter(loader))


def test_in_process_loading_needs_no_pickling() -> None:
    ctx = mp.get_context("forkserver")
    ds = CountingDataset(5, ctx.Value("i", 0), ctx.Lock())
    with aioloader.DataLoader(ds, 2, num_workers=0, prefetch_next_epoch=False) as loader:
        assert _epoch(loader, "for") == list(range(5))
    assert ds.counter.value == 5


def test_a_started_shared_pool_restarts_once_to_take_them() -> None:
    # Workers already running never saw the new loader's primitives: the pool retires
    # them (charging no task with a crash) and the next workers start with them.
    ctx = mp.get_context("forkserver")
    with aioloader.WorkerPool(2) as pool:
        with aioloader.DataLoader(RangeDataset(8), 2, pool=pool) as plain:
            first = plain.worker_pids() or None
            assert sorted(x for _, b in plain for x in b.tolist()) == list(range(8))
            before = plain.worker_pids()
            ds = CountingDataset(6, ctx.Value("i", 0), ctx.Lock())
            with aioloader.DataLoader(ds, 2, pool=pool, prefetch_next_epoch=False) as counting:
                assert _epoch(counting, "for") == list(range(6))
                after = counting.worker_pids()
            assert ds.counter.value == 6
            assert first is None and before and after and not set(before) & set(after)
            assert pool.restarts == 1
            # the first loader keeps working on the new workers
            assert sorted(x for _, b in plain for x in b.tolist()) == list(range(8))

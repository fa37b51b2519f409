"""close() from another thread while a loader's epoch starts or runs.

The iterating thread must see LoaderClosedError or a normal end, never the event loop's
own RuntimeError, and nothing may be printed on stderr (a coroutine never awaited, a
task destroyed pending). The race is repeated many times: each round is cheap, as the
rounds share one pool.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import warnings
from collections.abc import Iterator

import pytest

import aioloader
from tests._datasets import RangeDataset

ROUNDS = 150
PROCESS_EVERY = 16  # rounds: one in this many starts a process pool of its own
WAIT = 30.0  # seconds: bounds a join, never a timing assertion


@pytest.fixture
def pool() -> Iterator[aioloader.WorkerPool]:
    p = aioloader.WorkerPool(2)
    try:
        yield p
    finally:
        p.shutdown()


def _iterate(loader: aioloader.DataLoader, face: str, go: threading.Event, at_start: bool) -> None:
    if face == "for":
        if at_start:
            go.set()
        for _ in loader:
            go.set()
        return

    async def main() -> None:
        if at_start:
            go.set()
        async for _ in loader:
            go.set()

    asyncio.run(main())


def _one_round(pool: aioloader.WorkerPool, face: str, i: int) -> BaseException | None:
    # Even rounds: a loader with a pool of its own, closed as its epoch starts (its
    # portal closes under the starting iteration, its pool as it starts). A process pool
    # costs its close's grace, so most of these use a thread. Odd rounds: a loader on a
    # shared pool, closed once a batch arrived, while the consumer goes on or (an epoch
    # of one batch) ends and its loop shuts down.
    at_start = i % 2 == 0
    if at_start:
        workers = 2 if i % PROCESS_EVERY == 0 else 0
        loader = aioloader.DataLoader(RangeDataset(64), batch_size=2, num_workers=workers)
    else:
        size = 64 if i % 4 == 1 else 2
        loader = aioloader.DataLoader(RangeDataset(size), batch_size=2, pool=pool)
    go = threading.Event()
    outcome: list[BaseException | None] = []

    def consumer() -> None:
        try:
            _iterate(loader, face, go, at_start)
        except BaseException as exc:
            outcome.append(exc)
        else:
            outcome.append(None)
        finally:
            go.set()  # an iteration that failed before its first batch still frees the closer

    t = threading.Thread(target=consumer)
    t.start()
    try:
        assert go.wait(WAIT)
        loader.close()
    finally:
        t.join(WAIT)
    assert not t.is_alive()
    return outcome[0]


@pytest.mark.parametrize("face", ["for", "async-for"])
def test_close_from_another_thread_raises_only_loader_closed(
    pool: aioloader.WorkerPool, face: str, capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        for i in range(ROUNDS):
            error = _one_round(pool, face, i)
            if error is not None and not isinstance(error, aioloader.LoaderClosedError):
                raise AssertionError(f"round {i} raised {type(error).__name__}: {error}") from error
        gc.collect()  # a coroutine never awaited warns when it is collected
    assert [str(w.message) for w in warned] == []
    # The pool outlives its loaders and still works.
    with aioloader.DataLoader(RangeDataset(4), batch_size=2, pool=pool) as loader:
        assert len(list(loader)) == 2
    assert capfd.readouterr().err == ""
    # asyncio logs "Task was destroyed but it is pending!" (pytest keeps the record).
    assert [r.getMessage() for r in caplog.records] == []

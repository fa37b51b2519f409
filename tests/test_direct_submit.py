"""Direct submission (``aioloader/_direct.py``): an owned process pool's tasks are
written to the workers' pipe by the submitting thread when that can neither block nor
take the manager thread's last slot; otherwise they go the executor's way. Workers are
held by tasks that wait on FIFOs, so every state below is reached by synchronisation,
not by timing."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import aioloader
from aioloader import _direct

from . import _pool_helpers as H
from ._datasets import RangeDataset
from .conftest import wait_until


@pytest.fixture
def pool() -> Iterator[aioloader.WorkerPool]:
    p = aioloader.WorkerPool(2)
    try:
        yield p
    finally:
        p.close()


def _gen(pool: aioloader.WorkerPool) -> Any:
    gen = pool.start()
    assert gen.direct is not None, "an owned process pool on Linux submits directly"
    return gen


def _queue_idle(gen: Any) -> None:
    """Wait until the workers have read every task in the call queue (the pool's first
    ones, written by the queue's feeder thread) and that thread holds its write lock no
    more: until then the queue may have no slot to spare, and a direct write is never
    made while the feeder writes."""
    q = gen.direct.queue

    def idle() -> bool:
        if q._buffer or q._sem.get_value() < q._maxsize or not q._wlock.acquire(False):
            return False
        q._wlock.release()
        return True

    wait_until(idle, 30, "the feeder thread to finish writing")


class _Held:
    """Both workers held by a blocking task each, until :meth:`release`."""

    def __init__(self, gen: Any, tmp: Path) -> None:
        self.gen = gen
        # The pool's first tasks (one per worker, through the feeder thread) are read
        # first: a blocking task written directly could overtake them in the pipe and
        # leave them in the queue until the end.
        _queue_idle(gen)
        self.fifos = [tmp / f"release{k}" for k in range(2)]
        started = [tmp / f"started{k}" for k in range(2)]
        for f in self.fifos:
            os.mkfifo(f)
        self.futures = [
            gen.submit(H.block_until_released, str(s), str(f))
            for s, f in zip(started, self.fifos, strict=True)
        ]
        wait_until(lambda: all(s.exists() for s in started), 30, "both workers to hold their task")
        _queue_idle(gen)

    def release(self) -> None:
        for f in self.fifos:
            fd = os.open(f, os.O_WRONLY)  # the reader is there: this does not block
            os.close(fd)
        pids = {fut.result(timeout=30) for fut in self.futures}
        assert len(pids) == 2


def test_each_task_goes_straight_to_the_pipe_when_the_pool_keeps_up(pool: aioloader.WorkerPool) -> None:
    gen = _gen(pool)
    _queue_idle(gen)
    before = gen.direct.direct, gen.direct.queued
    for k in range(40):
        assert gen.submit(pow, k, 2).result(timeout=30) == k * k
    assert (gen.direct.direct - before[0], gen.direct.queued - before[1]) == (40, 0)


def test_with_the_workers_busy_the_last_queue_slot_is_left_to_the_executor(
    pool: aioloader.WorkerPool, tmp_path: Path
) -> None:
    """The call queue has 3 slots for 2 workers: two tasks go direct, the third would
    take the manager thread's last slot and goes the executor's way, and so does every
    task after it (first come, first served). All of them run once the workers are free."""
    gen = _gen(pool)
    held = _Held(gen, tmp_path)
    direct, queued = gen.direct.direct, gen.direct.queued
    futures: list[Future[Any]] = [gen.submit(pow, k, 3) for k in range(6)]
    assert (gen.direct.direct - direct, gen.direct.queued - queued) == (2, 4)
    held.release()
    assert [f.result(timeout=30) for f in futures] == [k**3 for k in range(6)]


def test_a_task_too_large_for_the_pipe_never_blocks_the_submitting_thread(
    pool: aioloader.WorkerPool, tmp_path: Path
) -> None:
    """With both workers held nobody reads the pipe: a 1 MiB task written from this
    thread would block it for good. It goes to the call queue's feeder thread instead."""
    gen = _gen(pool)
    held = _Held(gen, tmp_path)
    queued = gen.direct.queued
    big = gen.submit(H.length_of, b"x" * (1 << 20))  # returns: the test would hang here otherwise
    assert gen.direct.queued - queued == 1
    small = gen.submit(pow, 7, 2)  # the pipe has room again, or waits for the feeder thread
    held.release()
    assert (big.result(timeout=30), small.result(timeout=30)) == (1 << 20, 49)


def test_a_task_that_cannot_be_pickled_fails_alone(pool: aioloader.WorkerPool) -> None:
    gen = _gen(pool)
    bad = gen.submit(pow, threading.Lock(), 2)
    with pytest.raises(TypeError, match="pickle"):
        bad.result(timeout=30)
    assert gen.submit(pow, 3, 2).result(timeout=30) == 9  # the pool is unharmed


def test_the_environment_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_direct.ENV, "0")
    p = aioloader.WorkerPool(1)
    try:
        gen = p.start()
        assert gen.direct is None
        assert gen.submit(pow, 5, 2).result(timeout=30) == 25
    finally:
        p.close()


def _plain(batch: Any) -> Any:
    return [np.asarray(part).tolist() for part in batch]


@pytest.mark.parametrize("face", ["for", "async-for"])
def test_a_loader_gets_its_batches_through_the_direct_path(face: str) -> None:
    """End to end: the batches of a loader on an owned pool are the reference ones, and
    its tasks were written directly."""
    with aioloader.WorkerPool(2) as wp:
        loader = aioloader.DataLoader(RangeDataset(64), 4, shuffle=True, seed=3, pool=wp, batches_per_task=1)
        if face == "for":
            got = [_plain(b) for b in loader]
        else:

            async def collect() -> list[Any]:
                return [_plain(b) async for b in loader]

            got = asyncio.run(collect())
        ref = aioloader.DataLoader(RangeDataset(64), 4, shuffle=True, seed=3, num_workers=0)
        assert got == [_plain(b) for b in ref] and len(got) == 16
        gen = wp.start()
        assert gen.direct is not None and gen.direct.direct > 0
        loader.close()
        ref.close()

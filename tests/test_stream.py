"""StreamLoader: sources, lazy pulling, deadline flushes, order, errors, crashes, lifecycle.

Every behaviour runs through ``for`` and ``async for`` (the ``mode`` fixture) where
both apply. Synchronisation is on events (``Gate``), never on sleeps.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import itertools
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import aioloader
from aioloader.errors import (
    DatasetPickleError,
    LoaderClosedError,
    LoaderTimeout,
    RemoteError,
    WorkerCrashedError,
)
from aioloader.stream import END, StreamLoader

from ._datasets import RangeDataset
from ._stream_helpers import (
    STOP,
    Counting,
    ExitOn,
    FailOn,
    Gate,
    HangOn,
    HoldFirst,
    KillAlways,
    KillOnce,
    as_lists,
    drive,
    failing_source,
    fetch_same,
    gate,
    identity,
    raise_unpicklable,
    square,
    stalled_source,
    tag_batch,
)

MODES = ["for", "async-for"]


@pytest.fixture(params=MODES)
def mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _notes(exc: BaseException) -> str:
    return "\n".join(getattr(exc, "__notes__", []))


# ------------------------------------------------------------------------ sources
def _source(kind: str, n: int) -> Any:
    if kind == "list":
        return list(range(n))
    if kind == "generator":
        return (i for i in range(n))

    async def agen() -> Any:
        for i in range(n):
            yield i

    return agen()


@pytest.mark.parametrize("kind", ["list", "generator", "async-generator"])
def test_sync_and_async_sources(mode: str, kind: str) -> None:
    with StreamLoader(_source(kind, 10), square, batch_size=4) as stream:
        got = drive(mode, stream)
    assert as_lists(got) == [[0, 1, 4, 9], [16, 25, 36, 49], [64, 81]]
    assert stream.stats().batches == 3 and stream.stats().samples == 10


@pytest.mark.asyncio
async def test_queue_source_ends_at_sentinel_and_marks_items_done() -> None:
    queue: asyncio.Queue[Any] = asyncio.Queue(maxsize=3)

    async def produce() -> None:
        for i in range(10):
            await queue.put(i)
        await queue.put(StreamLoader.END)
        await queue.join()  # returns because the stream calls task_done()

    producer = asyncio.create_task(produce())
    async with StreamLoader(queue, square, batch_size=4) as stream:
        got = [b.tolist() async for b in stream]
    await asyncio.wait_for(producer, 10)
    assert got == [[0, 1, 4, 9], [16, 25, 36, 49], [64, 81]]
    assert END is StreamLoader.END


@pytest.mark.skipif(sys.version_info < (3, 13), reason="asyncio.Queue.shutdown() is new in 3.13")
@pytest.mark.asyncio
async def test_queue_source_ends_at_shutdown() -> None:  # pragma: no cover - 3.13+
    queue: asyncio.Queue[Any] = asyncio.Queue()
    for i in range(5):
        queue.put_nowait(i)
    queue.shutdown()  # type: ignore[attr-defined]
    async with StreamLoader(queue, batch_size=2) as stream:
        got = [b.tolist() async for b in stream]
    assert got == [[0, 1], [2, 3], [4]]


def test_queue_source_needs_async_for() -> None:
    with StreamLoader(asyncio.Queue(), batch_size=2) as stream, pytest.raises(TypeError, match="async for"):
        iter(stream)


def test_fn_none_collates_raw_items_and_batched_fn(mode: str) -> None:
    items = [np.full(2, i, dtype=np.int16) for i in range(5)]
    with StreamLoader(items, batch_size=2) as stream:
        got = drive(mode, stream)
    assert [b.shape for b in got] == [(2, 2), (2, 2), (1, 2)]
    np.testing.assert_array_equal(got[2], [[4, 4]])
    with StreamLoader(range(5), tag_batch, batched_fn=True, batch_size=2, collate_fn=identity) as stream:
        got = drive(mode, stream)
    assert got == [[(0, 2), (1, 2)], [(2, 2), (3, 2)], [(4, 1)]]


# ------------------------------------------------------------------------- window
@pytest.mark.parametrize("kind", ["collection", "generator", "async"])
def test_pulls_lazily_within_the_window(mode: str, kind: str) -> None:
    """Never more than ``prefetch * batch_size`` items taken and not delivered; the
    source checks it at every take, against the stream's own delivery count."""
    size, prefetch, taken = 4, 2, 3
    holder: list[StreamLoader] = []
    counting = Counting(kind, lambda: (holder[0].stats().batches + prefetch) * size)
    stream = StreamLoader(counting.source(), batch_size=size, prefetch=prefetch)
    holder.append(stream)
    full = counting.at((taken + prefetch) * size)  # what the window lets it read ahead

    def step(i: int, batch: Any) -> Any:
        assert batch.tolist() == list(range(i * size, (i + 1) * size))
        return (full, STOP) if i + 1 == taken else None

    with stream:
        got = drive(mode, stream, step)
        assert counting.closed.is_set()  # leaving the loop closed the generator
    assert len(got) == taken
    assert counting.violations == []
    # It read ahead as far as the window allows, and not one item further.
    assert counting.count == (taken + prefetch) * size


# ----------------------------------------------------------------------- deadline
@pytest.mark.parametrize("kind", ["generator", "async-generator"])
def test_deadline_flushes_a_partial_batch_of_a_stalled_source(mode: str, kind: str) -> None:
    release, closed = Gate(), Gate()
    source = stalled_source(kind, first=2, total=10, release=release, closed=closed)

    def step(i: int, batch: Any) -> Any:
        if i == 0:
            # Only the deadline can have emitted this: the source is stuck on `release`
            # (in a thread, or suspended in the loop), and the batch has room for 4.
            assert batch.tolist() == [0, 1]
            release.set()
        return None

    with StreamLoader(source, batch_size=4, max_latency=0.1) as stream:
        got = as_lists(drive(mode, stream, step))
    assert got[0] == [0, 1]
    assert [x for b in got[1:] for x in b] == list(range(2, 10))
    assert all(1 <= len(b) <= 4 for b in got)
    assert closed.is_set()


def test_no_deadline_keeps_batches_full_and_flushes_the_tail(mode: str) -> None:
    with StreamLoader(_source("generator", 10), batch_size=4, max_latency=None) as stream:
        assert as_lists(drive(mode, stream)) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


@pytest.mark.asyncio
async def test_zero_latency_takes_what_is_already_queued() -> None:
    queue: asyncio.Queue[Any] = asyncio.Queue()
    for i in range(6):
        queue.put_nowait(i)
    async with StreamLoader(queue, batch_size=4, max_latency=0) as stream:
        it = stream.__aiter__()
        first = await it.__anext__()
        second = await it.__anext__()
        queue.put_nowait(END)
        rest = [b async for b in it]
    assert first.tolist() == [0, 1, 2, 3]
    assert second.tolist() == [4, 5]
    assert rest == []


# -------------------------------------------------------------------------- order
@pytest.mark.parametrize("ordered", [True, False], ids=["ordered", "unordered"])
def test_order(mode: str, ordered: bool, request: pytest.FixtureRequest) -> None:
    """Item 0 is slow. Ordered: it still comes first (it is released once item 3 has
    been computed). Unordered: it is released only after the consumer has seen the
    three others, so it can only come last; the other three come in the order they finish."""
    key = request.node.nodeid
    release = f"{key}:done:3" if ordered else f"{key}:release"
    seen: list[int] = []

    def step(i: int, batch: Any) -> Any:
        seen.append(int(batch[0]))
        if len(seen) == 3:
            gate(f"{key}:release").set()
        return None

    with cf.ThreadPoolExecutor(4) as ex:
        with StreamLoader(
            range(4), HoldFirst(release), batch_size=1, prefetch=4, ordered=ordered, executor=ex
        ) as stream:
            drive(mode, stream, step)
    if ordered:
        assert seen == [0, 1, 2, 3]
    else:  # 1, 2 and 3 run on three threads at once and may finish in any order
        assert seen[-1] == 0 and sorted(seen[:3]) == [1, 2, 3], seen


# ------------------------------------------------------------------ early exit
@pytest.mark.parametrize("kind", ["generator", "async"])
def test_break_closes_the_source_and_the_stream_stays_usable(mode: str, kind: str) -> None:
    counting = Counting(kind, lambda: 1 << 62)
    with StreamLoader(counting.source(), batch_size=2, prefetch=2) as stream:
        got = drive(mode, stream, lambda i, b: STOP if i == 1 else None)
        assert len(got) == 2
        counting.closed.wait_sync(5)
        assert stream.stats().in_flight == 0
        # A list is read again from its start by the next iteration.
    with StreamLoader([1, 2, 3], batch_size=2) as stream:
        drive(mode, stream, lambda i, b: STOP)
        assert as_lists(drive(mode, stream)) == [[1, 2], [3]]


@pytest.mark.asyncio
async def test_plain_async_for_break_closes_async_generator_source() -> None:
    counting = Counting("async", lambda: 1 << 62)
    async with StreamLoader(counting.source(), batch_size=2) as stream:
        async for _batch in stream:
            break
        # The abandoned iterator is finalized by the event loop, which closes the
        # run and with it the source: no help from the caller needed.
        await counting.closed.wait(10)


@pytest.mark.asyncio
async def test_infinite_source_stopped_by_cancellation() -> None:
    counting = Counting("async", lambda: 1 << 62)
    three = Gate()
    stream = StreamLoader(counting.source(), square, batch_size=8)

    async def consume() -> None:
        n = 0
        async for _ in stream:
            n += 1
            if n == 3:
                three.set()

    task = asyncio.create_task(consume())
    await three.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert counting.closed.is_set()  # closed before the cancellation reached us
    await stream.aclose()


def test_close_from_another_thread_ends_iteration(mode: str) -> None:
    counting = Counting("generator", lambda: 1 << 62)
    stream = StreamLoader(counting.source(), batch_size=4)

    closed = Gate()

    def close() -> None:
        stream.close()
        closed.set()

    def step(i: int, batch: Any) -> Any:
        if i == 2:
            threading.Thread(target=close).start()
            return closed  # the consumer waits (without blocking its loop) for close()
        return None

    with pytest.raises(LoaderClosedError):
        drive(mode, stream, step)
    assert counting.closed.is_set()
    with pytest.raises(LoaderClosedError):
        drive(mode, stream)


# ------------------------------------------------------------------------- errors
def test_fn_error_is_raised_with_the_item_position(mode: str) -> None:
    with StreamLoader(range(10), FailOn(5), batch_size=2) as stream:
        seen: list[Any] = []
        with pytest.raises(ValueError, match="bad item 5") as info:
            drive(mode, stream, lambda i, b: seen.append(b.tolist()))
    assert seen == [[0, 1], [2, 3]]
    assert "stream item 5" in _notes(info.value)


def test_on_error_skip_drops_failing_items(mode: str) -> None:
    with StreamLoader(range(7), FailOn(2, 3), batch_size=2, on_error="skip") as stream:
        got = drive(mode, stream)
        assert as_lists(got) == [[0, 1], [4, 5], [6]]  # the batch of 2 and 3 vanished
        assert stream.stats().skipped == 2


@pytest.mark.parametrize("kind", ["generator", "async-generator"])
def test_source_error_comes_after_the_batches_before_it(mode: str, kind: str) -> None:
    with StreamLoader(failing_source(kind, 5), batch_size=2) as stream:
        seen: list[Any] = []
        with pytest.raises(KeyError, match="source broke") as info:
            drive(mode, stream, lambda i, b: seen.append(b.tolist()))
    assert seen == [[0, 1], [2, 3], [4]]
    assert "source" in _notes(info.value)


def test_collate_error_names_source_positions(mode: str) -> None:
    items = [np.zeros(2), np.zeros(2), np.zeros(3)]
    with StreamLoader(items, batch_size=3) as stream, pytest.raises(aioloader.CollateError) as info:
        drive(mode, stream)
    assert info.value.indices == [0, 2]  # type: ignore[attr-defined]


# ----------------------------------------------------------- processes and crashes
def test_worker_crash_mid_stream_is_recovered(mode: str, tmp_path: Path) -> None:
    marker = tmp_path / "killed"
    with StreamLoader(range(12), KillOnce(6, str(marker)), batch_size=3, num_workers=2) as stream:
        got = drive(mode, stream)
        assert marker.exists()  # the worker really died on item 6
        assert as_lists(got) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
        assert stream.stats().restarts >= 1
        assert stream.stats().isolated == 1  # [6, 7, 8] ran again one item a task


def test_worker_crash_every_time_gives_up(mode: str) -> None:
    # The micro-batch [3, 4, 5] is lost once; each item then runs alone: only 4 fails,
    # after its own max_retries, and the batch before it was delivered.
    with StreamLoader(range(9), KillAlways(4), batch_size=3, num_workers=1, max_retries=1) as stream:
        seen: list[Any] = []
        with pytest.raises(WorkerCrashedError) as info:
            drive(mode, stream, lambda i, b: seen.append(b.tolist()))
    assert seen == [[0, 1, 2]]
    assert info.value.indices == [4]  # type: ignore[attr-defined]
    assert info.value.attempts == 2  # type: ignore[attr-defined]
    assert str(info.value).startswith(
        "stream item 4 (run alone after micro-batch 1 of the stream (source items 3..5) was lost "
        "to a dying worker) was lost to a dying worker 2 times"
    ), info.value


def test_timeout_kills_a_stuck_worker(mode: str) -> None:
    with StreamLoader(range(6), HangOn(3), batch_size=2, num_workers=1, timeout=0.5) as stream:
        with pytest.raises(LoaderTimeout) as info:
            drive(mode, stream)
    assert info.value.indices == [3]  # type: ignore[attr-defined]
    assert str(info.value).startswith("stream item 3 (run alone after micro-batch 1 of the stream")


def test_an_item_that_kills_its_worker_names_itself(mode: str) -> None:
    with StreamLoader(range(12), ExitOn(7), batch_size=4, num_workers=2) as stream:
        seen: list[Any] = []
        with pytest.raises(WorkerCrashedError) as info:
            drive(mode, stream, lambda i, b: seen.append(b.tolist()))
        assert stream.stats().isolated == 1
    assert seen == [[0, 1, 2, 3]]  # in order: the batches before the culprit's
    assert info.value.indices == [7] and info.value.exitcode == 3  # type: ignore[attr-defined]
    assert info.value.attempts == 3  # type: ignore[attr-defined]


@pytest.mark.parametrize("fetched", [False, True], ids=["items", "fetch"])
def test_on_error_skip_drops_an_item_that_kills_its_worker(mode: str, fetched: bool) -> None:
    # The rest of its micro-batch is still one batch, in its place in the order.
    fetch = fetch_same if fetched else None
    kw: dict[str, Any] = {"batch_size": 4, "num_workers": 2, "on_error": "skip", "fetch": fetch}
    with StreamLoader(range(12), ExitOn(7), **kw) as stream:
        got = drive(mode, stream)
        st = stream.stats()
    assert as_lists(got) == [[0, 1, 2, 3], [4, 5, 6], [8, 9, 10, 11]]
    assert st.skipped == 1 and st.isolated == 1 and st.retries >= 2


def test_on_error_skip_drops_an_item_that_overruns_the_timeout(mode: str) -> None:
    kw: dict[str, Any] = {"batch_size": 3, "num_workers": 1, "timeout": 0.5, "on_error": "skip"}
    with StreamLoader(range(6), HangOn(3), **kw) as stream:
        got = drive(mode, stream)
        st = stream.stats()
    assert as_lists(got) == [[0, 1, 2], [4, 5]]
    assert st.skipped == 1 and st.isolated == 1


def test_unpicklable_exception_becomes_remote_error() -> None:
    with StreamLoader(range(4), raise_unpicklable, batch_size=2, num_workers=1) as stream:
        with pytest.raises(RemoteError, match="cannot travel") as info:
            drive("for", stream)
    assert "stream item 2" in _notes(info.value)


def _with_a_lock_at(n: int, bad: int) -> list[Any]:
    items: list[Any] = list(range(n))
    items[bad] = threading.Lock()  # an item that cannot be pickled
    return items


@pytest.mark.parametrize("size", [4, 1], ids=["in-a-micro-batch", "alone"])
def test_an_item_that_cannot_be_pickled_is_named_by_its_position(mode: str, size: int) -> None:
    with StreamLoader(_with_a_lock_at(12, 6), identity, batch_size=size, num_workers=1, collate_fn=list) as st:
        seen: list[Any] = []
        with pytest.raises(TypeError, match="pickle") as info:
            drive(mode, st, lambda i, b: seen.append(b))
    assert "stream item 6 " in _notes(info.value) or "source items 6..6" in _notes(info.value)
    assert "could not be pickled to travel to a worker" in _notes(info.value)
    assert seen == [[0, 1, 2, 3]] if size == 4 else seen == [[k] for k in range(6)]


@pytest.mark.parametrize("size", [4, 1], ids=["in-a-micro-batch", "alone"])
def test_on_error_skip_drops_an_item_that_cannot_be_pickled(mode: str, size: int) -> None:
    kw: dict[str, Any] = {"batch_size": size, "num_workers": 1, "on_error": "skip", "collate_fn": list}
    with StreamLoader(_with_a_lock_at(12, 6), identity, **kw) as st:
        got = [x for b in drive(mode, st) for x in b]
        stats = st.stats()
    assert got == [k for k in range(12) if k != 6]
    assert stats.skipped == 1


class _HoldsALock:
    """A callable that cannot be pickled, even by value (it holds a lock)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()

    def __call__(self, x: Any) -> Any:
        return x


def test_unpicklable_fn_is_refused_at_construction() -> None:
    with pytest.raises(DatasetPickleError, match="fn"):
        StreamLoader(range(3), _HoldsALock(), num_workers=1)  # (a lambda travels by value)
    # Thread mode does not pickle.
    with StreamLoader(range(3), lambda x: x + 1, batch_size=3) as stream:
        assert drive("for", stream)[0].tolist() == [1, 2, 3]


def test_dataloader_and_stream_share_one_pool(mode: str) -> None:
    with aioloader.WorkerPool(2) as pool:
        with aioloader.DataLoader(RangeDataset(8), 4, pool=pool) as loader:
            first = [b[1].tolist() for b in loader]
            pids = pool.worker_pids()
            with StreamLoader(range(8), square, batch_size=4, pool=pool) as stream:
                got = drive(mode, stream)
            assert as_lists(got) == [[0, 1, 4, 9], [16, 25, 36, 49]]
            assert [b[1].tolist() for b in loader] == first
            assert pool.worker_pids() == pids  # one set of processes served both
        assert not pool.closed


def test_dataloader_and_stream_share_one_executor(mode: str) -> None:
    with cf.ThreadPoolExecutor(2) as ex:
        with (
            aioloader.DataLoader(RangeDataset(4), 2, executor=ex) as loader,
            StreamLoader(range(4), square, batch_size=2, executor=ex) as stream,
        ):
            assert [b[1].tolist() for b in loader] == [[0, 1], [2, 3]]
            assert as_lists(drive(mode, stream)) == [[0, 1], [4, 9]]


# ---------------------------------------------------------------------- lifecycle
def test_closed_stream_refuses_iteration(mode: str) -> None:
    stream = StreamLoader(range(3))
    stream.close()
    stream.close()  # idempotent
    assert stream.closed
    with pytest.raises(LoaderClosedError):
        drive(mode, stream)


def test_new_iteration_supersedes_an_open_one() -> None:
    with StreamLoader(itertools.count(), batch_size=2) as stream:
        first = iter(stream)
        assert next(first).tolist() == [0, 1]
        second = iter(stream)
        assert next(second).tolist()[0] >= 2  # the same iterator, continued
        with pytest.raises(StopIteration):
            next(first)


def test_a_second_consumer_thread_is_refused_and_the_first_goes_on(mode: str) -> None:
    # The first consumer, in this thread, holds its iteration open while another thread
    # tries to iterate the same stream: that one raises, and the first loses no item.
    with StreamLoader(range(200), batch_size=10, collate_fn=list) as stream:
        errors: list[BaseException] = []

        def second() -> None:
            try:
                drive(mode, stream)
            except BaseException as exc:
                errors.append(exc)

        def step(i: int, batch: Any) -> None:
            if i == 0:
                t = threading.Thread(target=second)
                t.start()
                t.join(30)
                assert not t.is_alive()

        got = drive(mode, stream, step)
        assert [x for b in got for x in b] == list(range(200))
        assert len(errors) == 1 and isinstance(errors[0], RuntimeError), errors
        assert "another thread" in str(errors[0])
        # Once the first iteration is over, another thread may iterate.
        out: list[Any] = []
        t = threading.Thread(target=lambda: out.extend(drive(mode, stream)))
        t.start()
        t.join(30)
        assert [x for b in out for x in b] == list(range(200))


@pytest.mark.asyncio
async def test_superseded_consumer_ends_quietly(request: pytest.FixtureRequest) -> None:
    """A consumer waiting for a batch when a new iteration takes over sees the end of
    its iteration, not a CancelledError it never asked for."""
    key = request.node.nodeid
    with cf.ThreadPoolExecutor(2) as ex:
        stream = StreamLoader(range(10), HoldFirst(f"{key}:release"), batch_size=1, executor=ex)
        got: list[Any] = []

        async def first() -> None:
            async for b in stream:
                got.append(b)

        consumer = asyncio.create_task(first())
        await gate(f"{key}:done:1").wait()  # item 1 done; the consumer waits on item 0
        second = stream.__aiter__()
        nxt = asyncio.ensure_future(second.__anext__())  # takes over the stream
        await asyncio.wait_for(consumer, 10)  # ended without an exception
        assert got == []
        gate(f"{key}:release").set()
        assert (await asyncio.wait_for(nxt, 10)).tolist() == [0]
        await second.aclose()  # type: ignore[attr-defined]
        await stream.aclose()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"batch_size": 0}, "batch_size"),
        ({"max_latency": -1}, "max_latency"),
        ({"max_latency": float("nan")}, "max_latency"),
        ({"timeout": 0}, "timeout"),
        ({"prefetch": 0}, "prefetch"),
        ({"on_error": "ignore"}, "on_error"),
        ({"batched_fn": True}, "batched_fn"),
        ({"num_workers": 1, "pool": "shared"}, "conflict"),
        ({"pool": "shared", "executor": "thread"}, "at most one"),
    ],
)
def test_validation(kwargs: dict[str, Any], match: str) -> None:
    with aioloader.WorkerPool(0) as pool, cf.ThreadPoolExecutor(1) as ex:
        resolved = {k: pool if v == "shared" else ex if v == "thread" else v for k, v in kwargs.items()}
        with pytest.raises(ValueError, match=match):
            StreamLoader(range(3), **resolved)


def test_source_type_is_checked() -> None:
    with pytest.raises(TypeError, match="source"):
        StreamLoader(42)  # type: ignore[arg-type]

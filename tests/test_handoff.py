"""The hand-offs between threads on the consumer's side: the portal's call (the sync face's
round trip into its loop) and the pool's wake-ups of an event loop from the executor's thread."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import gc
import threading
import weakref
from typing import Any

import pytest

import aioloader
from aioloader import _wake
from aioloader._portal import END, Feed, Portal

from ._datasets import RangeDataset
from .conftest import wait_until

WAIT = 30.0  # seconds: bounds every wait on another thread, never a timing assertion


# ------------------------------------------------------------------------ the pool's waker
def test_waker_settles_a_burst_with_one_wake_up() -> None:
    loop = asyncio.new_event_loop()
    try:
        calls: list[Any] = []
        real = loop.call_soon_threadsafe

        def counting(cb: Any, *args: Any) -> Any:
            calls.append(cb)
            return real(cb, *args)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign,assignment]
        waker = _wake.Waker(loop)
        waiters = [loop.create_future() for _ in range(5)]

        # The loop is not running: every wake after the first joins the pending one.
        def wake_all() -> None:
            for w in waiters:
                waker.wake(w)

        t = threading.Thread(target=wake_all)
        t.start()
        t.join(WAIT)
        assert len(calls) == 1
        loop.run_until_complete(asyncio.wait_for(asyncio.gather(*waiters), WAIT))
        assert all(w.done() for w in waiters)
        # Once settled, the next result schedules a wake-up of its own.
        late = loop.create_future()
        waker.wake(late)
        loop.run_until_complete(asyncio.wait_for(late, WAIT))
        assert len(calls) == 2
    finally:
        loop.close()


def test_a_failing_wake_up_callback_strands_nothing_else() -> None:
    # One wake-up runs every callback that joined it (results, the for face's
    # releases): one that raises is reported to the loop and the others still run.
    loop = asyncio.new_event_loop()
    try:
        reported: list[dict[str, Any]] = []
        loop.set_exception_handler(lambda _loop, ctx: reported.append(ctx))
        waker = _wake.Waker(loop)
        ran: list[str] = []

        def bad() -> None:
            raise ValueError("boom")

        waker.call(bad)
        waker.call(ran.append, "after")
        waiter = loop.create_future()
        waker.wake(waiter)
        loop.run_until_complete(asyncio.wait_for(waiter, WAIT))
        assert ran == ["after"]
        assert len(reported) == 1 and isinstance(reported[0]["exception"], ValueError)
    finally:
        loop.close()


def test_waker_of_a_closed_loop_is_quiet_and_loops_are_held_weakly() -> None:
    loop = asyncio.new_event_loop()
    waker = _wake.waker_for(loop)
    assert _wake.waker_for(loop) is waker  # one per loop
    waiter = loop.create_future()
    loop.close()
    waker.wake(waiter)  # nobody waits: no error, nothing pending
    waker.wake(waiter)
    ref = weakref.ref(loop)
    del loop, waiter
    gc.collect()
    assert ref() is None


def test_results_reach_both_faces_through_the_waker() -> None:
    with aioloader.DataLoader(RangeDataset(40), 4, num_workers=2, seed=0) as loader:
        assert [int(i) for b in loader for i in b[1]] == list(range(40))

        async def consume() -> list[int]:
            return [int(i) async for b in loader for i in b[1]]

        assert asyncio.run(consume()) == list(range(40))


# ---------------------------------------------------------------------- the portal's call
@pytest.fixture
def portal() -> Any:
    p = Portal(name="aioloader-test-portal")
    yield p
    p.close()


def test_call_returns_and_raises_in_the_caller(portal: Portal) -> None:
    async def value() -> int:
        return 7

    async def fail() -> None:
        raise KeyError("boom")

    assert portal.call(value()) == 7
    with pytest.raises(KeyError, match="boom"):
        portal.call(fail())
    assert portal.call(value()) == 7


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit])
def test_fatal_exceptions_reach_the_caller_and_spare_the_loop(
    portal: Portal, exc: type[BaseException]
) -> None:
    async def fatal() -> None:
        raise exc

    async def value() -> str:
        return "alive"

    with pytest.raises(exc):
        portal.call(fatal())
    assert portal.call(value()) == "alive"
    assert portal.thread.is_alive()


def test_timeout_cancels_the_coroutine(portal: Portal) -> None:
    ended = threading.Event()

    async def forever() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            ended.set()

    with pytest.raises(cf.TimeoutError):
        portal.call(forever(), timeout=0.3)
    assert ended.wait(WAIT)


@pytest.mark.parametrize("how", ["call", "feed"])
def test_portal_closed_under_a_waiting_caller(portal: Portal, how: str) -> None:
    # portal.call() (one-off calls) and Feed.get() (the for face) wait on the loop alike.
    started = threading.Event()
    seen: list[BaseException] = []

    async def forever() -> None:
        started.set()
        await asyncio.Event().wait()

    def caller() -> None:
        try:
            if how == "call":
                portal.call(forever())
            else:
                Feed(portal, forever).get()
        except BaseException as exc:
            seen.append(exc)

    t = threading.Thread(target=caller)
    t.start()
    assert started.wait(WAIT)
    portal.close()
    t.join(WAIT)
    assert not t.is_alive()
    assert len(seen) == 1 and isinstance(seen[0], aioloader.LoaderClosedError)


def test_no_task_is_left_behind_per_call(portal: Portal) -> None:
    async def value(i: int) -> int:
        return i

    assert [portal.call(value(i)) for i in range(50)] == list(range(50))

    async def pending() -> int:
        me = asyncio.current_task()
        return len([t for t in asyncio.all_tasks() if t is not me and not t.done()])

    assert portal.call(pending()) == 0


# ------------------------------------------------------------------- the for face's feed
def _taker(items: list[Any], end: BaseException | None = None) -> Any:
    it = iter(items)

    async def take() -> Any:
        try:
            return next(it)
        except StopIteration:
            raise end if end is not None else StopAsyncIteration from None

    return take


def test_feed_hands_items_in_order_then_the_end(portal: Portal) -> None:
    feed = Feed(portal, _taker(list(range(50))))
    got = []
    while True:
        item, waited = feed.get()
        assert isinstance(waited, int) and waited >= 0
        if item is END:
            break
        got.append(item)
    assert got == list(range(50))


@pytest.mark.parametrize("exc", [KeyError("bad key"), SystemExit(3)])
def test_feed_raises_an_error_after_the_items_taken_before_it(portal: Portal, exc: BaseException) -> None:
    feed = Feed(portal, _taker([1, 2, 3], exc))
    assert [feed.get()[0] for _ in range(3)] == [1, 2, 3]
    with pytest.raises(type(exc)):
        feed.get()
    assert portal.thread.is_alive()  # SystemExit reached the consumer, not the loop


def test_feed_aclose_stops_taking_and_leaves_no_task(portal: Portal) -> None:
    calls: list[int] = []
    gate = asyncio.Event()

    async def take() -> int:
        calls.append(1)
        if len(calls) > 2:
            await gate.wait()  # the third take waits for ever
        return len(calls)

    feed = Feed(portal, take)
    assert [feed.get()[0] for _ in range(2)] == [1, 2]

    async def close_and_count() -> int:
        await feed.aclose()
        me = asyncio.current_task()
        return len([t for t in asyncio.all_tasks() if t is not me and not t.done()])

    assert portal.call(close_and_count()) == 0
    assert len(calls) == 3


@pytest.mark.timeout(120)
def test_the_for_face_takes_ahead_but_the_state_counts_what_it_accepted() -> None:
    # The feed takes finished batches ahead of the iterating thread; state_dict() must
    # still report only the batches that thread received, and resuming from it must give
    # exactly the rest of the epoch (nothing taken ahead is lost or repeated).
    def make() -> aioloader.DataLoader[Any]:
        return aioloader.DataLoader(RangeDataset(64), 4, shuffle=True, seed=3, num_workers=2, prefetch=4)

    with make() as loader:
        reference = [b[1].tolist() for b in loader]
    with make() as loader:
        it = iter(loader)
        head = [next(it)[1].tolist() for _ in range(3)]
        p = loader._active
        assert p is not None
        wait_until(lambda: p.left - p.untaken >= 2, WAIT, "the feed to take two batches ahead")
        state = loader.state_dict()
        it.close()
    assert head == reference[:3]
    with make() as resumed:
        resumed.load_state_dict(state)
        assert [b[1].tolist() for b in resumed] == reference[3:]


@pytest.mark.timeout(60)
def test_a_superseded_iteration_yields_nothing_it_was_handed_ahead() -> None:
    # The feed took the whole (short) stream ahead and the run ended; a new iteration
    # then supersedes the first, which must end at once, as when nothing was taken ahead.
    with aioloader.StreamLoader(list(range(8)), batch_size=2, prefetch=8) as stream:
        first = iter(stream)
        assert next(first).tolist() == [0, 1]
        run = stream._active
        assert run is not None
        wait_until(lambda: run.closed, WAIT, "the feed to take the whole stream")
        second = iter(stream)
        next(second)
        assert list(first) == []

"""Batcher: one awaitable result per request, micro-batched on the loaders' engine."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import pickle
import re
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import aioloader
from aioloader import (
    Batcher,
    DeadlineExceeded,
    LoaderClosedError,
    LoaderTimeout,
    Overloaded,
    WorkerCrashedError,
)
from aioloader._engine.requests import RequestQueue, ServeCounters

from . import _serve_helpers as H
from .conftest import wait_until_async


@pytest.fixture(autouse=True)
def _reset() -> Iterator[None]:
    H.reset()
    yield
    H.hold.set()  # never leave a worker thread blocked


async def _until(cond: Callable[[], bool], what: str) -> None:
    """Run turns of the event loop until ``cond`` holds: a bounded wait on state the test
    can see (each turn lets every ready task run once), never a timed sleep."""
    for _ in range(10_000):
        if cond():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"never happened: {what}")


async def _wait_entered() -> None:
    await asyncio.get_running_loop().run_in_executor(None, H.entered.wait, 20)
    assert H.entered.is_set()


@pytest.mark.parametrize("workers", [0, 2], ids=["thread", "processes"])
@pytest.mark.asyncio
async def test_each_request_gets_its_own_result_or_error(workers: int) -> None:
    async with Batcher(H.square, batch_size=4, max_latency=0.05, num_workers=workers) as b:
        out = await b.submit_many([1, 2, -3, 4, 5], return_exceptions=True)
        assert out[:2] == [1, 4] and out[3:] == [16, 25]
        err = out[2]
        assert isinstance(err, ValueError) and "negative input -3" in str(err)
        assert any("request 2" in n for n in err.__notes__)
        st = b.stats()
    assert (st.submitted, st.completed, st.failed) == (5, 4, 1)
    assert sum(k * v for k, v in st.batch_sizes.items()) == 5
    assert st.queue_wait_s[0] is not None and st.service_s[2] is not None
    assert "5 submitted" in str(st)


@pytest.mark.asyncio
async def test_batched_fn_results_and_whole_batch_errors() -> None:
    async with Batcher(H.squares, batched_fn=True, batch_size=8, max_latency=0.05) as b:
        assert await b.submit_many([1, 2, 3]) == [1, 4, 9]
        out = await b.submit_many([5, -1], return_exceptions=True)
    assert all(isinstance(e, ValueError) for e in out)
    async with Batcher(H.too_few, batched_fn=True, batch_size=8, max_latency=0.05) as b:
        with pytest.raises(ValueError, match="returned 1 results for 2 items"):
            await b.submit_many([1, 2])


@pytest.mark.asyncio
async def test_cancelled_before_dispatch_never_reaches_a_worker() -> None:
    async with Batcher(H.held, batch_size=1, max_latency=0, prefetch=1) as b:
        first = asyncio.ensure_future(b.submit("hold"))
        await _wait_entered()  # the only slot is busy: the next item waits in the queue
        doomed = asyncio.ensure_future(b.submit("doomed"))
        await _until(lambda: b.stats().waiting == 1, "the request to be queued")
        assert b.stats().waiting == 1  # it is queued, not yet dispatched
        doomed.cancel()
        with pytest.raises(asyncio.CancelledError):
            await doomed
        H.hold.set()
        assert await first == "hold"
        assert await b.submit("after") == "after"
        st = b.stats()
    assert H.calls == ["hold", "after"]
    assert st.cancelled_before_dispatch == 1


@pytest.mark.asyncio
async def test_cancelled_after_dispatch_drops_the_result() -> None:
    async with Batcher(H.held, batch_size=1, max_latency=0) as b:
        running = asyncio.ensure_future(b.submit("hold"))
        await _wait_entered()
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running
        H.hold.set()
        assert await b.submit("next") == "next"  # the dropped result was delivered first
        st = b.stats()
    assert st.cancelled_after_dispatch == 1 and st.completed == 1


@pytest.mark.asyncio
async def test_deadline_passes_before_dispatch_without_a_worker() -> None:
    async with Batcher(H.held, batch_size=1, max_latency=0, prefetch=1) as b:
        first = asyncio.ensure_future(b.submit("hold"))
        await _wait_entered()
        with pytest.raises(DeadlineExceeded, match=r"deadline of 0\.01"):
            await b.submit("late", deadline=0.01)
        H.hold.set()
        await first
        st = b.stats()
    assert "late" not in H.calls and st.expired == 1


@pytest.mark.asyncio
async def test_deadline_also_bounds_a_dispatched_request() -> None:
    async with Batcher(H.held, batch_size=1, max_latency=0, prefetch=1) as b:
        assert await b.submit("warm") == "warm"  # the worker thread is up
        with pytest.raises(DeadlineExceeded, match="still at a worker") as info:
            await b.submit("hold", deadline=0.3)  # fn runs until the test releases it
        assert info.value.dispatched is True and info.value.deadline == 0.3
        assert H.entered.is_set()
        H.hold.set()
        assert await b.submit("next") == "next"  # the late result was dropped on arrival
        st = b.stats()
    assert (st.expired, st.expired_after_dispatch, st.completed) == (0, 1, 2)


@pytest.mark.asyncio
async def test_a_request_that_would_answer_past_its_deadline_is_refused_at_once() -> None:
    async with Batcher(H.held, batch_size=1, max_latency=0, prefetch=1) as b:
        assert await b.submit("learn") == "learn"  # one answer: the Batcher knows a service time
        first = asyncio.ensure_future(b.submit("hold"))
        await _wait_entered()
        with pytest.raises(Overloaded, match=r"past its deadline of 0\.0 s") as info:
            await b.submit("late", deadline=0.0)  # work is ahead of it: no estimate fits 0 s
        assert info.value.estimate is not None and info.value.estimate > 0
        roomy = asyncio.ensure_future(b.submit("roomy", deadline=60.0))
        await _until(lambda: b.stats().waiting == 1 or roomy.done(), "the request to be admitted")
        assert b.stats().waiting == 1  # admitted and queued, not refused
        H.hold.set()
        assert await asyncio.gather(first, roomy) == ["hold", "roomy"]
        st = b.stats()
    assert (st.rejected, st.rejected_late) == (1, 1) and "late" not in H.calls


@pytest.mark.asyncio
async def test_admission_estimate_and_dispatch_time_expiry() -> None:
    """The queue's model, with its learnt costs set by hand: the work ahead counts
    requests at the same priority or higher; a request with less time left than one item
    takes is expired when the queue is cut, not sent to a worker."""
    q = RequestQueue(None, batch_size=4, max_latency=0, max_pending=100, counters=ServeCounters())  # type: ignore[arg-type]
    q.model.concurrency = 2
    assert q.estimate(0) is None  # nothing learnt yet: everything is admitted
    q.model.item_s, q.model.service_s, q.model.drain_s = 0.010, 0.030, 0.005
    futures = [await q.put(i, 0, None, False) for i in range(6)] + [
        await q.put(i, 5, None, False) for i in range(2)
    ]
    assert q.estimate(0) == pytest.approx((8 * 0.005 + 0.030, 8))
    assert q.estimate(5) == pytest.approx((2 * 0.005 + 0.030, 2))
    assert q.estimate(9) == pytest.approx((0.030, 0))
    with pytest.raises(Overloaded) as info:
        await q.put("late", 0, 0.05, False)  # about 70 ms of work ahead of it
    assert info.value.estimate == pytest.approx(0.070)
    with pytest.raises(Overloaded, match="20% of a deadline spare"):
        await q.put("edge", 5, 0.045, False)  # 40 ms at its priority: in time, but too close
    soon = await q.put("soon", 5, 0.06, False)  # 40 ms at its priority: two thirds of 60 ms
    q.model.item_s = 10.0  # now one item takes longer than any deadline left
    unit = await q.next_unit()
    assert unit is not None and [r.item for r in unit.requests] == [0, 1, 0, 1]  # priority 5 first
    with pytest.raises(DeadlineExceeded, match="less time left than one item") as late:
        await soon
    assert late.value.dispatched is False
    assert (q.counters.rejected_late, q.counters.expired) == (2, 1)
    await q.aclose()
    # dispatched or still queued, every request is failed by the close, none left pending
    assert all(isinstance(f.exception(), LoaderClosedError) for f in futures)


def _queue(batch_size: int = 4, max_pending: int = 100, max_latency: float = 60.0) -> RequestQueue:
    # idle() is False until a test says otherwise: every worker busy, a cut waits to fill
    return RequestQueue(None, batch_size=batch_size, max_latency=max_latency, max_pending=max_pending, counters=ServeCounters())  # type: ignore[arg-type]  # fmt: skip


@pytest.mark.asyncio
async def test_a_request_cancelled_or_expired_while_its_micro_batch_fills_is_not_sent() -> None:
    q = _queue(max_pending=3)
    gone = await q.put("cancelled", 0, None, False)
    late = await q.put("expires", 0, 0.02, False)
    cut = asyncio.ensure_future(q.next_unit())
    await _until(lambda: q.waiting == 0, "the cut to take both")  # and wait for more
    assert not cut.done() and q.waiting == 0
    gone.cancel()
    with pytest.raises(DeadlineExceeded) as info:
        await late
    assert info.value.dispatched is False
    kept = await q.put("kept", 0, None, False)
    q.idle = lambda: True  # a worker frees: the cut goes with what is still live
    q._wake()
    unit = await cut
    assert unit is not None and [r.item for r in unit.requests] == ["kept"]
    assert (q.counters.cancelled_queued, q.counters.expired) == (1, 1)
    assert q.waiting == 0 and not q._by_priority
    for i in range(3):  # max_pending still means 3
        await q.put(i, 0, None, False)
    with pytest.raises(Overloaded, match="max_pending=3"):
        await q.put("one too many", 0, None, False)
    q.resolve(unit, ["done"], None)
    assert await kept == "done"
    await q.aclose()


@pytest.mark.asyncio
async def test_block_waits_for_room_no_longer_than_the_deadline() -> None:
    q = _queue(max_pending=1)
    first = await q.put("first", 0, None, False)
    with pytest.raises(DeadlineExceeded, match="for room in the queue") as info:
        await q.put("second", 0, 0.02, True)
    assert info.value.dispatched is False and q.counters.expired == 1
    assert q.waiting == 1 and not q._room
    await q.aclose()
    assert isinstance(first.exception(), LoaderClosedError)


@pytest.mark.asyncio
async def test_room_lets_in_every_blocked_submitter_it_can() -> None:
    q = _queue(batch_size=2, max_pending=2)
    held = [await q.put(i, 0, None, False) for i in range(2)]
    blocked = [asyncio.ensure_future(q.put(f"b{i}", 0, None, True)) for i in range(3)]
    await _until(lambda: len(q._room) == 3, "the three submitters to wait for room")
    assert len(q._room) == 3
    q.idle = lambda: True
    unit = await q.next_unit()  # two leave the queue: room for two, first come first served
    assert unit is not None and unit.size == 2
    let_in = await asyncio.wait_for(asyncio.gather(*blocked[:2]), 10)
    assert not blocked[2].done() and q.waiting == 2
    await q.aclose()
    assert all(isinstance(f.exception(), LoaderClosedError) for f in held + list(let_in))
    with pytest.raises(LoaderClosedError):  # still waiting at the close: told so
        await blocked[2]


@pytest.mark.asyncio
async def test_close_fails_the_requests_of_a_micro_batch_being_filled() -> None:
    q = _queue()
    filling = await q.put("filling", 0, None, False)
    cut = asyncio.ensure_future(q.next_unit())
    await _until(lambda: q.waiting == 0, "the cut to take the request")
    cut.cancel()  # the run's producer is cancelled first when a Batcher closes
    with pytest.raises(asyncio.CancelledError):
        await cut
    await q.aclose()
    with pytest.raises(LoaderClosedError, match="closed before request"):
        await filling


@pytest.mark.asyncio
async def test_dead_requests_release_their_items_and_the_heap_stays_bounded() -> None:
    q = _queue(max_pending=16)  # nothing is ever cut: every window slot busy
    reqs: list[asyncio.Future[Any]] = []
    for k in range(150):
        batch = [await q.put(bytearray(1024), 0, None, False) for _ in range(16)]
        for f in batch:
            f.cancel()
        await _until(lambda: q.counters.cancelled_queued == 16 * (k + 1), "the cancels to be counted")  # noqa: B023
        reqs += batch
    assert q.waiting == 0 and q.counters.cancelled_queued == 2400
    assert len(q.heap) <= 1024 + 16  # compacted, not 2,400 dead entries
    assert all(entry[2].item is None for entry in q.heap)
    await q.aclose()


@pytest.mark.asyncio
async def test_an_estimate_of_zero_does_not_stop_the_answers() -> None:
    # A clock too coarse to time a fast micro-batch (Windows before 3.13) makes the
    # service time, and so an estimate with nothing ahead, exactly 0.
    q = _queue(batch_size=1)
    q.model.item_s, q.model.service_s, q.model.drain_s = 0.0, 0.0, 0.0
    f = await q.put("x", 0, 1.0, False)
    q.idle = lambda: True
    unit = await q.next_unit()
    assert unit is not None and unit.requests[0].estimate == 0.0
    q.resolve(unit, ["answer"], None)
    assert await f == "answer" and q.model.ratio == 1.0
    await q.aclose()


@pytest.mark.asyncio
async def test_higher_priority_is_dispatched_first_fifo_within() -> None:
    async with Batcher(H.held, batch_size=1, max_latency=0, prefetch=1) as b:
        first = asyncio.ensure_future(b.submit("hold"))
        await _wait_entered()
        order = [("low-1", 0), ("high-1", 5), ("low-2", 0), ("high-2", 5), ("mid", 1)]
        tasks = [asyncio.ensure_future(b.submit(name, priority=p)) for name, p in order]
        await _until(lambda: b.stats().waiting == len(order), "all of them to be queued")
        assert b.stats().waiting == len(order)  # behind the held call
        H.hold.set()
        await asyncio.gather(first, *tasks)
    assert H.calls == ["hold", "high-1", "high-2", "mid", "low-1", "low-2"]


@pytest.mark.asyncio
async def test_admission_control_rejects_at_once_or_waits_with_block() -> None:
    async with Batcher(H.held, batch_size=1, max_latency=0, prefetch=1, max_pending=2) as b:
        first = asyncio.ensure_future(b.submit("hold"))
        await _wait_entered()
        queued = [asyncio.ensure_future(b.submit(i)) for i in (1, 2)]
        await _until(lambda: b.stats().waiting == 2, "both to be queued")
        assert b.stats().waiting == 2
        with pytest.raises(Overloaded, match="max_pending=2"):
            await b.submit(3)
        waiter = asyncio.ensure_future(b.submit(4, block=True))
        await _until(lambda: b._queue is not None and len(b._queue._room) == 1, "it to wait for room")
        assert not waiter.done()
        H.hold.set()
        assert await asyncio.gather(first, *queued, waiter) == ["hold", 1, 2, 4]
        assert b.stats().rejected == 1


@pytest.mark.asyncio
async def test_a_killed_worker_costs_no_request(tmp_path: Path) -> None:
    async with Batcher(
        H.DieOnce(str(tmp_path), victim=3), batch_size=2, max_latency=0.01, num_workers=1
    ) as b:
        out = await b.submit_many(range(6))
        st = b.stats()
    assert [x for x, _ in out] == list(range(6))
    assert (tmp_path / "died").exists() and st.restarts >= 1 and st.failed == 0


@pytest.mark.parametrize(("batch_size", "n", "poison"), [(16, 48, 20), (3, 9, 4)])
@pytest.mark.asyncio
async def test_a_request_that_kills_its_worker_fails_alone(batch_size: int, n: int, poison: int) -> None:
    # The poison shares a micro-batch with others (all n arrive at once): it runs again
    # alone, with its own max_retries, and only it fails.
    async with Batcher(H.Poison(exit_on=poison), batch_size=batch_size, max_latency=1, num_workers=2) as b:
        out = await b.submit_many(range(n), return_exceptions=True)
        st = b.stats()
    err = out[poison]
    assert isinstance(err, WorkerCrashedError), out
    assert [x for k, x in enumerate(out) if k != poison] == [i * 10 for i in range(n) if i != poison]
    assert err.indices == [poison] and err.exitcode == 3 and err.attempts == 3  # type: ignore[attr-defined]
    assert str(err).startswith(f"request {poison} (run alone after its micro-batch "), err
    assert "was lost to a dying worker 3 times (exit code 3); max_retries=2" in str(err), err
    # A Batcher's error names no DataLoader (torch's words are for the DataLoader face),
    # and stays one line (a service may put it in an answer)
    assert "DataLoader" not in str(err) and "\n" not in str(err), err
    assert "; the last worker to die was pid " in str(err), err
    assert st.isolated == 1 and st.failed == 1 and st.completed == n - 1
    assert batch_size in st.batch_sizes  # the poison did share a micro-batch


@pytest.mark.asyncio
async def test_a_request_that_overruns_the_timeout_fails_alone() -> None:
    async with Batcher(H.Poison(hang_on=4), batch_size=3, max_latency=1, num_workers=2, timeout=0.5) as b:
        out = await b.submit_many(range(9), return_exceptions=True)
        st = b.stats()
    err = out[4]
    assert isinstance(err, LoaderTimeout), out
    assert out[:4] + out[5:] == [0, 10, 20, 30, 50, 60, 70, 80]
    assert err.indices == [4]  # type: ignore[attr-defined]
    assert str(err).startswith(
        "request 4 (run alone after its micro-batch 1, requests [3, 4, 5], overran timeout=0.5 s) "
        "was not delivered within timeout=0.5 s"
    ), err
    assert st.isolated == 1 and st.failed == 1 and st.completed == 8


@pytest.mark.asyncio
async def test_requests_expired_or_cancelled_in_a_lost_micro_batch_do_not_run_again(tmp_path: Path) -> None:
    log, go, entered = (str(tmp_path / name) for name in ("log", "go", "entered"))
    fn = H.Poison(exit_on=4, log=log, go=go, entered=entered)
    async with Batcher(fn, batch_size=4, max_latency=1, num_workers=1, max_retries=1) as b:
        late = asyncio.ensure_future(b.submit(3, deadline=0.2))
        poison, cancelled, good = (asyncio.ensure_future(b.submit(i)) for i in (4, 5, 6))
        await wait_until_async(lambda: Path(entered).exists(), 20, "the poison at its worker")
        assert b.stats().in_flight == 4  # one micro-batch: 3 ran, 4 holds its worker
        with pytest.raises(DeadlineExceeded, match="still at a worker"):
            await late  # its deadline passes while the worker holds the micro-batch
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        Path(go).touch()  # now the worker dies; 4 and 6 run again alone, 3 and 5 do not
        alone = r"^request 1 \(run alone after its micro-batch 0, requests \[0, 1, 2, 3\]"
        with pytest.raises(WorkerCrashedError, match=alone) as info:
            await poison
        assert await good == 60
        st = b.stats()
    assert info.value.attempts == 2  # type: ignore[attr-defined]
    ran = H.logged(log)
    assert (ran.count(3), ran.count(4), ran.count(5), ran.count(6)) == (1, 3, 0, 1), ran
    assert st.isolated == 1 and st.expired_after_dispatch == 1 and st.cancelled_after_dispatch == 1


def test_submit_sync_from_many_threads() -> None:
    with Batcher(H.square, batch_size=8, max_latency=0.01) as b, cf.ThreadPoolExecutor(4) as ex:
        assert list(ex.map(b.submit_sync, range(40))) == [i * i for i in range(40)]
        with pytest.raises(ValueError, match="negative"):
            b.submit_sync(-1)
    assert b.closed


@pytest.mark.asyncio
async def test_submit_from_another_loop_hops_to_the_batchers_loop() -> None:
    async with Batcher(H.square, batch_size=4, max_latency=0.01) as b:
        result: list[int] = []
        t = threading.Thread(target=lambda: result.append(asyncio.run(b.submit(7))))
        t.start()
        await asyncio.get_running_loop().run_in_executor(None, t.join, 20)
        assert result == [49]


@pytest.mark.asyncio
async def test_close_fails_waiting_requests_and_refuses_new_ones() -> None:
    b = Batcher(H.held, batch_size=1, max_latency=0, prefetch=1)
    first = asyncio.ensure_future(b.submit("hold"))
    await _wait_entered()
    waiting = asyncio.ensure_future(b.submit("never"))
    await _until(lambda: b.stats().waiting == 1, "the request to be queued")
    H.hold.set()
    await b.aclose()
    for t in (first, waiting):
        with pytest.raises(LoaderClosedError):
            await t
    with pytest.raises(LoaderClosedError):
        await b.submit(1)


def test_bad_arguments_name_the_parameter() -> None:
    with pytest.raises(TypeError, match="fn"):
        Batcher(42)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_pending"):
        Batcher(H.square, max_pending=0)
    with pytest.raises(ValueError, match="max_latency"):
        Batcher(H.square, max_latency=-1)
    with pytest.raises(aioloader.DatasetPickleError, match="fn"):
        Batcher(H.HoldsALock(), num_workers=1)  # (a lambda travels by value)


def test_new_errors_pickle_whole() -> None:
    for exc in (
        Overloaded("full", max_pending=3, estimate=None),
        DeadlineExceeded("late", deadline=0.5, dispatched=False),
    ):
        back = pickle.loads(pickle.dumps(exc))
        assert type(back) is type(exc) and str(back) == str(exc) and back.__dict__ == exc.__dict__


@pytest.mark.asyncio
async def test_a_request_late_at_a_worker_calibrates_with_its_real_answer_time() -> None:
    # Its deadline is only a lower bound on when it would have been answered: the
    # correction learns from the answer when it comes, not from the deadline.
    q = _queue(batch_size=1)
    q.model.item_s, q.model.service_s, q.model.drain_s = 0.001, 0.001, 0.001
    q.idle = lambda: True
    f = await q.put("x", 0, 0.02, False)  # nothing ahead: admitted, estimated at 1 ms
    unit = await q.next_unit()
    assert unit is not None
    with pytest.raises(DeadlineExceeded, match="still at a worker"):
        await f
    assert q.model.ratio == 1.0  # not calibrated by the deadline
    q.resolve(unit, ["late"], None)  # the answer comes 20 ms or more after submit()
    assert q.model.ratio > 1 + (20 - 1) / 8 - 1e-9  # 1/8 of the way to actual/estimate >= 20
    await q.aclose()


# ------------------------------------------------- requests that cannot travel
def _own_errors(out: list[Any], bad: int) -> BaseException:
    """The one error of ``out`` (at ``bad``); every other slot a result."""
    err = out[bad]
    assert isinstance(err, TypeError) and "pickle" in str(err), out
    assert not any(isinstance(x, BaseException) for k, x in enumerate(out) if k != bad), out
    return err


@pytest.mark.parametrize("face", ["async", "sync"])
@pytest.mark.parametrize("what", ["request", "result"])
def test_a_request_or_result_that_cannot_be_pickled_fails_alone(face: str, what: str) -> None:
    # 16 requests in one micro-batch, one of which (or whose result) will not pickle.
    bad = 8
    items: list[Any] = list(range(16))
    items[bad] = threading.Lock() if what == "request" else -1
    b = Batcher(H.lock_for_minus_one, batch_size=16, max_latency=1.0, num_workers=1)
    with b:
        if face == "async":

            async def main() -> list[Any]:
                return await b.submit_many(items, return_exceptions=True)

            out = b._portal().call(main())
        else:
            with cf.ThreadPoolExecutor(16) as ex:
                futs = [ex.submit(b.submit_sync, x, timeout=30) for x in items]
                out = [f.exception() or f.result() for f in futs]
        st = b.stats()
    err = _own_errors(out, bad)
    assert [x for k, x in enumerate(out) if k != bad] == [k for k in range(16) if k != bad]
    notes = "\n".join(getattr(err, "__notes__", []))
    if what == "request":
        # Requests are numbered as they arrive: from 16 threads, not in list order.
        named = f"request {bad} " in notes if face == "async" else re.search(r"request \d+ ", notes) is not None
        assert named and "could not be pickled to travel to a worker" in notes, notes
    else:
        assert f"the result of request {bad} cannot be pickled" in notes, notes
    assert (st.completed, st.failed) == (15, 1)


@pytest.mark.asyncio
async def test_callers_of_one_failed_micro_batch_get_their_own_exception_objects() -> None:
    async with Batcher(H.squares, batched_fn=True, batch_size=8, max_latency=0.05) as b:
        out = await b.submit_many([5, -1, 3], return_exceptions=True)
    assert all(isinstance(e, ValueError) for e in out)
    assert len({id(e) for e in out}) == 3
    assert all("a negative input" in str(e) for e in out)
    assert any("request 2 failed with the whole" in n for n in out[2].__notes__)


# ------------------------------------------------------------ no call hangs
def test_submit_sync_on_the_batchers_own_loop_raises_at_once() -> None:
    b = Batcher(H.square, batch_size=4)

    async def main() -> None:
        assert await b.submit(2) == 4  # started on this loop
        with pytest.raises(RuntimeError, match="own event loop"):
            b.submit_sync(3, timeout=5)  # (bounds the wait where it would hang)

    try:
        asyncio.run(asyncio.wait_for(main(), 30))
    finally:
        b.close()


@pytest.mark.parametrize("workers", [0, 1], ids=["thread", "processes"])
def test_a_batcher_serves_one_asyncio_run_after_another(workers: int) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "coroutine was never awaited"
        b = Batcher(H.square, batch_size=4, num_workers=workers)
        try:
            assert asyncio.run(asyncio.wait_for(b.submit(3), 30)) == 9
            assert asyncio.run(asyncio.wait_for(b.submit(4), 30)) == 16
            assert asyncio.run(asyncio.wait_for(b.submit_many([1, 2]), 30)) == [1, 4]
            assert b.submit_sync(5, timeout=30) == 25  # then a private loop
            assert asyncio.run(asyncio.wait_for(b.submit(6), 30)) == 36  # which serves loops
            assert b.stats().completed == 6
        finally:
            b.close()


@pytest.mark.parametrize("started", ["private-loop", "asyncio-run", "never"])
def test_submit_sync_after_close_raises_loader_closed(started: str) -> None:
    b = Batcher(H.square, batch_size=4)
    if started == "private-loop":
        assert b.submit_sync(2, timeout=30) == 4
    elif started == "asyncio-run":
        assert asyncio.run(asyncio.wait_for(b.submit(2), 30)) == 4
    b.close()
    with pytest.raises(LoaderClosedError):
        b.submit_sync(3, timeout=30)
    with pytest.raises(LoaderClosedError):
        asyncio.run(asyncio.wait_for(b.submit(3), 30))


# -------------------------------------------------------- deadlines under load
@pytest.mark.asyncio
async def test_a_micro_batch_is_sized_to_the_tightest_deadline_it_carries() -> None:
    # 5 ms an item: a 16-item micro-batch takes 80 ms, more than a 50 ms deadline allows
    # (40 ms, with the fifth kept spare): it is cut at 8 or fewer, the rest wait.
    q = _queue(batch_size=16, max_latency=0.0)
    q.model.item_s = 0.005
    tight = [await q.put(i, 0, 0.05, True) for i in range(16)]
    unit = await q.next_unit()
    assert unit is not None and 1 <= unit.size <= 8, unit.size
    assert q.counters.cut_short == 1
    # Without deadlines nothing limits it but batch_size.
    q2 = _queue(batch_size=16, max_latency=0.0)
    q2.model.item_s = 0.005
    loose = [await q2.put(i, 0, None, True) for i in range(16)]
    unit2 = await q2.next_unit()
    assert unit2 is not None and unit2.size == 16 and q2.counters.cut_short == 0
    await q.aclose()
    await q2.aclose()
    for f in tight + loose:
        f.exception() if f.done() else f.cancel()


@pytest.mark.asyncio
async def test_overloaded_says_when_to_retry() -> None:
    q = _queue(max_pending=2)
    q.model.item_s, q.model.service_s, q.model.drain_s = 0.010, 0.030, 0.005
    futures = [await q.put(i, 0, None, False) for i in range(2)]
    with pytest.raises(Overloaded) as full:
        await q.put("full", 0, None, False)
    assert full.value.retry_after == pytest.approx(0.005)
    q.max_pending = 100
    with pytest.raises(Overloaded) as late:
        await q.put("late", 0, 0.02, False)  # about 40 ms ahead of a 20 ms deadline
    assert late.value.estimate is not None
    assert late.value.retry_after == pytest.approx(late.value.estimate - 0.02 * 0.8)
    await q.aclose()
    assert all(isinstance(f.exception(), LoaderClosedError) for f in futures)

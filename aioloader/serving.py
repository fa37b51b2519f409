"""``Batcher``: one awaitable result per request, micro-batched for the workers.

An inference service wants the opposite of a loader's view: each request awaits *its
own* preprocessed result, while the library groups concurrent requests into
micro-batches (up to ``batch_size`` items, waiting at most ``max_latency`` after the
first one arrived). It runs on the loaders' engine: the same pool sharing, crash
recovery, timeouts, statistics and traces. What is particular to serving:

* **errors are per request**: one item whose ``fn`` raises fails only its own
  ``submit()``; the rest of its micro-batch gets results;
* **one bad request fails alone**: a micro-batch lost to a dying worker, or overrunning
  ``timeout``, runs again one request a task, each with the whole ``max_retries``; only
  a request that keeps killing its worker (or overruns alone) fails, with
  :class:`~aioloader.WorkerCrashedError` (or :class:`~aioloader.LoaderTimeout`) naming
  it;
* **cancellation**: a caller cancelled before its item was dispatched removes the item
  (no worker sees it); cancelled after, its result is dropped;
* **deadlines**: ``deadline=`` seconds from ``submit()``, end to end: the request is
  answered by then, or fails with :class:`~aioloader.DeadlineExceeded` (before dispatch
  without using a worker; at a worker, its result is dropped when it comes);
* **priorities**: higher ``priority`` first; first come, first served within one;
* **admission control**: ``submit()`` raises :class:`~aioloader.Overloaded` at once when
  ``max_pending`` requests already wait (``block=True`` waits for room instead), or when
  the request has a deadline that the Batcher estimates it would miss: the work ahead of
  it at its priority, drained at the rate the pool answers, plus the measured service
  time, corrected by how far past estimates were off, must leave a fifth of the
  deadline spare.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from multiprocessing.context import BaseContext
from typing import Any, Generic

from ._engine.epochs import WorkerSide
from ._engine.requests import RequestQueue, ServeCounters, percentiles
from ._engine.run import Run
from ._engine.units import RunConfig
from ._facade import LoaderBase
from ._pool import WorkerPool
from ._stats import Recorder, fmt_ms
from ._types import Batch
from ._validate import check_bool, check_int, check_seconds
from ._worker import tasks as _tasks
from ._worker.serve import PerBatch, PerItem
from ._worker.stream import StreamContext
from .errors import LoaderClosedError

__all__ = ["Batcher", "BatcherStats"]


@dataclass(frozen=True)
class BatcherStats:
    """A snapshot of a Batcher's statistics (``batcher.stats()``); ``print()`` it."""

    submitted: int
    """Requests accepted into the queue."""
    completed: int
    """Requests answered with a result."""
    failed: int
    """Requests answered with their ``fn``'s exception (or their micro-batch's error)."""
    rejected: int
    """``submit()`` calls refused with ``Overloaded``: the queue held ``max_pending``, or
    the estimated answer left less than a fifth of the request's ``deadline`` spare
    (``rejected_late``)."""
    rejected_late: int
    """Of ``rejected``: refused because their estimated answer came too close to (within
    a fifth of) or after their deadline."""
    expired: int
    """Requests whose ``deadline`` passed before dispatch (no worker time used)."""
    expired_after_dispatch: int
    """Requests still at a worker at their ``deadline`` (failed then, result dropped)."""
    cancelled_before_dispatch: int
    """Requests whose caller went away while they waited (no worker time used)."""
    cancelled_after_dispatch: int
    """Requests whose caller went away while a worker ran them (result dropped)."""
    waiting: int
    """Requests in the queue right now."""
    in_flight: int
    """Requests dispatched and not yet answered right now."""
    queue_wait_s: tuple[float | None, float | None, float | None]
    """p50, p99 and max of the time from ``submit()`` to dispatch (last 10,000)."""
    service_s: tuple[float | None, float | None, float | None]
    """p50, p99 and max of the time from dispatch to the answer (last 10,000)."""
    batch_sizes: dict[int, int]
    """Micro-batch size -> how many micro-batches had it."""
    retries: int
    """Tasks resubmitted after a worker died (a request running alone counts its own)."""
    restarts: int
    """Times the pool was rebuilt."""
    isolated: int = 0
    """Micro-batches lost to a dying worker or overrunning ``timeout`` whose requests
    then ran one a task, so that only the culprit failed."""
    cut_for_deadline: int = 0
    """Micro-batches dispatched below ``batch_size`` because one more request would have
    made them end past the tightest deadline they carried (by the measured cost per item)."""

    def __str__(self) -> str:
        sizes = ", ".join(f"{k}x{v}" for k, v in sorted(self.batch_sizes.items())) or "-"
        return (
            f"Batcher: {self.submitted} submitted, {self.completed} completed, {self.failed} failed, "
            f"{self.rejected} rejected ({self.rejected_late} for their deadline), {self.expired} expired "
            f"(+{self.expired_after_dispatch} in flight), cancelled {self.cancelled_before_dispatch} "
            f"queued / {self.cancelled_after_dispatch} running; now {self.waiting} waiting, "
            f"{self.in_flight} in flight\n"
            f"  queue wait ms p50/p99/max: {fmt_ms(*self.queue_wait_s)}\n"
            f"  service ms p50/p99/max:    {fmt_ms(*self.service_s)}\n"
            f"  micro-batch sizes (size x count): {sizes}\n"
            f"  retries {self.retries}, pool restarts {self.restarts}, "
            f"micro-batches run one request a task {self.isolated}, "
            f"cut short for a deadline {self.cut_for_deadline}"
        )


class Batcher(LoaderBase, Generic[Batch]):
    """Per-request results, micro-batched under a deadline (see the module docstring).

    Args:
        fn: applied in a worker to each submitted item (``fn(item)``), or once to the list
            of a micro-batch's items with ``batched_fn=True`` (it must then return one
            result per item). With workers it must pickle.
        batch_size: most items in a micro-batch.
        max_latency: seconds a micro-batch waits for more items after its first one
            arrived (``0``: dispatch what is waiting, never wait).
        num_workers: worker processes; ``0`` runs ``fn`` in one background thread.
        max_pending: most requests waiting for dispatch; beyond it ``submit()`` raises
            :class:`~aioloader.Overloaded` (or waits, with ``block=True``). A request with
            a ``deadline`` is also refused when its estimated answer would leave less than
            a fifth of the deadline spare.
        prefetch: micro-batches dispatched at once (default ``num_workers + 1``: one per
            worker and one ready behind them; requests beyond that wait in the queue,
            where they can still be prioritised, cancelled or expired).
        timeout: seconds a micro-batch may take from the moment it is due (its worker
            could start it: sent to an idle worker, or the task ahead of it answered)
            before its worker is killed and replaced; its requests then run one a task,
            and one that overruns alone fails with :class:`~aioloader.LoaderTimeout`.
        max_retries: resubmissions of a task whose worker died holding it. A micro-batch
            of several requests is not resubmitted whole: its requests run again one a
            task, each with this many retries of its own.
        mp_context: start method name or context (default ``forkserver``, else ``spawn``).
        pool: a :class:`~aioloader.WorkerPool` shared with other loaders (never closed
            by the Batcher).
        executor: any ``concurrent.futures.Executor`` (never shut down by the Batcher).
        trace: write a Chrome trace-event file here when the Batcher closes.

    Start it with ``async with batcher:`` (on your event loop) or ``with batcher:`` (on a
    private loop, for threaded servers and ``submit_sync``); the first ``submit`` also
    starts it on the loop it runs on.
    """

    _kind = "Batcher"
    _portal_name = "aioloader-batcher-portal"

    def __init__(
        self,
        fn: Callable[[Any], Any],
        *,
        batch_size: int = 32,
        max_latency: float = 0.005,
        num_workers: int = 0,
        batched_fn: bool = False,
        max_pending: int = 1024,
        prefetch: int | None = None,
        timeout: float | None = None,
        max_retries: int = 2,
        mp_context: str | BaseContext | None = None,
        pool: WorkerPool | None = None,
        executor: cf.Executor | None = None,
        trace: str | os.PathLike[str] | None = None,
    ) -> None:
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {fn!r}")
        self.fn = fn
        self.batch_size = check_int("batch_size", batch_size, 1)
        latency = check_seconds("max_latency", max_latency, allow_zero=True)
        if latency is None:
            raise ValueError("max_latency must be a number of seconds >= 0, got None")
        self.max_latency = latency
        self.batched_fn = check_bool("batched_fn", batched_fn)
        self.max_pending = check_int("max_pending", max_pending, 1)
        self.timeout = check_seconds("timeout", timeout, allow_zero=False)
        self.max_retries = check_int("max_retries", max_retries, 0)
        self._setup(
            num_workers=num_workers, mp_context=mp_context, pool=pool, executor=executor,
            prefetch=prefetch, transport="pickle", trace=trace,
        )  # fmt: skip
        if prefetch is None:
            self.prefetch = self._pool.concurrency + 1
        self._counters = ServeCounters()
        self._inline_ctx: StreamContext | None = None
        self._queue: RequestQueue | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._deliverer: asyncio.Task[None] | None = None
        self._run: Run | None = None
        self._prepare_now()

    # -------------------------------------------------------------------- payload
    def _worker_context(self) -> StreamContext:
        wrapped: Callable[[Any], Any] = PerBatch(self.fn) if self.batched_fn else PerItem(self.fn)
        return StreamContext(
            dataset=None,
            collate_fn=list,
            on_error="raise",
            seed_samples=False,
            fn=wrapped,
            batched_fn=self.batched_fn,
        )

    def _pickled_parts(self) -> Sequence[tuple[str, object]]:
        return (("fn", self.fn),)

    def _install_inline(self, ctx: _tasks.WorkerContext) -> None:
        assert isinstance(ctx, StreamContext)
        self._inline_ctx = ctx

    # -------------------------------------------------------------------- starting
    def _start_here(self) -> RequestQueue:
        """The queue, started on the running loop if it is not started yet, or if the
        loop it ran on is gone (closed, or no longer running: one ``asyncio.run`` after
        another). What it learnt of the pool's costs carries over."""
        loop = asyncio.get_running_loop()
        with self._lock:
            self._check_open()
            old = self._queue
            if old is not None:
                if not _gone(self._loop):
                    return old
                self._abandon()
            side = WorkerSide(self._token, 0, self._shared.get_payload, self._inline_ctx)
            queue = RequestQueue(side, self.batch_size, self.max_latency, self.max_pending, self._counters)
            if old is not None:
                queue.model = old.model
            run = Run(self._run_config(), queue)
            concurrency = self._pool.concurrency
            queue.idle = lambda: len(run.units) < concurrency
            queue.model.concurrency = concurrency
            self._recorder.on_task = queue.model.observe
            self._runs.add(run)
            run.start()
            self._deliverer = loop.create_task(_deliver(run, queue, self._recorder), name="aioloader-batcher")
            self._queue, self._loop, self._run = queue, loop, run
            return queue

    def _abandon(self) -> None:
        """Forget the run of a loop that is gone (the lock held): its tasks died with
        the loop; requests it still held can no longer be answered there."""
        run = self._run
        self._queue = self._loop = self._run = self._deliverer = None
        if run is not None:
            self._runs.discard(run)
            run.close_threadsafe()

    def _run_config(self) -> RunConfig:
        # each result goes out as soon as it is ready; a micro-batch's error fails its own
        # requests only; a lost micro-batch runs again one request a task
        return self._config(ordered=False, fail_fast=False, isolate=True)

    async def _start_async(self) -> None:
        self._start_here()

    def __enter__(self) -> Batcher[Batch]:
        """Start on a private event loop (for ``submit_sync`` and threaded servers)."""
        self._check_open()
        if _gone(self._loop):
            self._portal().call(self._start_async())
        return self

    async def __aenter__(self) -> Batcher[Batch]:
        self._start_here()
        return self

    # ------------------------------------------------------------------ requests
    async def submit(
        self, item: Any, *, priority: int = 0, deadline: float | None = None, block: bool = False
    ) -> Batch:
        """This item's result (``fn(item)``), computed in a micro-batch.

        ``deadline``: seconds from this call by which it is answered (see the module
        docstring); without ``block=True`` a request that would miss it by the Batcher's
        estimate is refused at once with :class:`~aioloader.Overloaded`.

        Raises what ``fn`` raised for this item (type kept, with a note), or
        :class:`~aioloader.Overloaded`, :class:`~aioloader.DeadlineExceeded`,
        :class:`~aioloader.LoaderTimeout`, :class:`~aioloader.WorkerCrashedError`,
        :class:`~aioloader.LoaderClosedError`. Cancelling the caller withdraws the item.
        """
        priority = check_int("priority", priority, -(2**62)) if priority else 0
        deadline = check_seconds("deadline", deadline, allow_zero=True)
        self._check_open()
        loop = asyncio.get_running_loop()
        home = self._loop
        if home is not None and home is not loop and not _gone(home):  # another loop's: hop over
            fut = asyncio.run_coroutine_threadsafe(self._submit_here(item, priority, deadline, block), home)
            return await asyncio.wrap_future(fut)
        return await self._submit_here(item, priority, deadline, block)

    async def _submit_here(self, item: Any, priority: int, deadline: float | None, block: bool) -> Batch:
        queue = self._start_here()
        result: Batch = await (await queue.put(item, priority, deadline, block))
        return result

    async def submit_many(
        self,
        items: Iterable[Any],
        *,
        priority: int = 0,
        deadline: float | None = None,
        block: bool = False,
        return_exceptions: bool = False,
    ) -> list[Any]:
        """The results of ``items``, in order (``asyncio.gather`` semantics for errors)."""
        calls = [self.submit(i, priority=priority, deadline=deadline, block=block) for i in items]
        return list(await asyncio.gather(*calls, return_exceptions=return_exceptions))

    def submit_sync(
        self,
        item: Any,
        *,
        priority: int = 0,
        deadline: float | None = None,
        block: bool = True,
        timeout: float | None = None,
    ) -> Batch:
        """:meth:`submit` from plain code in any thread but the Batcher's own loop thread
        (threaded servers). Starts the Batcher on a private loop if needed; waits at most
        ``timeout`` seconds (then the request is withdrawn and ``TimeoutError`` raised)."""
        self._check_open()
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is not None and running is self._loop:
            raise RuntimeError("submit_sync would block the Batcher's own event loop: await submit()")
        if _gone(self._loop):
            self.__enter__()
        home = self._loop
        assert home is not None
        coro = self.submit(item, priority=priority, deadline=deadline, block=block)
        try:
            fut = asyncio.run_coroutine_threadsafe(coro, home)
        except RuntimeError:  # its loop closed under us: the Batcher was closed
            coro.close()
            self._check_open()
            raise
        try:
            result: Batch = fut.result(timeout)
            return result
        except BaseException:
            fut.cancel()
            raise

    # --------------------------------------------------------------------- misc
    async def aclose(self) -> None:
        await super().aclose()
        task = self._deliverer
        if task is not None and task.get_loop() is asyncio.get_running_loop():
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    def stats(self) -> BatcherStats:
        """A frozen snapshot (cheap; safe from any thread)."""
        c = self._counters
        queue = self._queue
        return BatcherStats(
            submitted=c.submitted,
            completed=c.completed,
            failed=c.failed,
            rejected=c.rejected,
            rejected_late=c.rejected_late,
            expired=c.expired,
            expired_after_dispatch=c.expired_dispatched,
            cancelled_before_dispatch=c.cancelled_queued,
            cancelled_after_dispatch=c.cancelled_dispatched,
            waiting=queue.waiting if queue is not None else 0,
            in_flight=len(queue.outstanding) if queue is not None else 0,
            queue_wait_s=percentiles(c.queue_wait),
            service_s=percentiles(c.service),
            batch_sizes=dict(c.sizes),
            retries=self._recorder.retries,
            restarts=self._pool.restarts,
            isolated=self._recorder.isolated,
            cut_for_deadline=c.cut_short,
        )

    def __repr__(self) -> str:
        return (
            f"<aioloader.Batcher batch_size={self.batch_size} max_latency={self.max_latency} "
            f"num_workers={self.num_workers} {self._state.value}>"
        )


def _gone(loop: asyncio.AbstractEventLoop | None) -> bool:
    """Is there no loop, or one that can no longer answer (closed, or not running)?"""
    return loop is None or loop.is_closed() or not loop.is_running()


async def _deliver(run: Run, queue: RequestQueue, recorder: Recorder) -> None:
    """Hands each finished micro-batch's outcomes to its requests' futures."""
    rec = recorder.epoch_started(0)
    while True:
        try:
            d = await run.next(rec)
        except (StopAsyncIteration, LoaderClosedError):
            return
        try:
            queue.resolve(d.unit, d.data, d.error)  # type: ignore[arg-type]
        except Exception as exc:  # a defect here must fail its requests, not stop the answers
            for req in d.unit.requests:  # type: ignore[attr-defined]
                if not req.future.done():
                    req.future.set_exception(exc)

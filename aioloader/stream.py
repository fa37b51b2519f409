"""``StreamLoader``: batches from a stream of unknown length, with a latency bound.

Data flow, one iteration::

    source ──(feed: lazy, credit-gated)──▶ batcher ──(one task per micro-batch)──▶ pool
                                           │ size / deadline rule          fn + collate_fn
    consumer ◀──(ready queue, in order or as completed)──◀─────────────────────┘

* **Feed.** Items are taken from the source only against *credits*. The batcher grants
  credits when it opens a batch, and it opens a batch only while it holds a slot of the
  in-flight window (``prefetch`` slots; a slot frees when the consumer *takes* a batch).
  So at most ``prefetch * batch_size`` items are ever taken from the source and not yet
  delivered: backpressure reaches the producer. A collection (``list``, ``range``, a
  numpy array: anything with ``__len__``) is iterated on the event loop; any other
  synchronous iterable (a generator, a file) is pulled by a helper thread, so a
  blocking ``next()`` never stalls the event loop or a batch's deadline; an async
  iterable or an ``asyncio.Queue`` is pulled by a task on the event loop.
* **Batcher.** A batch is handed to the pool when it holds ``batch_size`` items, when
  ``max_latency`` seconds have passed since its first item was taken into it, or when
  the source ends. Time spent waiting for a free slot does not count: while the window
  is full no batch is open, so a slow consumer does not shrink batches.
* **Unit of work.** One micro-batch is one pool task (:mod:`aioloader._stream_worker`):
  the items travel with it, the worker applies ``fn`` and ``collate_fn``, and only the
  collated batch comes back. Crash recovery, retries, ``NEED_PAYLOAD`` and timeouts are
  the DataLoader's (:class:`~aioloader._scheduler.Dispatcher`).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures as cf
import contextlib
import threading
import time
import types
import uuid
import weakref
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Collection, Iterable, Iterator
from dataclasses import dataclass
from multiprocessing.context import BaseContext
from typing import Any, ClassVar, Final, Literal

from ._collate import default_collate
from ._dispatch import Dispatcher, cancelling
from ._lifecycle import (
    ClosedFlag,
    LifecycleMixin,
    State,
    check_int,
    close_run_from_outside,
    pickle_for_workers,
)
from ._pool import WorkerPool
from ._portal import Portal
from ._stats import LoaderStats, Recorder, _Epoch
from ._stream_worker import StreamContext, StreamResult, StreamTask, run_stream_batch
from ._worker import _add_note
from .errors import LoaderClosedError

__all__ = ["END", "StreamLoader"]


class _EndOfStream:
    """Type of :data:`END`."""

    _instance: ClassVar[_EndOfStream | None] = None

    def __new__(cls) -> _EndOfStream:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "aioloader.stream.END"

    def __reduce__(self) -> str:
        return "END"


END: Final = _EndOfStream()
"""Put this into an ``asyncio.Queue`` source to end the stream (also ``StreamLoader.END``)."""


class _Marker:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<{self.name}>"


_EXHAUSTED: Final = _Marker("source exhausted")
_TIMEOUT: Final = _Marker("deadline passed")
_CLOSED: Final = _Marker("run closed")

_QueueShutDown: tuple[type[BaseException], ...] = tuple(
    c for c in (getattr(asyncio, "QueueShutDown", None),) if isinstance(c, type)
)

# How long closing a stream waits for its source thread to notice (it may be stuck in
# the source's ``next()``, which nothing can interrupt); the thread is a daemon.
_SOURCE_THREAD_GRACE = 2.0


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


# --------------------------------------------------------------------------- feeds
class _Feed:
    """Items from a source, taken only against credits. Lives on one event loop."""

    def open_batch(self, size: int) -> None:
        """A batch with room for ``size`` items opened: let the source run that far ahead."""

    async def get(self, deadline: float | None) -> Any:
        """The next item, :data:`_EXHAUSTED`, or :data:`_TIMEOUT` once ``loop.time()``
        passes ``deadline``. Raises what the source raised (once)."""
        raise NotImplementedError

    async def aclose(self) -> None:
        """Stop pulling and close the source's iterator where we own it. Idempotent."""


class _InlineFeed(_Feed):
    """A collection's iterator, advanced on the event loop: it never blocks."""

    def __init__(self, it: Iterator[Any]) -> None:
        self.it = it
        self.done = False

    async def get(self, deadline: float | None) -> Any:
        if self.done:
            return _EXHAUSTED
        try:
            return next(self.it)
        except StopIteration:
            self.done = True
            return _EXHAUSTED
        except BaseException:
            self.done = True
            raise

    async def aclose(self) -> None:
        self.done = True
        if isinstance(self.it, types.GeneratorType):
            with contextlib.suppress(Exception):
                self.it.close()


class _BufferedFeed(_Feed):
    """Base of feeds whose producer runs concurrently (a task or a thread).

    ``reserved`` counts items granted to the producer and not yet arrived; the buffer
    holds arrived items the batcher has not taken. Both count against the batch being
    assembled, so ``open_batch`` only tops the grant up to the batch size.
    """

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.buffer: collections.deque[Any] = collections.deque()
        self.reserved = 0
        self.done = False
        self.error: BaseException | None = None
        self.closed = False
        self._waiter: asyncio.Future[None] | None = None
        self._started = False

    def open_batch(self, size: int) -> None:
        want = size - len(self.buffer) - self.reserved
        if want > 0 and not self.done:
            self.reserved += want
            if not self._started:
                self._started = True
                self._start()
            self._grant(want)

    def _start(self) -> None:
        raise NotImplementedError

    def _grant(self, n: int) -> None:
        raise NotImplementedError

    # Called on the loop by the producer.
    def _arrive(self, item: Any) -> None:
        self.reserved -= 1
        self.buffer.append(item)
        if self._waiter is not None:
            _wake(self._waiter)

    def _finish(self, error: BaseException | None) -> None:
        if self.done:
            return
        self.done = True
        self.error = error
        if self._waiter is not None:
            _wake(self._waiter)

    async def get(self, deadline: float | None) -> Any:
        loop = self.loop
        while True:
            if self.buffer:
                return self.buffer.popleft()
            if self.done:
                err, self.error = self.error, None
                if err is not None:
                    raise err
                return _EXHAUSTED
            if deadline is not None and loop.time() >= deadline:
                return _TIMEOUT
            fut: asyncio.Future[None] = loop.create_future()
            self._waiter = fut
            handle = loop.call_at(deadline, _wake, fut) if deadline is not None else None
            try:
                await fut
            finally:
                self._waiter = None
                if handle is not None:
                    handle.cancel()


class _TaskFeed(_BufferedFeed):
    """An async iterator or an ``asyncio.Queue``, pulled by a task on the loop."""

    def __init__(
        self, pull: Callable[[], Awaitable[Any]], closer: Callable[[], Awaitable[Any]] | None
    ) -> None:
        super().__init__()
        self._pull = pull
        self._closer = closer
        self._credits = 0
        self._credit_waiter: asyncio.Future[None] | None = None
        self._task: asyncio.Task[None] | None = None

    def _start(self) -> None:
        self._task = self.loop.create_task(self._run(), name="aioloader-stream-source")

    def _grant(self, n: int) -> None:
        self._credits += n
        if self._credit_waiter is not None:
            _wake(self._credit_waiter)

    async def _run(self) -> None:
        try:
            while True:
                while self._credits == 0:
                    self._credit_waiter = self.loop.create_future()
                    try:
                        await self._credit_waiter
                    finally:
                        self._credit_waiter = None
                self._credits -= 1
                item = await self._pull()
                if item is _EXHAUSTED:
                    self._finish(None)
                    return
                self._arrive(item)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._finish(exc)
        except BaseException as exc:  # KeyboardInterrupt, SystemExit: report, then let them fly
            self._finish(exc)
            raise

    async def aclose(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.done = True
        task = self._task
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._closer is not None:  # started or not: the stream owns the iterator it took
            with contextlib.suppress(Exception):
                await self._closer()


class _Failure:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class _ThreadFeed(_BufferedFeed):
    """A synchronous iterator, pulled by a daemon thread of its own.

    The thread takes a credit, calls ``next()``, and posts the item to the loop; posts
    are coalesced so a fast source costs one loop wake-up per burst, not per item. The
    thread closes a generator itself (a generator may only be closed by the thread that
    is not running it, and this one is the only thread that ever runs it).
    """

    def __init__(self, it: Iterator[Any]) -> None:
        super().__init__()
        self.it = it
        self._cond = threading.Condition()
        self._credits = 0
        self._stop = False
        self._outbox: collections.deque[Any] = collections.deque()
        self._outbox_lock = threading.Lock()
        self._notified = False
        self._exited: asyncio.Future[None] = self.loop.create_future()
        self._thread: threading.Thread | None = None

    def _start(self) -> None:
        self._thread = threading.Thread(target=self._main, name="aioloader-stream-source", daemon=True)
        self._thread.start()

    def _grant(self, n: int) -> None:
        with self._cond:
            self._credits += n
            self._cond.notify()

    # ---- thread side
    def _main(self) -> None:
        try:
            while True:
                with self._cond:
                    while self._credits == 0 and not self._stop:
                        self._cond.wait()
                    if self._stop:
                        return
                    self._credits -= 1
                try:
                    item = next(self.it)
                except StopIteration:
                    self._post(_EXHAUSTED)
                    return
                except BaseException as exc:
                    self._post(_Failure(exc))
                    return
                self._post(item)
        finally:
            if isinstance(self.it, types.GeneratorType):
                with contextlib.suppress(Exception):
                    self.it.close()
            self._post(_CLOSED)

    def _post(self, item: Any) -> None:
        with self._outbox_lock:
            self._outbox.append(item)
            if self._notified:
                return
            self._notified = True
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody is listening
            self.loop.call_soon_threadsafe(self._drain)

    # ---- loop side
    def _drain(self) -> None:
        with self._outbox_lock:
            items = list(self._outbox)
            self._outbox.clear()
            self._notified = False
        for item in items:
            if item is _EXHAUSTED:
                self._finish(None)
            elif item is _CLOSED:
                _wake(self._exited)
            elif isinstance(item, _Failure):
                self._finish(item.exc)
            elif not self.closed:
                self._arrive(item)

    async def aclose(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.done = True
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread is None:
            if isinstance(self.it, types.GeneratorType):
                with contextlib.suppress(Exception):
                    self.it.close()
            return
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._exited), _SOURCE_THREAD_GRACE)


def _queue_feed(queue: asyncio.Queue[Any]) -> _TaskFeed:
    async def pull() -> Any:
        try:
            item = await queue.get()
        except _QueueShutDown:
            return _EXHAUSTED
        queue.task_done()  # "taken by the stream", so a producer's queue.join() returns
        return _EXHAUSTED if item is END else item

    return _TaskFeed(pull, None)


def _async_feed(source: AsyncIterable[Any]) -> _TaskFeed:
    it = source.__aiter__()

    async def pull() -> Any:
        try:
            return await it.__anext__()
        except StopAsyncIteration:
            return _EXHAUSTED

    aclose = getattr(it, "aclose", None)
    return _TaskFeed(pull, aclose if callable(aclose) else None)


def _make_feed(source: Any) -> _Feed:
    if isinstance(source, asyncio.Queue):
        return _queue_feed(source)
    if isinstance(source, AsyncIterable):
        return _async_feed(source)
    if isinstance(source, Collection):
        return _InlineFeed(iter(source))
    return _ThreadFeed(iter(source))


# ---------------------------------------------------------------------------- run
@dataclass
class _StreamConfig:
    token: str
    pool: WorkerPool
    payload: bytes | None
    inline_ctx: StreamContext | None  # thread mode: the context rides along, unpickled
    batch_size: int
    max_latency: float | None
    prefetch: int
    ordered: bool
    timeout: float | None
    max_retries: int
    recorder: Recorder
    is_closed: Callable[[], bool]


class _Terminal:
    """The last entry of a run's ready queue: the source ended, or raised ``error``."""

    def __init__(self, error: BaseException | None) -> None:
        self.error = error


class _StreamRun:
    """One iteration over the source, on the event loop that created it."""

    def __init__(self, cfg: _StreamConfig, feed: _Feed, iteration: int) -> None:
        self.cfg = cfg
        self.feed = feed
        self.iteration = iteration
        self.loop = asyncio.get_running_loop()
        self.sem = asyncio.Semaphore(cfg.prefetch)
        self.ready: asyncio.Queue[Any] = asyncio.Queue()
        self.tasks: set[asyncio.Task[StreamResult]] = set()
        self.dispatcher = Dispatcher(cfg.pool, cfg.recorder, cfg.timeout, cfg.max_retries, cfg.is_closed)
        self.pulled = 0  # items taken from the source so far
        self.submitted = 0  # micro-batches handed to the pool so far
        self.closed = False
        self.finished = False
        self._pump: asyncio.Task[None] | None = None
        self._epoch: _Epoch | None = None
        self._close_done: asyncio.Future[None] | None = None

    def start(self) -> None:
        if self._pump is None:
            self._epoch = self.cfg.recorder.epoch_started(self.iteration)
            self._pump = self.loop.create_task(self._run_pump(), name="aioloader-stream-batcher")

    # ------------------------------------------------------------------ batcher
    async def _run_pump(self) -> None:
        error: BaseException | None = None
        try:
            await self._fill()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            error = exc
        if not self.cfg.ordered:  # the terminal entry must come after every batch
            pending = [t for t in self.tasks if not t.done()]
            if pending:
                await asyncio.wait(pending)
        self.ready.put_nowait(_Terminal(error))

    def _source_error(self, exc: BaseException) -> BaseException:
        _add_note(exc, f"aioloader: raised by the stream's source while taking item {self.pulled}")
        return exc

    async def _fill(self) -> None:
        cfg = self.cfg
        feed = self.feed
        loop = self.loop
        size = cfg.batch_size
        latency = cfg.max_latency
        while True:
            await self.sem.acquire()
            feed.open_batch(size)
            try:
                first = await feed.get(None)
            except BaseException as exc:
                self.sem.release()
                if isinstance(exc, asyncio.CancelledError):
                    raise
                raise self._source_error(exc)  # noqa: B904 (re-raises exc itself)
            if first is _EXHAUSTED:
                self.sem.release()
                return
            start = self.pulled
            items = [first]
            self.pulled += 1
            deadline = None if latency is None else loop.time() + latency
            error: BaseException | None = None
            exhausted = False
            while len(items) < size:
                try:
                    item = await feed.get(deadline)
                except asyncio.CancelledError:
                    raise
                except BaseException as exc:
                    error = self._source_error(exc)
                    break
                if item is _TIMEOUT:
                    break
                if item is _EXHAUSTED:
                    exhausted = True
                    break
                items.append(item)
                self.pulled += 1
            self._submit(start, items)
            if error is not None:
                raise error
            if exhausted:
                return

    def _submit(self, first: int, items: list[Any]) -> None:
        seq = self.submitted
        self.submitted += 1
        t = self.loop.create_task(self._fetch(seq, first, items))
        self.tasks.add(t)
        self.cfg.recorder.submitted(time.monotonic_ns())
        if self.cfg.ordered:
            self.ready.put_nowait(t)
        else:
            t.add_done_callback(self.ready.put_nowait)

    async def _fetch(self, seq: int, first: int, items: list[Any]) -> StreamResult:
        cfg = self.cfg
        last = first + len(items) - 1

        def make_task(task_id: int, with_payload: bool) -> StreamTask:
            if cfg.inline_ctx is not None:
                payload: bytes | StreamContext | None = cfg.inline_ctx
            else:
                payload = cfg.payload if with_payload else None
            return StreamTask(cfg.token, task_id, seq, first, items, payload)

        res: StreamResult = await self.dispatcher.run(
            run_stream_batch,
            make_task,
            range(first, last + 1),
            f"micro-batch {seq} of the stream (source items {first}..{last})",
        )
        return res

    # ----------------------------------------------------------------- consumer
    async def next_batch(self) -> Any:
        """The next batch, or ``StopAsyncIteration`` when the source has ended."""
        cfg = self.cfg
        while True:
            if self.closed:
                if cfg.is_closed():
                    raise LoaderClosedError("the StreamLoader was closed while it was being iterated")
                raise StopAsyncIteration
            t0 = time.monotonic_ns()
            try:
                entry = await self.ready.get()
            except asyncio.CancelledError:
                await self._abort()
                raise
            if entry is _CLOSED:
                continue  # the loop head reports how the run ended
            if isinstance(entry, _Terminal):
                self.finished = entry.error is None
                await self.aclose()
                if entry.error is not None:
                    raise entry.error
                raise StopAsyncIteration
            try:
                res: StreamResult = await entry
            except asyncio.CancelledError:
                self._take(entry)
                await self._abort()
                raise
            except Exception:
                self._take(entry)
                await self.aclose()
                raise
            now = time.monotonic_ns()
            if res.skipped:  # counted, not kept: an infinite stream must not grow a list
                cfg.recorder.skipped += len(res.skipped)
            if res.data is None:  # every item of the micro-batch was skipped
                self._take(entry)
                continue
            assert self._epoch is not None
            # Counted before the slot frees, so a pull the freed slot allows is never
            # seen before the delivery that allowed it.
            cfg.recorder.delivered(self._epoch, res.n_items, now - t0, now)
            self._take(entry)
            return res.data

    async def _abort(self) -> None:
        """The consumer saw ``CancelledError``: its own cancellation (re-raised by the
        caller), or the run being closed under it (reported as the end, or as
        :class:`LoaderClosedError` when the whole stream was closed)."""
        await self.aclose()
        if not cancelling():
            if self.cfg.is_closed():
                raise LoaderClosedError("the StreamLoader was closed while it was being iterated") from None
            raise StopAsyncIteration from None

    def _take(self, t: asyncio.Task[StreamResult]) -> None:
        if t in self.tasks:
            self.tasks.discard(t)
            self.sem.release()
            self.cfg.recorder.released()

    async def aclose(self) -> None:
        """Cancel pending work, close the source, wait until all of it stopped.

        Idempotent; a second caller waits for the first one's cleanup to finish."""
        if self._close_done is not None:
            await asyncio.shield(self._close_done)
            return
        self._close_done = self.loop.create_future()
        try:
            await self._shutdown()
        finally:
            self._close_done.set_result(None)

    async def _shutdown(self) -> None:
        self.closed = True
        self.ready.put_nowait(_CLOSED)  # wakes a consumer waiting for the next batch
        pending: list[asyncio.Task[Any]] = [t for t in self.tasks if not t.done()]
        if self._pump is not None and not self._pump.done():
            pending.append(self._pump)
        pending.extend(self.dispatcher.stop())
        for t in pending:
            t.cancel()
        try:
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
        finally:
            for t in self.tasks:  # results nobody will take: retrieve them quietly
                if t.done() and not t.cancelled():
                    t.exception()
                self.cfg.recorder.released()
            self.tasks.clear()
            await self.feed.aclose()


# ------------------------------------------------------------------------ facade
def _check_seconds(name: str, value: Any, *, allow_zero: bool) -> float | None:
    if value is None:
        return None
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not (value >= 0 if allow_zero else value > 0) or value != value or value == float("inf"):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be a finite number of seconds {bound}, or None; got {value!r}")
    return float(value)


class StreamLoader(LifecycleMixin):
    """Batches from an (async) iterable or an ``asyncio.Queue``, built by a worker pool.

    ``async for batch in stream`` runs on the caller's event loop and never blocks it;
    ``for batch in stream`` runs the same machinery on a private loop in a background
    thread.

    Args:
        source: a synchronous iterable, an async iterable (async generator included), or
            an ``asyncio.Queue`` fed by other tasks. A queue ends when :data:`END`
            (``StreamLoader.END``) is taken from it, or when it is shut down
            (``queue.shutdown()``, Python 3.13+); the stream calls ``task_done()`` for
            every item it takes. A queue can only be consumed with ``async for`` on the
            loop that feeds it. Sources may be infinite.
        fn: applied in the pool to each item (``fn(item)``), or to the list of a
            micro-batch's items with ``batched_fn=True``. ``None``: items are collated
            as they are. With workers it must pickle (a module-level function).
        batch_size: most items in a batch.
        max_latency: emit a partial batch once this many seconds have passed since it
            received its first item. ``None``: wait for full batches. Either way the last
            partial batch is emitted when the source ends. ``0`` takes what is already
            waiting (in a queue, a collection, or pulled ahead) and never waits.
        batched_fn: call ``fn(items)`` once per micro-batch; it returns what
            ``collate_fn`` receives (for the default, a list of per-item results).
        collate_fn: turns the list of ``fn`` results into a batch, in the worker;
            default :func:`~aioloader.default_collate`.
        num_workers: worker processes; ``0`` runs ``fn`` in one background thread.
        prefetch: micro-batches open at once: being assembled, submitted, running, or
            done and waiting for the consumer (default ``2 * num_workers``, at least 2).
            At most ``prefetch * batch_size`` items are taken from the source and not
            yet delivered.
        ordered: deliver batches in source order (``True``) or as they complete.
        on_error: ``"raise"`` the first exception from ``fn`` (the stream stops), or
            ``"skip"`` failing items (with ``batched_fn``, the whole micro-batch);
            counted in ``stats().skipped``.
        max_retries: resubmissions of a micro-batch whose worker died while running it.
        timeout: seconds a micro-batch may run in a worker; on expiry
            :class:`~aioloader.LoaderTimeout` is raised and the worker is killed.
        mp_context: start method name or context (default ``forkserver``, else ``spawn``).
        pool: a :class:`~aioloader.WorkerPool` shared with other loaders (never closed
            by the stream).
        executor: any ``concurrent.futures.Executor`` (never shut down by the stream).

    Guarantees and errors: exceptions from ``fn``/``collate_fn`` keep their type and
    gain a note with the item's source position (:class:`~aioloader.RemoteError` if
    they do not pickle); an exception raised by the source itself is raised after the
    batches of the items taken before it. :class:`~aioloader.WorkerCrashedError` after
    ``max_retries`` crashes; :class:`~aioloader.LoaderClosedError` when iterating a
    closed stream; :class:`~aioloader.DatasetPickleError` at construction when ``fn``
    or ``collate_fn`` cannot reach the workers.

    One iteration at a time: starting a new iteration closes a previous one that is
    still open. Each iteration calls ``iter()``/``aiter()`` on the source again, so a
    list is read from the start while a generator continues (or is already closed).
    Leaving an iteration early (``break``, an exception, cancellation) cancels pending
    work and closes the source's iterator when it is a generator or has ``aclose()``;
    after ``async for ... break`` that happens when the event loop finalizes the
    abandoned iterator (use ``async with stream`` or :meth:`aclose` to do it at a known
    point).
    """

    _portal_name = "aioloader-stream-portal"

    END: ClassVar[_EndOfStream] = END

    def __init__(
        self,
        source: Iterable[Any] | AsyncIterable[Any] | asyncio.Queue[Any],
        fn: Callable[[Any], Any] | None = None,
        *,
        batch_size: int = 32,
        max_latency: float | None = None,
        batched_fn: bool = False,
        collate_fn: Callable[[Any], Any] | None = None,
        num_workers: int = 0,
        prefetch: int | None = None,
        ordered: bool = True,
        on_error: Literal["raise", "skip"] = "raise",
        max_retries: int = 2,
        timeout: float | None = None,
        mp_context: str | BaseContext | None = None,
        pool: WorkerPool | None = None,
        executor: cf.Executor | None = None,
    ) -> None:
        if not isinstance(source, (asyncio.Queue, AsyncIterable, Iterable)):
            raise TypeError(
                "source must be an iterable, an async iterable or an asyncio.Queue, "
                f"got {type(source).__name__}"
            )
        if fn is not None and not callable(fn):
            raise TypeError(f"fn must be callable or None, got {fn!r}")
        if collate_fn is not None and not callable(collate_fn):
            raise TypeError(f"collate_fn must be callable or None, got {collate_fn!r}")
        if not isinstance(batched_fn, bool):
            raise TypeError(f"batched_fn must be a bool, got {batched_fn!r}")
        if batched_fn and fn is None:
            raise ValueError("batched_fn=True needs an fn")
        batch_size = check_int("batch_size", batch_size, 1)
        max_latency = _check_seconds("max_latency", max_latency, allow_zero=True)
        timeout = _check_seconds("timeout", timeout, allow_zero=False)
        num_workers = check_int("num_workers", num_workers, 0)
        if prefetch is not None:
            prefetch = check_int("prefetch", prefetch, 1)
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be one of 'raise', 'skip'; got {on_error!r}")
        max_retries = check_int("max_retries", max_retries, 0)
        if pool is not None and not isinstance(pool, WorkerPool):
            raise TypeError(f"pool must be an aioloader.WorkerPool, got {pool!r}")
        if pool is not None and executor is not None:
            raise ValueError("pass at most one of pool= and executor=")
        if (pool is not None or executor is not None) and (num_workers or mp_context is not None):
            raise ValueError(
                "num_workers and mp_context configure the stream's own pool; "
                "they conflict with pool= or executor="
            )

        self.source = source
        self.fn = fn
        self.batch_size = batch_size
        self.max_latency = max_latency
        self.batched_fn = batched_fn
        self.collate_fn: Callable[[Any], Any] = collate_fn if collate_fn is not None else default_collate
        self.ordered = bool(ordered)
        self.on_error: Literal["raise", "skip"] = on_error
        self.max_retries = max_retries
        self.timeout = timeout
        self.num_workers = num_workers

        if pool is not None:
            self._pool, owns_pool = pool, False
        elif executor is not None:
            self._pool, owns_pool = WorkerPool(executor=executor), False
        else:
            self._pool, owns_pool = WorkerPool(num_workers, mp_context=mp_context), True
        self.prefetch = prefetch if prefetch is not None else max(2, 2 * self._pool.concurrency)

        self._token = uuid.uuid4().hex
        ctx = StreamContext(
            dataset=None,
            collate_fn=self.collate_fn,
            on_error=on_error,
            seed_samples=False,
            fn=fn,
            batched_fn=batched_fn,
        )
        self._inline_ctx: StreamContext | None = None
        self._payload: bytes | None = None
        if self._pool.kind == "thread":
            self._inline_ctx = ctx
        else:
            try:
                self._payload = self._pickle(ctx)
            except BaseException:
                if owns_pool:
                    self._pool.close()
                raise
            self._pool.register(self._token, self._payload)

        self._state = State.OPEN
        self._flag = ClosedFlag()  # runs hold this, never the stream itself
        self._lock = threading.RLock()
        self._active: _StreamRun | None = None
        self._iterations = 0
        self._recorder = Recorder()
        self._portal_box: list[Portal | None] = [None]
        self._finalizer = weakref.finalize(
            self,
            StreamLoader._cleanup,
            self._pool if owns_pool else None,
            self._pool,
            self._token,
            self._portal_box,
        )

    def _pickle(self, ctx: StreamContext) -> bytes:
        return pickle_for_workers(ctx, (("fn", self.fn), ("collate_fn", self.collate_fn)), "StreamLoader")

    # ------------------------------------------------------------------ lifecycle
    @staticmethod
    def _cleanup(
        owned_pool: WorkerPool | None,
        pool: WorkerPool,
        token: str,
        portal_box: list[Portal | None],
    ) -> None:
        portal = portal_box[0]
        portal_box[0] = None
        if portal is not None:
            portal.close()
        if owned_pool is not None:
            owned_pool.close()
        else:
            pool.unregister(token)

    def close(self) -> None:
        """Stop iteration, close the source's iterator, shut down the stream's own pool
        and thread. Idempotent. A consumer still iterating (in another thread or task)
        gets :class:`~aioloader.LoaderClosedError`. A pool or executor passed in stays."""
        with self._lock:
            if self._state is State.CLOSED:
                return
            self._state = State.CLOSED
            self._flag.closed = True
            run, self._active = self._active, None
        if run is not None:
            close_run_from_outside(run)
        self._finalizer()

    async def aclose(self) -> None:
        """Async twin of :meth:`close`: the iteration on this loop is closed here, the
        pool shutdown runs off the event loop."""
        loop = asyncio.get_running_loop()
        # Mark closed first, so a consumer in another task sees LoaderClosedError.
        with self._lock:
            if self._state is State.CLOSED:
                return
            self._state = State.CLOSED
            self._flag.closed = True
            run, self._active = self._active, None
        if run is not None and run.loop is loop:
            await run.aclose()
            run = None

        def teardown() -> None:
            if run is not None:
                close_run_from_outside(run)
            self._finalizer()

        await loop.run_in_executor(None, teardown)

    # ------------------------------------------------------------------ iteration
    def _config(self) -> _StreamConfig:
        return _StreamConfig(
            token=self._token,
            pool=self._pool,
            payload=self._payload,
            inline_ctx=self._inline_ctx,
            batch_size=self.batch_size,
            max_latency=self.max_latency,
            prefetch=self.prefetch,
            ordered=self.ordered,
            timeout=self.timeout,
            max_retries=self.max_retries,
            recorder=self._recorder,
            is_closed=self._flag.is_closed,
        )

    async def _start(self) -> _StreamRun:
        with self._lock:
            self._check_open()
            prev, self._active = self._active, None
        if prev is not None and not prev.closed:
            await _close_run_async(prev)
        with self._lock:
            self._check_open()
            run = _StreamRun(self._config(), _make_feed(self.source), self._iterations)
            self._iterations += 1
            self._active = run
        run.start()
        return run

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._aiterate()

    async def _aiterate(self) -> AsyncIterator[Any]:
        run = await self._start()
        try:
            while True:
                try:
                    batch = await run.next_batch()
                except StopAsyncIteration:
                    return
                yield batch
        finally:
            await run.aclose()

    def __iter__(self) -> Iterator[Any]:
        if isinstance(self.source, asyncio.Queue):
            raise TypeError(
                "an asyncio.Queue source belongs to the event loop that feeds it: iterate "
                "with `async for` on that loop"
            )
        portal = self._portal()
        if portal.in_portal():
            raise RuntimeError("cannot iterate a StreamLoader synchronously from its own event-loop thread")
        run = portal.call(self._start())
        return self._iterate(portal, run)

    def _iterate(self, portal: Portal, run: _StreamRun) -> Iterator[Any]:
        try:
            while True:
                coro = run.next_batch()
                try:
                    batch = portal.call(coro)
                except StopAsyncIteration:
                    return
                except RuntimeError:
                    coro.close()  # never started if the portal's loop was already gone
                    if portal.loop.is_closed():
                        raise LoaderClosedError(
                            "the StreamLoader was closed while it was being iterated"
                        ) from None
                    raise
                yield batch
        finally:
            if not run.closed:
                try:
                    if not portal.loop.is_closed():
                        portal.call(run.aclose(), timeout=30.0)
                except (RuntimeError, cf.TimeoutError):
                    pass

    # --------------------------------------------------------------------- misc
    def stats(self) -> LoaderStats:
        """A frozen snapshot of the stream's statistics (one "epoch" per iteration)."""
        return self._recorder.snapshot(self._pool.restarts, self._pool.concurrency)

    @property
    def pool(self) -> WorkerPool:
        return self._pool

    def worker_pids(self) -> list[int]:
        """Pids of the worker processes of the pool's current incarnation."""
        return self._pool.worker_pids()

    def __repr__(self) -> str:
        return (
            f"<aioloader.StreamLoader batch_size={self.batch_size} max_latency={self.max_latency} "
            f"num_workers={self.num_workers} prefetch={self.prefetch} {self._state.value}>"
        )


async def _close_run_async(run: _StreamRun) -> None:
    """Close a run from a coroutine, whichever loop it lives on."""
    loop = asyncio.get_running_loop()
    if run.loop is loop:
        await run.aclose()
        return
    if run.loop.is_closed() or not run.loop.is_running():
        run.closed = True
        return
    try:
        fut = asyncio.run_coroutine_threadsafe(run.aclose(), run.loop)
    except RuntimeError:
        return
    with contextlib.suppress(Exception):
        await asyncio.wrap_future(fut)

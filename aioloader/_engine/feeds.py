"""Stream feeds: items from a source, taken only against credits, on one event loop.

The batcher grants credits when it opens a micro-batch, and it opens one only while it
holds a slot of the run's window, so at most ``prefetch * batch_size`` items are ever
taken from the source and not yet delivered: backpressure reaches the producer.

* A collection (``list``, ``range``, a numpy array: anything with ``__len__``) is
  iterated on the event loop: its ``next()`` never blocks.
* Any other synchronous iterable (a generator, a file) is pulled by a helper thread, so
  a blocking ``next()`` never stalls the event loop or a batch's deadline.
* An async iterable or an ``asyncio.Queue`` is pulled by a task on the event loop.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
import types
from collections.abc import AsyncIterable, Awaitable, Callable, Collection, Iterator
from typing import Any, ClassVar, Final

__all__ = ["END", "EXHAUSTED", "TIMEOUT", "Feed", "make_feed"]


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


EXHAUSTED: Final = _Marker("source exhausted")
TIMEOUT: Final = _Marker("deadline passed")
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
class Feed:
    """Items from a source, taken only against credits. Lives on one event loop."""

    def open_batch(self, size: int) -> None:
        """A batch with room for ``size`` items opened: let the source run that far ahead."""

    async def get(self, deadline: float | None) -> Any:
        """The next item, :data:`EXHAUSTED`, or :data:`TIMEOUT` once ``loop.time()``
        passes ``deadline``. Raises what the source raised (once)."""
        raise NotImplementedError

    async def aclose(self) -> None:
        """Stop pulling and close the source's iterator where we own it. Idempotent."""


class _InlineFeed(Feed):
    """A collection's iterator, advanced on the event loop: it never blocks."""

    def __init__(self, it: Iterator[Any]) -> None:
        self.it = it
        self.done = False

    async def get(self, deadline: float | None) -> Any:
        if self.done:
            return EXHAUSTED
        try:
            return next(self.it)
        except StopIteration:
            self.done = True
            return EXHAUSTED
        except BaseException:
            self.done = True
            raise

    async def aclose(self) -> None:
        self.done = True
        if isinstance(self.it, types.GeneratorType):
            with contextlib.suppress(Exception):
                self.it.close()


class _BufferedFeed(Feed):
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
                return EXHAUSTED
            if deadline is not None and loop.time() >= deadline:
                return TIMEOUT
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
                if item is EXHAUSTED:
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
                    self._post(EXHAUSTED)
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
            if item is EXHAUSTED:
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
            return EXHAUSTED
        queue.task_done()  # "taken by the stream", so a producer's queue.join() returns
        return EXHAUSTED if item is END else item

    return _TaskFeed(pull, None)


def _async_feed(source: AsyncIterable[Any]) -> _TaskFeed:
    it = source.__aiter__()

    async def pull() -> Any:
        try:
            return await it.__anext__()
        except StopAsyncIteration:
            return EXHAUSTED

    aclose = getattr(it, "aclose", None)
    return _TaskFeed(pull, aclose if callable(aclose) else None)


def make_feed(source: Any) -> Feed:
    if isinstance(source, asyncio.Queue):
        return _queue_feed(source)
    if isinstance(source, AsyncIterable):
        return _async_feed(source)
    if isinstance(source, Collection):
        return _InlineFeed(iter(source))
    return _ThreadFeed(iter(source))

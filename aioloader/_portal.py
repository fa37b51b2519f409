"""Sync iteration over the async core: a private event loop in a background thread.

``for batch in loader`` reads a :class:`Feed`: a task on this loop takes finished
batches as they come and hands them, in order, to the iterating thread through a deque,
so that the thread finds the next one waiting instead of asking the loop for it (a round
trip of two thread wake-ups per batch). The window still bounds what is taken ahead: a
batch handed over keeps its window slot until the thread accepts it. One-off calls
(:meth:`Portal.call`) cost one ``call_soon_threadsafe`` there and one lock released back
(no concurrent future). The loop is uvloop's when uvloop is installed. Because the loop
has a thread of its own, sync iteration works whether or not the calling thread already
runs an event loop (Jupyter), and Ctrl-C in the calling thread interrupts the wait, not
the loop.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures as cf
import contextlib
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Generic, TypeVar

from .errors import LoaderClosedError

__all__ = ["END", "Feed", "Portal", "new_event_loop"]

T = TypeVar("T")


try:  # imported with aioloader: not inside the first ``for``'s time to its first batch
    import uvloop

    _loop_factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
except ImportError:  # pragma: no cover - uvloop is a dependency on POSIX
    _loop_factory = asyncio.new_event_loop


def new_event_loop() -> asyncio.AbstractEventLoop:
    return _loop_factory()


class Portal:
    """An event loop running in its own daemon thread until :meth:`close`."""

    def __init__(self, name: str = "aioloader-portal") -> None:
        self.loop = new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self._ready.wait()
        self._closed = False

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._ready.set)
        try:
            self.loop.run_forever()
        finally:
            try:
                self._drain()
                self.loop.run_until_complete(self.loop.shutdown_asyncgens())
                # At interpreter exit no thread can start (3.12+ raises "can't create new
                # thread at interpreter shutdown"), and the default executor's threads are
                # joined by concurrent.futures' own exit hook anyway.
                if not sys.is_finalizing():
                    with contextlib.suppress(RuntimeError):
                        self.loop.run_until_complete(self.loop.shutdown_default_executor())
            finally:
                self.loop.close()

    def _drain(self) -> None:
        tasks = [t for t in asyncio.all_tasks(self.loop) if not t.done()]
        for t in tasks:
            t.cancel()
        if tasks:
            self.loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    def in_portal(self) -> bool:
        return threading.current_thread() is self._thread

    def closed_under_caller(self) -> bool:
        """The portal was closed and its loop has stopped (a caller waiting on it would
        wait forever)."""
        return self._closed and not self._thread.is_alive()

    def soon(self, callback: Callable[..., object], *args: Any) -> None:
        """``call_soon_threadsafe`` on the portal's loop, from any thread.

        A portal closed by another thread may have closed its loop already. The caller
        then gets :class:`~aioloader.LoaderClosedError`, not the loop's RuntimeError.
        """
        try:
            self.loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:
            if self.loop.is_closed():
                raise _closed_error() from None
            raise

    def submit(self, coro: Coroutine[Any, Any, T]) -> cf.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the portal's loop and wait for its result.

        If the wait is interrupted (Ctrl-C), the coroutine is cancelled before the
        exception propagates. A portal closed under the caller gives
        :class:`~aioloader.LoaderClosedError`; ``timeout`` expired, ``cf.TimeoutError``.
        """
        # One lock as the hand-off, not run_coroutine_threadsafe's concurrent future (a
        # Condition, a chained pair of futures and their callbacks): the sync face makes
        # this call once per batch.
        call = _Call(coro)
        try:
            self.soon(call.start, self)
        except BaseException:  # the loop is closed: the coroutine will never run
            coro.close()
            raise
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            # Wait in slices: a portal closed under us must not leave us waiting on a
            # callback its loop dropped. (Lock waits are interrupted by Ctrl-C.)
            while not call.done.acquire(timeout=_SLICE):
                if self.closed_under_caller():
                    raise _closed_error()
                if deadline is not None and time.monotonic() > deadline:
                    raise cf.TimeoutError(f"no result within {timeout} s")
        except BaseException:
            self._abandon(call)
            raise
        value: T = call.outcome(self._closed)
        return value

    def _abandon(self, call: _Call) -> None:
        if self.closed_under_caller():  # its loop dropped it unrun
            call.coro.close()
            return
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(call.cancel)

    def close(self, timeout: float = 30.0) -> None:
        """Stop the loop (cancelling what still runs on it) and join the thread."""
        if self._closed:
            return
        self._closed = True
        if self.in_portal():  # closing from a callback on the loop itself
            self.loop.call_soon(self.loop.stop)
            return
        try:
            self.loop.call_soon_threadsafe(self.loop.stop)
        except RuntimeError:  # loop already closed
            pass
        self._thread.join(timeout)


_SLICE = 0.25  # waits are sliced so that a portal closed under the waiter is noticed


def _closed_error() -> LoaderClosedError:
    return LoaderClosedError("the loader was closed while it was being iterated")


class _End:
    def __repr__(self) -> str:
        return "<end of iteration>"


END: Any = _End()


class Feed(Generic[T]):
    """What ``take()`` gives, again and again on the portal's loop, handed in order to one
    consumer thread (:meth:`get`), until it raises ``StopAsyncIteration`` (then
    :data:`END`) or anything else (raised by :meth:`get` after the items before it).

    Nothing bounds the items taken ahead but ``take`` itself: the engine's passes hand
    over units that hold their window slots until the consumer accepts them.
    """

    def __init__(self, portal: Portal, take: Callable[[], Awaitable[T]]) -> None:
        self._portal = portal
        self._take = take
        self._items: collections.deque[tuple[Any, BaseException | None]] = collections.deque()
        self._lock = threading.Lock()  # guards _waiting against the loop's appends
        self._wake = threading.Lock()  # released by the loop for a waiting consumer
        self._wake.acquire()
        self._waiting = False
        self._task: asyncio.Task[None] | None = None
        self._stopped = False
        portal.soon(self._start)

    def _start(self) -> None:  # on the loop
        if not self._stopped:
            self._task = self._portal.loop.create_task(self._run(), name="aioloader-feed")

    async def _run(self) -> None:
        while True:
            error: BaseException | None = None
            try:
                item: Any = await self._take()
            except StopAsyncIteration:
                item = END
            except asyncio.CancelledError:  # aclose(), or the portal closing under the consumer
                item, error = None, _closed_error()
            except BaseException as exc:  # SystemExit too: the consumer raises it
                item, error = None, exc
            self._items.append((item, error))
            with self._lock:
                if self._waiting:
                    self._waiting = False
                    self._wake.release()
            if item is END or error is not None:
                return

    def get(self) -> tuple[T, int]:
        """The next item and the nanoseconds spent waiting for it (consumer's thread)."""
        t0 = time.monotonic_ns()
        items = self._items
        while True:
            try:
                item, error = items.popleft()
                break
            except IndexError:
                pass
            with self._lock:
                if items:
                    continue
                self._waiting = True
            while not self._wake.acquire(timeout=_SLICE):
                if self._portal.closed_under_caller():
                    raise _closed_error()
        if error is not None:
            raise error
        return item, time.monotonic_ns() - t0

    async def aclose(self) -> None:
        """Stop taking (on the loop). What was taken and not read is left to the
        caller's cleanup (the engine's run frees it when it closes)."""
        self._stopped = True
        task = self._task
        if task is not None and not task.done():
            task.cancel()
            # Waits without raising how the task ended (a task cancelled before its first
            # step ends cancelled); a cancellation of aclose() itself still propagates.
            await asyncio.wait([task])


class _Call:
    """One :meth:`Portal.call`: the coroutine, its outcome, and ``done``, a lock held
    until the outcome is in."""

    __slots__ = ("cancelled", "coro", "done", "error", "result", "task")

    def __init__(self, coro: Coroutine[Any, Any, Any]) -> None:
        self.coro = coro
        self.done = threading.Lock()
        self.done.acquire()
        self.result: Any = None
        self.error: BaseException | None = None
        self.cancelled = False
        self.task: asyncio.Task[None] | None = None

    def start(self, portal: Portal) -> None:  # on the loop
        if self.cancelled or portal._closed:
            # The caller gave up before the loop got here, or the portal is closing: a
            # task made now could outlive the loop (it would be destroyed pending).
            self.coro.close()
            self.error = asyncio.CancelledError()
            self.done.release()
            return
        self.task = portal.loop.create_task(self._run())

    def cancel(self) -> None:  # on the loop
        self.cancelled = True
        if self.task is not None:
            self.task.cancel()

    async def _run(self) -> None:
        # Everything is caught: SystemExit or KeyboardInterrupt raised inside a task would
        # stop the portal's loop (asyncio lets them through run_forever) and every later
        # call would fail with "Event loop is closed"; the caller's thread raises them.
        try:
            self.result = await self.coro
        except BaseException as exc:
            self.error = exc
            self.cancelled = self.cancelled or isinstance(exc, asyncio.CancelledError)
        finally:
            self.task = None
            self.done.release()

    def outcome(self, closed: bool) -> Any:
        """The result, or raise the error (in the caller's thread)."""
        error, self.error = self.error, None
        if error is None:
            return self.result
        if isinstance(error, asyncio.CancelledError) and closed:
            raise LoaderClosedError("the loader was closed while it was being iterated")
        raise error

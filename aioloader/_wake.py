"""Waking an event loop from other threads, a burst of results at a time.

The executor's manager thread settles one result after another; waking the loop for each
(``call_soon_threadsafe``: a write to the loop's wake-up pipe, one more loop iteration, a
GIL hand-off) was one of the main process's largest costs per batch. A :class:`Waker`
keeps the futures settled while a wake-up is pending and settles them all on that one.
"""

from __future__ import annotations

import asyncio
import threading
import weakref

__all__ = ["Waker", "waker_for"]


class Waker:
    """Settles futures of one event loop from any thread: at most one wake-up of the
    loop is pending at a time, and every future woken meanwhile joins it."""

    __slots__ = ("__weakref__", "_lock", "_loop", "_pending", "_scheduled")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = weakref.ref(loop)  # the table of wakers holds loops weakly
        self._lock = threading.Lock()
        self._pending: list[asyncio.Future[None]] = []
        self._scheduled = False

    def wake(self, waiter: asyncio.Future[None]) -> None:
        with self._lock:
            self._pending.append(waiter)
            if self._scheduled:
                return
            self._scheduled = True
        loop = self._loop()
        try:
            if loop is None:
                raise RuntimeError("the loop is gone")
            loop.call_soon_threadsafe(self._settle)
        except RuntimeError:  # the loop is closed: nobody waits
            with self._lock:
                self._scheduled = False
                self._pending.clear()

    def _settle(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
            self._scheduled = False
        for waiter in pending:
            if not waiter.done():
                waiter.set_result(None)


_wakers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Waker] = weakref.WeakKeyDictionary()
_wakers_lock = threading.Lock()


def waker_for(loop: asyncio.AbstractEventLoop) -> Waker:
    """The one waker of ``loop``."""
    waker = _wakers.get(loop)
    if waker is None:
        with _wakers_lock:
            waker = _wakers.get(loop)
            if waker is None:
                waker = _wakers[loop] = Waker(loop)
    return waker

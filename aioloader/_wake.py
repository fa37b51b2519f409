"""Waking an event loop from other threads, a burst at a time.

The pool's I/O thread settles one job after another, and the ``for`` face's
consumer thread frees one window slot after another; waking the loop for each
(``call_soon_threadsafe``: a write to the loop's wake-up pipe, one more loop iteration, a
GIL hand-off) was one of the main process's largest costs per batch. A :class:`Waker`
keeps what is asked of the loop while a wake-up is pending and does it all on that one.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["Waker", "waker_for"]


class Waker:
    """Runs callbacks on one event loop from any thread: at most one wake-up of the loop
    is pending at a time, and every callback asked for meanwhile joins it (in order)."""

    __slots__ = ("__weakref__", "_lock", "_loop", "_pending", "_scheduled")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = weakref.ref(loop)  # the table of wakers holds loops weakly
        self._lock = threading.Lock()
        self._pending: list[tuple[Callable[..., None], tuple[Any, ...]]] = []
        self._scheduled = False

    def wake(self, waiter: asyncio.Future[None]) -> None:
        """Settle ``waiter`` (with ``None``, unless it is done already) on its loop."""
        self.call(_settle, waiter)

    def call(self, fn: Callable[..., None], *args: Any) -> None:
        """``fn(*args)`` soon, on the loop; dropped if the loop is closed."""
        # The wake-up is scheduled under the lock: a callback that joins a pending
        # wake-up must not be overtaken by what its thread schedules next (the ``for``
        # face releases its last batch, then asks the loop to finish the pass).
        with self._lock:
            self._pending.append((fn, args))
            if self._scheduled:
                return
            self._scheduled = True
            loop = self._loop()
            try:
                if loop is None:
                    raise RuntimeError("the loop is gone")
                loop.call_soon_threadsafe(self._settle)
            except RuntimeError:  # the loop is closed: nobody waits
                self._scheduled = False
                self._pending.clear()

    def _settle(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
            self._scheduled = False
        for fn, args in pending:
            try:
                fn(*args)
            except Exception as exc:  # one failing callback must not strand the others
                loop = self._loop()
                if loop is not None:
                    loop.call_exception_handler(
                        {"message": f"aioloader: a wake-up callback failed: {fn!r}", "exception": exc}
                    )


def _settle(waiter: asyncio.Future[None]) -> None:
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

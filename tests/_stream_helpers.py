"""Functions, sources and synchronisation helpers for the StreamLoader tests.

Module level, so that forkserver workers can import what they run. Nothing here
sleeps to synchronise: waits are on events, with a bound that only turns a hang into a
failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

WAIT = 20.0  # bound on every wait: a hang becomes a failure, never a pass


class Gate:
    """A one-shot event that any thread may set and any thread or event loop may await."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []

    def set(self) -> None:
        with self._lock:
            self._event.set()
            waiters, self._waiters = self._waiters, []
        for loop, fut in waiters:
            try:
                loop.call_soon_threadsafe(_resolve, fut)
            except RuntimeError:  # that loop is gone
                pass

    def is_set(self) -> bool:
        return self._event.is_set()

    def wait_sync(self, timeout: float = WAIT) -> None:
        if not self._event.wait(timeout):
            raise AssertionError(f"gate not set within {timeout} s")

    async def wait(self, timeout: float = WAIT) -> None:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        with self._lock:
            if self._event.is_set():
                return
            self._waiters.append((loop, fut))
        try:
            await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            raise AssertionError(f"gate not set within {timeout} s") from None


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


STOP = object()


def drive(mode: str, stream: Any, step: Callable[[int, Any], Any] | None = None) -> list[Any]:
    """Iterate ``stream`` with ``for`` or ``async for`` and return the batches.

    ``step(i, batch)`` runs after each batch, in the consumer's thread; it may return
    :data:`STOP` (break out of the loop), a :class:`Gate` to wait for before asking for
    the next batch (awaited without blocking the loop in ``async for`` mode), or
    ``(gate, STOP)``: wait, then break.
    """
    out: list[Any] = []
    if mode == "for":
        for batch in stream:
            out.append(batch)
            r = step(len(out) - 1, batch) if step is not None else None
            g, stop = _split(r)
            if g is not None:
                g.wait_sync()
            if stop:
                break
        return out

    async def main() -> None:
        async with contextlib.aclosing(stream.__aiter__()) as it:  # closes it on break, now
            async for batch in it:
                out.append(batch)
                r = step(len(out) - 1, batch) if step is not None else None
                g, stop = _split(r)
                if g is not None:
                    await g.wait()
                if stop:
                    break

    asyncio.run(main())
    return out


def _split(r: Any) -> tuple[Gate | None, bool]:
    if isinstance(r, tuple):
        return r[0], r[1] is STOP
    if isinstance(r, Gate):
        return r, False
    return None, r is STOP


def as_lists(batches: list[Any]) -> list[list[Any]]:
    return [b.tolist() if hasattr(b, "tolist") else list(b) for b in batches]


# --------------------------------------------------------------------- worker fns
def square(x: int) -> int:
    return x * x


def identity(x: Any) -> Any:
    return x


def tag_batch(items: list[int]) -> list[tuple[int, int]]:
    """A batched fn: each item with the micro-batch's size."""
    return [(x, len(items)) for x in items]


class FailOn:
    """Raises ``ValueError`` for the items in ``bad``."""

    def __init__(self, *bad: int) -> None:
        self.bad = set(bad)

    def __call__(self, x: int) -> int:
        if x in self.bad:
            raise ValueError(f"bad item {x}")
        return x


class _Unpicklable(Exception):
    def __init__(self) -> None:
        super().__init__("cannot travel")
        self.lock = threading.Lock()


def raise_unpicklable(x: int) -> int:
    if x == 2:
        raise _Unpicklable()
    return x


class KillOnce:
    """SIGKILLs its own worker on item ``item`` the first time; the marker file it writes
    first is what makes the retry succeed (and tells the test the crash happened)."""

    def __init__(self, item: int, marker: str) -> None:
        self.item = item
        self.marker = marker

    def __call__(self, x: int) -> int:
        if x == self.item and not os.path.exists(self.marker):
            Path(self.marker).write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)
        return x


class KillAlways:
    def __init__(self, item: int) -> None:
        self.item = item

    def __call__(self, x: int) -> int:
        if x == self.item:
            os.kill(os.getpid(), signal.SIGKILL)
        return x


class HangOn:
    """Never returns for item ``item`` (the timeout kills the worker)."""

    def __init__(self, item: int) -> None:
        self.item = item

    def __call__(self, x: int) -> int:
        if x == self.item:
            threading.Event().wait()
        return x


def busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


# Same-process gates for thread executors, looked up by name so fns stay picklable.
GATES: dict[str, Gate] = {}


def gate(name: str) -> Gate:
    return GATES.setdefault(name, Gate())


class HoldFirst:
    """Item 0 waits for gate ``release``; item ``x > 0`` sets gate ``<prefix>:done:<x>``
    where ``prefix`` is ``release`` up to its first ``:done:`` or ``:release``."""

    def __init__(self, release: str) -> None:
        self.release = release
        self.prefix = release.split(":done:")[0].removesuffix(":release")

    def __call__(self, x: int) -> int:
        if x == 0:
            gate(self.release).wait_sync()
        else:
            gate(f"{self.prefix}:done:{x}").set()
        return x


# ------------------------------------------------------------------------ sources
class Counting:
    """An infinite source that counts how many items were taken from it and checks,
    at every take, that the count stays within ``bound()``.

    ``kind``: ``"collection"`` (a Collection, iterated on the loop), ``"generator"``
    (a plain iterator: pulled by the stream's source thread) or ``"async"``.
    """

    def __init__(self, kind: str, bound: Callable[[], int]) -> None:
        self.kind = kind
        self.bound = bound
        self.count = 0
        self.violations: list[tuple[int, int]] = []
        self.reached: dict[int, Gate] = {}
        self.closed = Gate()

    def at(self, n: int) -> Gate:
        g = self.reached.setdefault(n, Gate())
        if self.count >= n:
            g.set()
        return g

    def _take(self) -> int:
        n = self.count
        self.count += 1
        limit = self.bound()
        if self.count > limit:
            self.violations.append((self.count, limit))
        g = self.reached.get(self.count)
        if g is not None:
            g.set()
        return n

    def source(self) -> Any:
        if self.kind == "collection":
            return _CountingCollection(self)
        if self.kind == "generator":
            return self._gen()
        return self._agen()

    def _gen(self) -> Iterator[int]:
        try:
            while True:
                yield self._take()
        finally:
            self.closed.set()

    async def _agen(self) -> AsyncIterator[int]:
        try:
            while True:
                yield self._take()
        finally:
            self.closed.set()


class _CountingCollection:
    def __init__(self, owner: Counting) -> None:
        self.owner = owner

    def __len__(self) -> int:
        return 1 << 62

    def __contains__(self, x: object) -> bool:
        return isinstance(x, int) and x >= 0

    def __iter__(self) -> Iterator[int]:
        return self.owner._gen()


def stalled_source(kind: str, first: int, total: int, release: Gate, closed: Gate | None = None) -> Any:
    """Yields ``0..first-1``, waits for ``release``, then yields the rest up to ``total``."""

    def gen() -> Iterator[int]:
        try:
            for i in range(total):
                if i == first:
                    release.wait_sync()
                yield i
        finally:
            if closed is not None:
                closed.set()

    async def agen() -> AsyncIterator[int]:
        try:
            for i in range(total):
                if i == first:
                    await release.wait()
                yield i
        finally:
            if closed is not None:
                closed.set()

    return gen() if kind == "generator" else agen()


def failing_source(kind: str, n_ok: int) -> Any:
    """Yields ``0..n_ok-1`` and then raises ``KeyError('source broke')``."""

    def gen() -> Iterator[int]:
        yield from range(n_ok)
        raise KeyError("source broke")

    async def agen() -> AsyncIterator[int]:
        for i in range(n_ok):
            yield i
        raise KeyError("source broke")

    return gen() if kind == "generator" else agen()


class ExitOn:
    """Ends its worker with ``os._exit(3)`` on item ``item``, every time."""

    def __init__(self, item: int) -> None:
        self.item = item

    def __call__(self, x: int) -> int:
        if x == self.item:
            os._exit(3)
        return x


async def fetch_same(x: Any) -> Any:
    """A ``fetch=`` that hands the item on as it is."""
    return x

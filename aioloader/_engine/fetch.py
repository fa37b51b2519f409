"""The fetch stage: a unit's samples fetched on the event loop before it is dispatched.

::

    window slot ──▶ fetch stage (io_concurrency, io_buffer) ──▶ dispatcher ──▶ pool
                    fetch(item) for every sample, many at once   transform + collate_fn

When a unit takes a window slot, the fetches of its items start on the run's loop; once
all of them finished, the unit is dispatched with the fetched values instead of its
indices, so the worker only transforms and collates. Fetches of later units run while
workers build earlier ones. Two bounds hold across the whole run: at most
``io_concurrency`` fetches are running (one semaphore), and fetched bytes that have not
been handed to a worker yet stay under ``io_buffer``: a fetch starts only while the bytes
held plus the in-flight fetches (each counted at the largest size seen so far) fit the
budget (before the first fetch returns, while fewer than ``io_concurrency`` are in
flight). The oldest unit not yet dispatched is exempt, so the run always makes progress:
the budget is exceeded by at most that one unit (and by results larger than any before).

The values stay with the unit once fetched: a worker crash resubmits them (no refetch).
Transient failures (connection errors, timeouts, HTTP 5xx and 429) are retried with
exponential backoff and jitter; a failure for good keeps its type and gains a note naming
the sample index and the item, or, with ``on_error="skip"``, skips that sample.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import random
import sys
import time
import weakref
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from .._stats import Recorder
from .._validate import check_int, check_seconds
from ..errors import LoaderTimeout, add_note

__all__ = ["FetchConfig", "FetchStage", "Then", "is_transient", "nbytes", "resolve_remote"]

DEFAULT_IO_BUFFER = 256 << 20
BACKOFF_BASE_S = 0.05  # first retry after ~50 ms, doubling, jittered by +-50 %
BACKOFF_CAP_S = 2.0


@dataclass(frozen=True)
class FetchConfig:
    """The validated fetch options of a loader (what a run's stage needs)."""

    fetch: Callable[[Any], Awaitable[Any]]
    concurrency: int
    budget: int
    retries: int
    timeout: float | None
    skip: bool
    total: float | None = None  # seconds for all tries of one fetch together

    @staticmethod
    def make(fetch: Any, io_concurrency: Any, io_buffer: Any, fetch_retries: Any,
             timeout: float | None, on_error: str, fetch_timeout: Any = None) -> FetchConfig | None:  # fmt: skip
        """Validate the options (each error names its parameter); ``None`` without ``fetch``."""
        concurrency = check_int("io_concurrency", io_concurrency, 1)
        budget = check_int("io_buffer", io_buffer, 1)
        retries = check_int("fetch_retries", fetch_retries, 0)
        total = check_seconds("fetch_timeout", fetch_timeout, allow_zero=False)
        if fetch is None:
            return None
        if not callable(fetch):
            raise TypeError(f"fetch must be an async callable, got {fetch!r}")
        if inspect.isfunction(fetch) and not inspect.iscoroutinefunction(fetch):
            raise TypeError(f"fetch must be an async function (async def), got the plain function {fetch!r}")
        return FetchConfig(fetch, concurrency, budget, retries, timeout, on_error == "skip", total)


class Then:
    """``second(first(x))``: a dataset's own transform followed by the user's. Picklable
    when both are."""

    def __init__(self, first: Callable[[Any], Any], second: Callable[[Any], Any]) -> None:
        self.first = first
        self.second = second

    def __call__(self, x: Any) -> Any:
        return self.second(self.first(x))

    def __repr__(self) -> str:
        return f"Then({self.first!r}, {self.second!r})"


def resolve_remote(dataset: Any, fetch: Any, transform: Any) -> tuple[Any, Any, Any]:
    """``(keys, fetch, transform)`` for a loader: a dataset that knows how to fetch
    itself (``__aioloader_remote__()`` returning ``(items, fetch, transform)``) is
    replaced by its item list, unless the user gave a ``fetch`` of their own."""
    if transform is not None and not callable(transform):
        raise TypeError(f"transform must be callable or None, got {transform!r}")
    hook = getattr(dataset, "__aioloader_remote__", None)
    if fetch is not None or hook is None or not callable(hook):
        return dataset, fetch, transform
    items, own_fetch, own_transform = hook()
    if own_transform is not None and transform is not None:
        transform = Then(own_transform, transform)
    elif own_transform is not None:
        transform = own_transform
    return items, own_fetch, transform


def nbytes(value: Any, depth: int = 4) -> int:
    """What a fetched value or a batch weighs (against ``io_buffer``, a growing window):
    ``len`` of bytes, ``nbytes`` of arrays, tensors and memoryviews, the sum over a
    tuple/list/dict's members (a ``(bytes, label)`` pair weighs its bytes) and over an
    object's attributes (a dataclass), ``depth`` levels down; else ``sys.getsizeof``."""
    if isinstance(value, (bytes, bytearray)):
        return len(value)
    size = getattr(value, "nbytes", None)
    if isinstance(size, int):
        return size
    if depth > 0:
        if isinstance(value, (tuple, list)):
            return sum(nbytes(v, depth - 1) for v in value)
        if isinstance(value, dict):
            return sum(nbytes(v, depth - 1) for v in value.values())
        members = getattr(value, "__dict__", None)
        if isinstance(members, dict) and not isinstance(value, type):
            return sys.getsizeof(value) + sum(nbytes(v, depth - 1) for v in members.values())
    return sys.getsizeof(value)


def is_transient(exc: BaseException) -> bool:
    """Worth retrying: connection errors (reset included), timeouts, aiohttp's
    connection errors, and errors carrying an HTTP ``status`` of 5xx or 429."""
    if isinstance(exc, (ConnectionError, TimeoutError, asyncio.TimeoutError)):
        return True
    aiohttp = sys.modules.get("aiohttp")  # a fetch that raises its errors has imported it
    if aiohttp is not None and isinstance(
        exc, (aiohttp.ClientConnectionError, aiohttp.ServerDisconnectedError)
    ):
        return True
    status = getattr(exc, "status", None)
    return isinstance(status, int) and (500 <= status < 600 or status == 429)


def _describe(item: Any, limit: int = 80) -> str:
    try:
        text = repr(item)
    except Exception:
        text = f"<{type(item).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


class NoData(NamedTuple):
    """A unit none of whose samples survived the fetch (``on_error="skip"``)."""

    data: Any
    skipped: tuple[tuple[int, str], ...]


class _Failed(NamedTuple):
    position: int
    why: str


class _TimedOut(TimeoutError):
    """A try of a fetch ran past the loader's ``timeout`` (transient: retried)."""


# 3.11+: a timer on the running task (4 µs a fetch here); wait_for made a task (12 µs).
_timeout: Any = getattr(asyncio, "timeout", None)


class _OutOfTime(TimeoutError):
    """A try of a fetch ran past what ``fetch_timeout`` left it (not retried)."""


class _UnitState:
    __slots__ = ("bytes",)

    def __init__(self) -> None:
        self.bytes = 0


# Runs that use a fetch owner (an object with ``aclose()``), per event loop: the owner is
# closed on a loop when the last run that fetched with it there ends.
_owner_runs: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[int, int]] = (
    weakref.WeakKeyDictionary()
)


def _owner(fetch: Any) -> Any:
    for obj in (fetch, getattr(fetch, "__self__", None)):
        if obj is not None and callable(getattr(obj, "aclose", None)):
            return obj
    return None


class FetchStage:
    """One run's fetch stage (see the module docstring). Lives on the run's loop."""

    def __init__(self, cfg: FetchConfig, recorder: Recorder) -> None:
        self.cfg, self.recorder, self.loop = cfg, recorder, asyncio.get_running_loop()
        self.sem = asyncio.Semaphore(cfg.concurrency)
        # buffered: fetched bytes of units not yet handed to a worker; admitted: fetches
        # past the budget check, not yet finished; running: those holding the semaphore;
        # largest: the largest value seen (what an in-flight fetch may add); sized: a
        # fetch finished (until then at most io_concurrency are admitted).
        self.buffered = self.admitted = self.running = self.largest = 0
        self.sized = False
        self.units: OrderedDict[int, _UnitState] = OrderedDict()  # being fetched or waiting to dispatch
        self._changed: asyncio.Future[None] | None = None
        self._rng = random.Random()
        self._closed = False
        self.owner = _owner(cfg.fetch)
        if self.owner is not None:
            runs = _owner_runs.setdefault(self.loop, {})
            runs[id(self.owner)] = runs.get(id(self.owner), 0) + 1

    # ----------------------------------------------------------------- budget
    def _notify(self) -> None:
        fut, self._changed = self._changed, None
        if fut is not None and not fut.done():
            fut.set_result(None)

    async def _admit(self, uid: int) -> None:
        cfg = self.cfg
        while not (
            next(iter(self.units), None) == uid
            or (self.sized and self.buffered + (self.admitted + 1) * self.largest <= cfg.budget)
            or (not self.sized and self.admitted < cfg.concurrency)
        ):
            if self._changed is None:
                self._changed = self.loop.create_future()
            await self._changed
        self.admitted += 1

    def _release(self, uid: int) -> None:
        state = self.units.pop(uid, None)
        if state is not None:
            self.buffered -= state.bytes
            self._notify()

    # ---------------------------------------------------------------- fetches
    async def _call(self, item: Any, left: float | None) -> Any:
        """One try of ``fetch(item)``, within the loader's ``timeout`` and the ``left``
        seconds of the fetch's ``fetch_timeout``."""
        aw = self.cfg.fetch(item)
        if not inspect.isawaitable(aw):
            raise TypeError(
                f"fetch must be an async callable; fetch({_describe(item)}) returned {type(aw).__name__}"
            )
        per = self.cfg.timeout
        limit = per if left is None else left if per is None else min(per, left)
        if limit is None:
            return await aw
        start = self.loop.time()
        try:
            if _timeout is not None:  # fetch_timeout bounds every fetch: keep it cheap
                async with _timeout(limit):
                    return await aw
            return await asyncio.wait_for(aw, limit)
        except (TimeoutError, asyncio.TimeoutError):
            if self.loop.time() - start >= limit:
                raise (_TimedOut() if limit == per else _OutOfTime()) from None
            raise  # the fetch's own timeout, before ours

    async def _fetch_one(self, uid: int, state: _UnitState, index: int, item: Any) -> Any:
        cfg, rec = self.cfg, self.recorder
        await self._admit(uid)
        try:
            attempt = 0
            ends = None if cfg.total is None else self.loop.time() + cfg.total
            last: Exception | None = None  # the error of the last try that ended
            while True:
                async with self.sem:
                    self.running += 1
                    rec.fetch.peak = max(rec.fetch.peak, self.running)
                    try:
                        left = None if ends is None else max(0.0, ends - self.loop.time())
                        value = await self._call(item, left)
                        break
                    except asyncio.CancelledError:
                        raise
                    except _OutOfTime:
                        return self._out_of_time(index, item, last, attempt)
                    except Exception as exc:
                        err: Exception = exc
                        last = exc
                    finally:
                        self.running -= 1
                if attempt >= cfg.retries or not is_transient(err):
                    return self._failed(index, item, err, attempt)
                delay = min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2**attempt) * (0.5 + self._rng.random())
                if ends is not None and self.loop.time() + delay >= ends:
                    return self._out_of_time(index, item, err, attempt)
                attempt += 1
                rec.fetch.retries += 1
                await asyncio.sleep(delay)
        finally:
            self.admitted -= 1
            self._notify()
        size = nbytes(value)
        self.largest = max(self.largest, size)
        self.sized = True
        if uid in self.units:
            state.bytes += size
            self.buffered += size
            rec.fetch.buffer_peak = max(rec.fetch.buffer_peak, self.buffered)
        rec.fetch.done += 1
        rec.fetch.bytes += size
        return value

    def _out_of_time(self, index: int, item: Any, last: Exception | None, retries: int) -> _Failed:
        """The fetch used up ``fetch_timeout``: its last error, or a LoaderTimeout."""
        total = self.cfg.total
        tries = retries + 1
        spent = f"fetch_timeout={total} s ran out after {tries} {'try' if tries == 1 else 'tries'}"
        if last is None:
            exc: Exception = LoaderTimeout(
                f"fetch of sample index {index} (item {_describe(item)}) got no answer within "
                f"fetch_timeout={total} s ({tries} {'try' if tries == 1 else 'tries'})",
                indices=[index],
                timeout=total,
            )
        else:
            exc = last
            add_note(exc, f"aioloader: {spent}; the last try's error is this one")
        return self._failed(index, item, exc, retries)

    def _failed(self, index: int, item: Any, exc: Exception, retries: int) -> _Failed:
        tries = f" after {retries} retries" if retries else ""
        if isinstance(exc, _TimedOut):
            exc = LoaderTimeout(
                f"fetch of sample index {index} (item {_describe(item)}) did not finish within "
                f"timeout={self.cfg.timeout} s{tries}",
                indices=[index],
                timeout=self.cfg.timeout,
            )
        if self.cfg.skip:
            return _Failed(index, f"{type(exc).__name__}: {exc}")
        add_note(
            exc, f"aioloader: raised by fetch(item) for sample index {index}, item {_describe(item)}{tries}"
        )
        raise exc

    # ------------------------------------------------------------------- units
    async def run(self, unit: Any, dispatch: Callable[[Callable[[int, bool], Any]], Awaitable[Any]]) -> Any:
        """Fetch ``unit``'s items, then ``await dispatch(make_task)`` with the values
        (released from the byte budget when the task is first built, that is, when it
        is handed to the pool, and dropped by the unit once the dispatch is over).
        Returns the dispatch's result with the samples whose fetch failed for good added
        to its ``skipped``."""
        uid = id(unit)
        state = self.units[uid] = _UnitState()
        t0 = time.monotonic_ns()
        tasks: list[asyncio.Task[Any]] = []
        try:
            indices = [int(i) for i in unit.indices]
            slots: list[Any] = []  # per item: its fetch task, or how reading the item failed
            for k, index in enumerate(indices):
                try:
                    item = unit.fetch_input(k, index)
                except Exception as exc:
                    if not self.cfg.skip:
                        raise
                    slots.append(_Failed(index, f"{type(exc).__name__}: {exc}"))
                    continue
                tasks.append(self.loop.create_task(self._fetch_one(uid, state, index, item)))
                slots.append(tasks[-1])
            await _all_or_first_error(tasks)
            values = [s.result() if isinstance(s, asyncio.Task) else s for s in slots]
            self.recorder.fetch.wait_ns += time.monotonic_ns() - t0
            kept = [(i, v) for i, v in zip(indices, values, strict=True) if type(v) is not _Failed]
            skipped = tuple((v.position, v.why) for v in values if type(v) is _Failed)
            if not kept:
                return NoData(None, skipped)
            unit.set_fetched([i for i, _ in kept], [v for _, v in kept])

            def make_task(task_id: int, with_payload: bool) -> Any:
                self._release(uid)
                return unit.make_task(task_id, with_payload)

            try:
                res = await dispatch(make_task)
            finally:
                # Built (or failed for good): no resubmission will need the values, so a
                # finished unit that waits for its consumer does not keep them too.
                unit.drop_fetched()
            return res._replace(skipped=skipped + tuple(res.skipped)) if skipped else res
        finally:
            self._release(uid)
            for t in tasks:
                t.cancel()
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)

    async def aclose(self) -> None:
        """The run ended: close the fetch's owner if no other run on this loop uses it."""
        if self._closed or self.owner is None:
            return
        self._closed = True
        runs = _owner_runs.get(self.loop, {})
        left = runs.get(id(self.owner), 1) - 1
        if left > 0:
            runs[id(self.owner)] = left
            return
        runs.pop(id(self.owner), None)
        with contextlib.suppress(Exception):
            await self.owner.aclose()


async def _all_or_first_error(tasks: list[asyncio.Task[Any]]) -> None:
    """Wait for every task; raise the first exception as soon as one raises (the caller
    cancels the rest)."""
    if not tasks:
        return
    done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    for t in tasks:
        if t in done and not t.cancelled() and t.exception() is not None:
            raise t.exception()  # type: ignore[misc]

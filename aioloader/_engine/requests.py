"""The Batcher's unit source: a priority queue of requests, cut into micro-batches.

Each request is an item with its own future. Requests wait in a heap ordered by
(higher priority first, then arrival); the run asks for the next unit while it holds a
window slot, and the queue hands out up to ``batch_size`` live requests, waiting for
more only until ``max_latency`` after the *first* of them arrived (time a request spent
queued while every slot was busy counts against its wait, so load never adds a second
helping of batching delay).

A request leaves the heap lazily: cancelled by its caller, or expired at its deadline,
it is only marked (and counted), and skipped when the queue is cut. So neither costs a
worker anything. Once dispatched, a cancelled request's result is dropped on arrival.
"""

from __future__ import annotations

import asyncio
import functools
import heapq
import itertools
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import _stream_worker
from ..errors import DeadlineExceeded, LoaderClosedError, Overloaded
from .epochs import WorkerSide

__all__ = ["Request", "RequestQueue", "ServeCounters", "ServeUnit"]

_QUEUED, _DISPATCHED, _DONE = 0, 1, 2


class Request:
    __slots__ = ("arrived", "deadline", "dispatched", "future", "item", "rid", "state", "timer")

    def __init__(self, rid: int, item: Any, future: asyncio.Future[Any], arrived: float) -> None:
        self.rid = rid
        self.item = item
        self.future = future
        self.arrived = arrived
        self.deadline: float | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.dispatched = 0.0
        self.state = _QUEUED


class ServeCounters:
    """What the queue counts (read by ``Batcher.stats()`` from any thread)."""

    def __init__(self) -> None:
        self.submitted = self.completed = self.failed = self.rejected = self.expired = 0
        self.cancelled_queued = self.cancelled_dispatched = 0
        self.queue_wait: deque[float] = deque(maxlen=10_000)
        self.service: deque[float] = deque(maxlen=10_000)
        self.sizes: Counter[int] = Counter()


class ServeUnit:
    """One micro-batch of requests (a stream task of ``(request id, item)`` pairs)."""

    __slots__ = ("_side", "group", "key", "requests", "size")

    fn = staticmethod(_stream_worker.run_stream_batch)

    def __init__(self, side: WorkerSide, seq: int, requests: list[Request]) -> None:
        self._side = side
        self.group = 0
        self.key = seq
        self.requests = requests
        self.size = len(requests)

    @property
    def label(self) -> str:
        return f"micro-batch {self.key} (requests {[r.rid for r in self.requests]})"

    @property
    def indices(self) -> list[int]:
        return [r.rid for r in self.requests]

    def make_task(self, task_id: int, with_payload: bool) -> _stream_worker.StreamTask:
        side = self._side
        payload = side.inline if side.inline is not None else side.payload() if with_payload else None
        pairs = [(r.rid, r.item) for r in self.requests]
        return _stream_worker.StreamTask(side.token, task_id, self.key, self.requests[0].rid, pairs, payload)


class RequestQueue:
    """See the module docstring. Lives on one event loop."""

    def __init__(
        self, side: WorkerSide, batch_size: int, max_latency: float, max_pending: int, counters: ServeCounters
    ) -> None:
        self.side = side
        self.batch_size = batch_size
        self.max_latency = max_latency
        self.max_pending = max_pending
        self.counters = counters
        self.loop = asyncio.get_running_loop()
        self.heap: list[tuple[int, int, Request]] = []
        self.waiting = 0  # live requests in the heap
        self.outstanding: set[Request] = set()  # dispatched, result not yet handed over
        self.closed = False
        self._ids = itertools.count()
        self._seq = itertools.count()
        self._arrival: asyncio.Future[None] | None = None
        self._room: deque[asyncio.Future[None]] = deque()  # blocked submitters, first come first served
        self.idle: Callable[[], bool] = lambda: False  # is a worker free? (set by the Batcher)

    # ------------------------------------------------------------------ intake
    async def put(self, item: Any, priority: int, deadline: float | None, block: bool) -> asyncio.Future[Any]:
        while self.waiting >= self.max_pending and not self.closed:
            if not block:
                self.counters.rejected += 1
                raise Overloaded(
                    f"the Batcher already holds max_pending={self.max_pending} waiting requests",
                    max_pending=self.max_pending,
                )
            room = self.loop.create_future()
            self._room.append(room)
            try:
                await room
            finally:
                if room in self._room:
                    self._room.remove(room)
        if self.closed:
            raise LoaderClosedError("the Batcher was closed")
        loop = self.loop
        req = Request(next(self._ids), item, loop.create_future(), loop.time())
        if deadline is not None:
            req.deadline = deadline
            req.timer = loop.call_at(req.arrived + deadline, self._expire, req)
        req.future.add_done_callback(functools.partial(self._settled, req))
        heapq.heappush(self.heap, (-priority, req.rid, req))
        self.waiting += 1
        self.counters.submitted += 1
        self._wake()
        return req.future

    def _wake(self) -> None:
        if self._arrival is not None and not self._arrival.done():
            self._arrival.set_result(None)

    def _expire(self, req: Request) -> None:
        if req.state == _QUEUED and not req.future.done():
            self.counters.expired += 1
            req.future.set_exception(
                DeadlineExceeded(
                    f"request {req.rid} waited past its deadline of {req.deadline} s before a worker took it",
                    deadline=req.deadline,
                )
            )

    def _settled(self, req: Request, _future: asyncio.Future[Any]) -> None:
        """The request's future is done: resolved by us, or cancelled/expired before."""
        if req.timer is not None:
            req.timer.cancel()
        if req.state == _QUEUED:  # cancelled by its caller, or expired: leaves the heap lazily
            req.state = _DONE
            self.waiting -= 1
            if req.future.cancelled():
                self.counters.cancelled_queued += 1
            self._make_room()
        elif req.state == _DISPATCHED and req.future.cancelled():
            self.counters.cancelled_dispatched += 1  # its result is dropped on arrival

    def _make_room(self) -> None:
        while self._room and self.waiting < self.max_pending:
            room = self._room.popleft()
            if not room.done():
                room.set_result(None)
                return

    # ---------------------------------------------------------------- dispatch
    def _pop(self) -> Request | None:
        heap = self.heap
        while heap:
            req = heapq.heappop(heap)[2]
            # A future cancelled or expired a moment ago is skipped even before its done
            # callback (which does the accounting) has run.
            if req.state == _QUEUED and not req.future.done():
                return req
        return None

    async def next_unit(self) -> ServeUnit | None:
        loop = self.loop
        first = self._pop()
        while first is None:
            if self.closed:
                return None
            self._arrival = loop.create_future()
            await self._arrival
            first = self._pop()
        batch = [first]
        until = first.arrived + self.max_latency
        while len(batch) < self.batch_size:
            req = self._pop()
            if req is not None:
                batch.append(req)
                continue
            # Waiting to fill only pays while every worker is busy: with one idle, the
            # requests at hand go now (low load adds no batching delay).
            if self.closed or self.idle() or loop.time() >= until:
                break
            self._arrival = loop.create_future()
            handle = loop.call_at(until, self._wake)
            try:
                await self._arrival
            finally:
                handle.cancel()
        now = loop.time()
        for req in batch:
            req.state = _DISPATCHED
            req.dispatched = now
            self.counters.queue_wait.append(now - req.arrived)
            if req.timer is not None:
                req.timer.cancel()
        self.waiting -= len(batch)
        self.outstanding.update(batch)
        self.counters.sizes[len(batch)] += 1
        self._make_room()
        return ServeUnit(self.side, next(self._seq), batch)

    # ----------------------------------------------------------------- results
    def resolve(self, unit: ServeUnit, outcomes: list[Any] | None, error: BaseException | None) -> None:
        from .._serve_worker import Failed

        self._wake()  # a worker is free: a micro-batch being filled may go now
        now = self.loop.time()
        for k, req in enumerate(unit.requests):
            self.outstanding.discard(req)
            state, req.state = req.state, _DONE
            if req.future.done() or state != _DISPATCHED:
                continue
            self.counters.service.append(now - req.dispatched)
            out: Any = outcomes[k] if outcomes is not None else None
            if error is None and type(out) is Failed:
                error_k: BaseException | None = out.exc
            else:
                error_k = error
            if error_k is not None:
                self.counters.failed += 1
                req.future.set_exception(error_k)
            else:
                self.counters.completed += 1
                req.future.set_result(out)

    async def aclose(self) -> None:
        """Fail every request not yet answered, and every blocked submitter."""
        if self.closed:
            return
        self.closed = True
        self._wake()
        for req in [r for _, _, r in self.heap] + list(self.outstanding):
            if not req.future.done():
                req.state = _DONE
                req.future.set_exception(
                    LoaderClosedError(f"the Batcher was closed before request {req.rid} was answered")
                )
        self.heap.clear()
        self.outstanding.clear()
        for room in self._room:
            if not room.done():
                room.set_result(None)


def percentiles(values: deque[float]) -> tuple[float | None, float | None, float | None]:
    """p50, p99 and max of ``values`` (seconds), or Nones when empty."""
    if not values:
        return None, None, None
    a = np.fromiter(list(values), dtype=np.float64)
    return float(np.percentile(a, 50)), float(np.percentile(a, 99)), float(a.max())

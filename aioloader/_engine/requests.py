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

Deadlines are end to end: a request with ``deadline=`` is answered by then, with its
result or with ``DeadlineExceeded``. Three checks keep the second rare and cheap:

- *admission*: the queue learns what one item costs a worker (from each finished
  micro-batch's worker time) and, at ``submit()``, estimates when a new request would be
  answered from the work ahead of it (requests waiting at its priority or higher, drained
  at the rate the pool has been answering, plus a micro-batch's measured time from
  dispatch to answer). A request whose estimate passes its deadline is refused at once with
  ``Overloaded``: the caller can answer 503 or try elsewhere while there is still time;
- *dispatch*: a request with less time left than one item takes is expired there, not
  sent to a worker;
- *in flight*: a request still at a worker at its deadline fails then; the worker's
  result for it is dropped on arrival.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import heapq
import itertools
import time
from collections import Counter, deque
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import DeadlineExceeded, LoaderClosedError, Overloaded, add_note
from .admission import HEADROOM, CostModel
from .epochs import WorkerSide
from .serve_unit import ServeUnit

__all__ = ["Request", "RequestQueue", "ServeCounters", "ServeUnit"]

# A request is QUEUED in the heap, FILLING once taken into the micro-batch being cut (out
# of the heap, not yet sent), DISPATCHED once sent, DONE once answered or dropped.
_QUEUED, _FILLING, _DISPATCHED, _DONE = 0, 1, 2, 3

# Every stamp and deadline is on this clock. Not ``loop.time()``: uvloop's is the time the
# current loop iteration began, in whole milliseconds, too coarse for the queue waits and
# service times the stats report and the admission estimates learn from.
_clock = time.monotonic


class Request:
    __slots__ = (
        "arrived", "deadline", "dispatched", "due", "estimate", "future", "item", "priority", "rid", "state", "timer",
    )  # fmt: skip

    def __init__(
        self, rid: int, item: Any, future: asyncio.Future[Any], arrived: float, priority: int
    ) -> None:
        self.rid = rid
        self.item = item
        self.future = future
        self.arrived = arrived
        self.priority = priority
        self.deadline: float | None = None  # seconds, as given to submit()
        self.due: float | None = None  # the deadline on _clock
        self.estimate: float | None = None  # seconds to its answer, as estimated at admission
        self.timer: asyncio.TimerHandle | None = None
        self.dispatched = 0.0
        self.state = _QUEUED


class ServeCounters:
    """What the queue counts (read by ``Batcher.stats()`` from any thread)."""

    def __init__(self) -> None:
        self.submitted = self.completed = self.failed = self.rejected = self.expired = 0
        self.rejected_late = self.expired_dispatched = 0
        self.cancelled_queued = self.cancelled_dispatched = 0
        self.cut_short = 0  # micro-batches sized down to the tightest deadline they carried
        self.queue_wait: deque[float] = deque(maxlen=10_000)
        self.service: deque[float] = deque(maxlen=10_000)
        self.sizes: Counter[int] = Counter()


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
        self._woken = 0  # blocked submitters let in but not yet back in put()
        self._filling: list[Request] = []  # the micro-batch being cut (out of the heap)
        self._full = False  # the micro-batch being cut holds what its deadlines allow
        self.idle: Callable[[], bool] = lambda: False  # is a worker free? (set by the Batcher)
        self.model = CostModel()  # what the pool costs, learnt as it runs
        self._by_priority: Counter[int] = Counter()  # live requests in the heap, by priority

    # ------------------------------------------------------------------ intake
    async def put(self, item: Any, priority: int, deadline: float | None, block: bool) -> asyncio.Future[Any]:
        loop = self.loop
        called = _clock()
        while self.waiting + self._woken >= self.max_pending and not self.closed:
            if not block:
                self.counters.rejected += 1
                raise Overloaded(
                    f"the Batcher already holds max_pending={self.max_pending} waiting requests",
                    max_pending=self.max_pending,
                    estimate=None,
                    retry_after=self._drain_time(1),
                )
            await self._wait_for_room(called, deadline)
        if self.closed:
            raise LoaderClosedError("the Batcher was closed")
        # (let in at its deadline, its timer below fires at once: no special case)
        now = _clock()
        estimate = self._admit(priority, deadline) if deadline is not None and not block else None
        req = Request(next(self._ids), item, loop.create_future(), now, priority)
        if deadline is not None:
            req.deadline, req.due, req.estimate = deadline, called + deadline, estimate
            req.timer = loop.call_later(req.due - now, self._expire, req)
        req.future.add_done_callback(functools.partial(self._settled, req))
        heapq.heappush(self.heap, (-priority, req.rid, req))
        self.waiting += 1
        self._by_priority[priority] += 1
        self.counters.submitted += 1
        self._wake()
        return req.future

    async def _wait_for_room(self, called: float, deadline: float | None) -> None:
        """Wait (``block=True``) until the queue lets this submitter in, or its deadline."""
        room = self.loop.create_future()
        self._room.append(room)
        try:
            await asyncio.wait_for(room, None if deadline is None else max(0.0, called + deadline - _clock()))
        except asyncio.TimeoutError:
            assert deadline is not None
            self.counters.expired += 1
            raise DeadlineExceeded(
                f"the request waited past its deadline of {deadline} s for room in the queue "
                f"(max_pending={self.max_pending})",
                deadline=deadline,
                dispatched=False,
            ) from None
        finally:
            if room in self._room:
                self._room.remove(room)
            elif room.done() and not room.cancelled():
                self._woken -= 1  # let in by _make_room: now counted by waiting, or gone

    def estimate(self, priority: int) -> tuple[float, int] | None:
        """(seconds until a request of ``priority`` submitted now would be answered, the
        requests waiting ahead of it: at this priority or higher), or None before any
        micro-batch was answered. See :class:`~aioloader._engine.admission.CostModel`."""
        ahead = sum(n for p, n in self._by_priority.items() if p >= priority)
        est = self.model.estimate(ahead)
        return None if est is None else (est, ahead)

    def _admit(self, priority: int, deadline: float) -> float | None:
        """The estimated seconds to an answer, or raise ``Overloaded`` if the corrected
        estimate passes ``deadline``."""
        est = self.estimate(priority)
        if est is None or (not self.waiting and not self.outstanding):
            return est[0] if est is not None else None  # (nothing ahead: it goes at once)
        expected = self.model.corrected(est[0])
        if not self.model.fits(expected, deadline):
            self.counters.rejected += 1
            self.counters.rejected_late += 1
            raise Overloaded(
                f"the Batcher would answer this request in about {expected * 1e3:.1f} ms "
                f"({est[1]} requests ahead of it), too close to or past its deadline of "
                f"{deadline} s (admission keeps {HEADROOM:.0%} of a deadline spare)",
                max_pending=self.max_pending,
                estimate=expected,
                retry_after=max(self._drain_time(1), expected - deadline * (1.0 - HEADROOM)),
            )
        return est[0]

    def _drain_time(self, n: int) -> float:
        """Seconds the pool takes to answer ``n`` requests, by what it measured (a
        small default before it measured anything)."""
        model = self.model
        per = model.drain_s if model.drain_s is not None else model.item_s
        return max(0.001, n * per) if per is not None else 0.05

    def _left(self, req: Request) -> None:
        """``req`` left the heap (dispatched, cancelled or expired there)."""
        self.waiting -= 1
        left = self._by_priority[req.priority] - 1
        if left:
            self._by_priority[req.priority] = left
        else:
            del self._by_priority[req.priority]

    def _wake(self) -> None:
        if self._arrival is not None and not self._arrival.done():
            self._arrival.set_result(None)

    def _expire(self, req: Request, why: str = "") -> None:
        if req.future.done():
            return
        if not why and req.due is not None and (early := req.due - _clock()) > 0:
            # (a loop's timers run on its own clock, which may lag this one: not yet)
            req.timer = self.loop.call_later(early, self._expire, req)
            return
        if req.state in (_QUEUED, _FILLING):
            self.counters.expired += 1
            why = why or "waited past its deadline before a worker took it"
        elif req.state == _DISPATCHED:
            # (its answer, when it comes, still calibrates the estimates: see resolve)
            self.counters.expired_dispatched += 1
            why = "was still at a worker at its deadline (its result will be dropped)"
        else:
            return
        req.future.set_exception(
            DeadlineExceeded(
                f"request {req.rid} {why}: deadline of {req.deadline} s",
                deadline=req.deadline,
                dispatched=req.state == _DISPATCHED,
            )
        )

    def _settled(self, req: Request, _future: asyncio.Future[Any]) -> None:
        """The request's future is done: resolved by us, or cancelled/expired before."""
        if req.timer is not None:
            req.timer.cancel()
        state = req.state
        if state in (_QUEUED, _FILLING):  # cancelled by its caller, or expired, unsent
            req.state = _DONE
            req.item = None  # (a dead entry may stay in the heap a while: not its item)
            if state == _QUEUED:  # it leaves the heap lazily; a FILLING one has left it
                self._left(req)
                if len(self.heap) > 2 * self.waiting + 1024:
                    self._compact()
                self._make_room()
            if req.future.cancelled():
                self.counters.cancelled_queued += 1
        elif state == _DISPATCHED and req.future.cancelled():
            self.counters.cancelled_dispatched += 1  # its result is dropped on arrival

    def _compact(self) -> None:
        """Drop the dead entries of the heap (while every window slot is busy nothing pops
        them, and a service under load can cancel or expire many)."""
        self.heap = [e for e in self.heap if e[2].state == _QUEUED]
        heapq.heapify(self.heap)

    def _make_room(self) -> None:
        """Let in as many blocked submitters as there is room for, first come first served."""
        while self._room and self.waiting + self._woken < self.max_pending:
            room = self._room.popleft()
            if not room.done():
                room.set_result(None)
                self._woken += 1

    # ---------------------------------------------------------------- dispatch
    def _pop(self, batch: list[Request] | None = None) -> Request | None:
        """The next live request, taken out of the heap into the micro-batch being cut;
        ``None`` also when it would not fit in ``batch`` (see :meth:`_fits`): it stays."""
        heap = self.heap
        while heap:
            entry = heapq.heappop(heap)
            req = entry[2]
            # A future cancelled or expired a moment ago is skipped even before its done
            # callback (which does the accounting) has run.
            if req.state != _QUEUED or req.future.done():
                continue
            if self._too_late(req):
                self._expire(req, "had less time left than one item takes a worker")
                continue  # (its done callback does the accounting)
            if batch and not self._fits(batch, req):
                heapq.heappush(heap, entry)
                self._full = True
                return None
            req.state = _FILLING
            self._left(req)
            return req
        return None

    def _fits(self, batch: list[Request], req: Request) -> bool:
        """May ``req`` join ``batch``? Not if the micro-batch, one item longer, would no
        longer end in time for the tightest deadline it would carry (its measured cost
        per item, keeping the admission's spare share of the time left)."""
        item_s = self.model.item_s
        if item_s is None:
            return True
        dues = [r.due for r in batch if r.due is not None]
        if req.due is not None:
            dues.append(req.due)
        if not dues:
            return True
        left = (min(dues) - _clock()) * (1.0 - HEADROOM)
        return (len(batch) + 1) * item_s <= left

    def _too_late(self, req: Request) -> bool:
        item_s = self.model.item_s
        return req.due is not None and item_s is not None and _clock() + item_s > req.due

    async def next_unit(self) -> ServeUnit | None:
        loop = self.loop
        # (a cut interrupted by cancellation resumes with what it had taken)
        batch = self._filling
        while True:
            while not batch:
                first = self._pop()
                if first is not None:
                    batch.append(first)
                    self._make_room()
                    break
                if self.closed:
                    return None
                self._arrival = loop.create_future()
                await self._arrival
            until = batch[0].arrived + self.max_latency
            self._full = False
            while len(batch) < self.batch_size:
                req = self._pop(batch)
                if req is not None:
                    batch.append(req)
                    self._make_room()
                    continue
                if self._full:  # sized to its tightest deadline: it goes now
                    self.counters.cut_short += 1
                    break
                # Waiting to fill only pays while every worker is busy: with one idle, the
                # requests at hand go now (low load adds no batching delay).
                now = _clock()
                if self.closed or self.idle() or now >= until:
                    break
                self._arrival = loop.create_future()
                handle = loop.call_later(until - now, self._wake)
                try:
                    await self._arrival
                finally:
                    handle.cancel()
            # Requests cancelled or expired while the batch filled are not sent, nor is
            # one that no longer has the time one item takes.
            for req in batch:
                if req.state == _FILLING and not req.future.done() and self._too_late(req):
                    self._expire(req, "had less time left than one item takes a worker")
            batch[:] = [r for r in batch if r.state == _FILLING and not r.future.done()]
            if batch or self.closed:
                break
        self._filling = []
        if not batch:
            return None
        now = _clock()
        for req in batch:
            req.state = _DISPATCHED
            req.dispatched = now
            self.counters.queue_wait.append(now - req.arrived)
        self.outstanding.update(batch)
        self.counters.sizes[len(batch)] += 1
        return ServeUnit(self.side, next(self._seq), batch)

    # ----------------------------------------------------------------- results
    def resolve(self, unit: ServeUnit, outcomes: list[Any] | None, error: BaseException | None) -> None:
        from .._worker.serve import Failed

        self._wake()  # a worker is free: a micro-batch being filled may go now
        now = _clock()
        # A micro-batch that failed, or whose requests ran alone after a loss, tells
        # nothing of what one costs.
        if error is None and not unit.isolated:
            self.model.answered(unit.size, unit.requests[0].dispatched, now, self.waiting > 0)
        answered: list[tuple[float, float]] = []  # (seconds from submit, estimate)
        given: set[int] = set()  # the exceptions handed to a request already
        for k, req in enumerate(unit.requests):
            self.outstanding.discard(req)
            state, req.state = req.state, _DONE
            if state != _DISPATCHED:
                continue
            self.counters.service.append(now - req.dispatched)
            if req.estimate is not None and req.due is not None and req.deadline is not None:
                # Every answer calibrates, a late one too: its real time, not its deadline.
                answered.append((now - (req.due - req.deadline), req.estimate))
            if req.future.done():
                continue  # cancelled or expired in flight: the result is dropped
            out: Any = outcomes[k] if outcomes is not None else None
            error_k = out.exc if error is None and type(out) is Failed else error
            if error_k is not None and unit.size > 1:
                if error is not None or id(error_k) in given:  # one error, several callers: copies
                    error_k = _own(error_k, req.rid, unit.label)
                given.add(id(error_k))
            if error_k is not None:
                self.counters.failed += 1
                req.future.set_exception(error_k)
            else:
                self.counters.completed += 1
                req.future.set_result(out)
        for actual, estimate in answered:
            self.model.calibrate(actual, estimate)

    async def aclose(self) -> None:
        """Fail every request not yet answered, and every blocked submitter."""
        if self.closed:
            return
        self.closed = True
        self._wake()
        pending = [r for _, _, r in self.heap] + self._filling + list(self.outstanding)
        self.heap.clear()
        self._filling = []
        self.outstanding.clear()
        self.waiting = 0
        self._by_priority.clear()
        for req in pending:
            if not req.future.done():
                req.state = _DONE
                req.future.set_exception(
                    LoaderClosedError(f"the Batcher was closed before request {req.rid} was answered")
                )
        for room in self._room:
            if not room.done():
                room.set_result(None)
                self._woken += 1


def _own(error: BaseException, rid: int, label: str) -> BaseException:
    """``error`` of a whole micro-batch as request ``rid``'s own exception object: a
    copy with its own notes and traceback, so that callers do not share (and extend)
    one; the error itself where it cannot be copied."""
    try:
        own = copy.copy(error)
    except Exception:
        return error
    if type(own) is not type(error):
        return error
    own.__traceback__, own.__cause__, own.__context__ = error.__traceback__, error.__cause__, error.__context__
    own.__suppress_context__ = error.__suppress_context__
    notes = getattr(error, "__notes__", None)
    if notes is not None:
        own.__notes__ = list(notes)
    add_note(own, f"aioloader: request {rid} failed with the whole of its {label}")
    return own


def percentiles(values: deque[float]) -> tuple[float | None, float | None, float | None]:
    """p50, p99 and max of ``values`` (seconds), or Nones when empty."""
    if not values:
        return None, None, None
    a = np.fromiter(list(values), dtype=np.float64)
    return float(np.percentile(a, 50)), float(np.percentile(a, 99)), float(a.max())

"""The engine: one bounded window of work, fed by a unit source, on one event loop.

::

    unit source ──(one window slot per unit)──▶ dispatcher ──▶ pool
    consumer ◀──(ready queue: in order, or as completed)──◀──────┘

A *unit* is one pool task's worth of work: a batch position of an epoch, or a
micro-batch of a stream. The producer acquires a slot of the window, asks the source for
the next unit, and starts a task that runs the unit on the pool through the dispatcher.
The consumer frees the slot when it *takes* the unit, so units submitted, running, or
finished but not yet taken never exceed the window (``prefetch``).

Taking is two steps, so that a consumer in another thread (the ``for`` face) can be handed
finished units ahead of its asking without loosening that bound: :meth:`Run.take`, on the
run's loop, hands over the next finished unit, decoded, with its slot still held; the
consumer *releases* it (:meth:`Run.release`, from any thread) when it really takes it,
which counts the delivery and frees the slot on the loop.

The source alone decides what comes next and when: an epoch plan (continuing, as a
policy, into the next epoch while the consumer finishes this one), a stream's batcher,
which assembles items under a deadline while it holds its slot, or an iterable dataset's
shards (whose units are batches that long-running shard tasks send; such a source runs
its units itself, through its ``execute``). When the source ends or
raises, the run queues a terminal entry after the last unit, so the consumer gets every
unit taken before a source error, then the error.

Units carry a *group* (the epoch, or the stream's iteration). A consumer asks for the
next unit of its group; in unordered mode a finished unit of a later group is kept aside
(still holding its slot) until a consumer of that group asks.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures as cf
import threading
import time
from collections.abc import Callable
from typing import Any

from .._stats import _Epoch
from .._wake import waker_for
from ..errors import LoaderClosedError
from .dispatch import Dispatcher, Raised, cancelling
from .fetch import FetchStage, nbytes
from .group import GroupStage
from .isolate import IsolateStage
from .units import Delivery, RunConfig, Unit, UnitSource, closed_while_iterating

__all__ = ["Run"]

_CLOSE_SLICE = 0.05  # seconds: how often close_and_wait looks whether the run's loop closed


class _Terminal:
    """The last entry of the ready queue: the source ended, or raised ``error``."""

    def __init__(self, error: BaseException | None) -> None:
        self.error = error


_WAKE: Any = object()
_HAS_CANCELLING = hasattr(
    asyncio.Task, "cancelling"
)  # put on the ready queue by aclose(): wakes a waiting consumer


class Run:
    """One window of work on the running event loop (see the module docstring)."""

    def __init__(self, cfg: RunConfig, source: UnitSource) -> None:
        self.cfg = cfg
        self.source = source
        self.loop = asyncio.get_running_loop()
        self.sem = asyncio.Semaphore(cfg.prefetch)
        self.window = cfg.prefetch  # the semaphore's size; the grouping policy may grow it
        self._debt = 0  # slots to withhold as they free, after the window shrank
        self.ready: asyncio.Queue[Any] = asyncio.Queue()
        self.units: dict[asyncio.Future[Any], Unit] = {}  # submitted and not yet taken
        self.aside: collections.deque[asyncio.Future[Any]] = collections.deque()
        self.dispatcher = Dispatcher(
            cfg.pool, cfg.recorder, cfg.timeout, cfg.max_retries, cfg.is_closed, kind=cfg.kind
        )
        self.fetcher = FetchStage(cfg.fetch, cfg.recorder) if cfg.fetch is not None else None
        # A source whose units are not pool tasks of their own runs them itself: an
        # iterable dataset's units are batches its long-running shard tasks send.
        self._source_runs: Callable[[Any], Any] | None = getattr(source, "execute", None)
        self.grouper: GroupStage | None = None
        self.isolator = IsolateStage(self.dispatcher, cfg.recorder) if cfg.isolate else None
        if cfg.group is not None and self.fetcher is None and self._source_runs is None:
            self.grouper = GroupStage(self.dispatcher, cfg.group)
        # The policy that may grow the window while batches are cheap: the grouping
        # policy's, also where units are not grouped (an iterable dataset's batches).
        self.growth = cfg.group if cfg.group is not None and cfg.group.grow else None
        self.closed = False
        self.ended = False  # the consumer saw the terminal entry
        # Closed from outside the consumer's take() (superseded, the loader closed): what
        # the consumer's thread was handed ahead is void. take()'s own ending is not.
        self._void = False
        self._unqueued = 0  # unordered: submitted units not yet on the ready queue
        self._terminal: _Terminal | None = None  # waiting for them
        self._producer: asyncio.Task[None] | None = None
        self._close_done: asyncio.Future[None] | None = None
        self._cut = False  # its producer was cancelled from outside (see _produce)
        self._thread = threading.get_ident()  # the run's loop's
        self._waker = waker_for(self.loop)  # releases from other threads

    def start(self) -> None:
        if self._producer is None:
            self._producer = self.loop.create_task(
                self._produce(), name=f"aioloader-{self.cfg.kind}-producer"
            )

    # ------------------------------------------------------------------ producer
    async def _produce(self) -> None:
        error: BaseException | None = None
        held = 0  # window slots acquired for units not yet taken from the source
        try:
            while True:
                # A group's slots are all reserved before its first unit is taken, so
                # that its units go out together (without grouping: one at a time).
                want = 1
                if not held:
                    if self.growth is not None:
                        self._resize(self.growth.window)
                    if self.grouper is not None:
                        want = self.grouper.size
                while held < want:
                    await self.sem.acquire()
                    held += 1
                try:
                    unit = None if self.closed else await self.source.next_unit()
                except BaseException:
                    self._release_held(held)
                    raise
                if unit is None:
                    self._release_held(held)
                    break
                held -= 1
                self._submit(unit)
        except asyncio.CancelledError:
            # Only the run's close cancels its producer, after it set ``closed``. Else the
            # loop's owner cancelled every task: asyncio.run is ending.
            self._cut = not self.closed
            raise
        except BaseException as exc:
            error = exc
        terminal = _Terminal(error)
        if self._unqueued:  # unordered: the terminal entry goes after the last unit
            self._terminal = terminal
        else:
            self.ready.put_nowait(terminal)

    def _release_held(self, held: int) -> None:
        for _ in range(held):
            self._free_slot()

    def _free_slot(self) -> None:
        if self._debt:
            self._debt -= 1
        else:
            self.sem.release()

    def _resize(self, window: int) -> None:
        """Make the window ``window`` slots: new slots are free at once; a smaller window
        withholds slots as they free (nothing in flight is cancelled)."""
        delta, self.window = window - self.window, window
        if delta > 0:
            paid = min(delta, self._debt)
            self._debt -= paid
            for _ in range(delta - paid):
                self.sem.release()
        elif delta < 0:
            self._debt -= delta

    def _submit(self, unit: Unit) -> None:
        t = self.grouper.add(unit) if self.grouper is not None else None
        if t is None:
            t = self.loop.create_task(self._execute(unit))
        self.units[t] = unit
        self.cfg.recorder.submitted(time.monotonic_ns())
        if self.cfg.ordered:
            self.ready.put_nowait(t)
        else:
            self._unqueued += 1
            t.add_done_callback(self._queue_finished)

    def _queue_finished(self, t: asyncio.Future[Any]) -> None:
        self.ready.put_nowait(t)
        self._unqueued -= 1
        if not self._unqueued and self._terminal is not None:
            self.ready.put_nowait(self._terminal)
            self._terminal = None

    async def _execute(self, unit: Unit) -> Any:
        try:
            if self._source_runs is not None:  # its units run through the source (shards)
                return await self._source_runs(unit)
            if self.fetcher is not None:
                return await self.fetcher.run(unit, lambda make_task: self._dispatch(unit, make_task))
            return await self._dispatch(unit, unit.make_task)
        except (SystemExit, KeyboardInterrupt) as exc:
            return Raised(exc)

    def _dispatch(self, unit: Unit, make_task: Callable[[int, bool], Any]) -> Any:
        if self.isolator is not None:  # a micro-batch: lost, it runs again one item a task
            return self.isolator.run(unit, make_task)
        return self.dispatcher.run(unit.fn, make_task, unit)

    # ------------------------------------------------------------------ consumer
    async def next(self, rec: _Epoch, group: int | None = None) -> Delivery:
        """:meth:`take` and :meth:`release` in one: the next finished unit (of ``group``,
        when given), decoded, its slot freed; counted in ``rec``."""
        d = await self.take(group)
        self.release(d, rec)
        return d

    async def take(self, group: int | None = None) -> Delivery:
        """The next finished unit (of ``group``, when given), decoded, its slot still
        held: :meth:`release` it when the consumer takes it.

        Raises ``StopAsyncIteration`` at the end of the source (or when the run was
        closed under the consumer), :class:`~aioloader.LoaderClosedError` when the whole
        loader was, and what the source raised. What a unit raised is raised too (and
        the run closed), unless the run was configured not to fail fast: then an
        ``Exception`` comes back in :attr:`Delivery.error` (its slot held, as a batch's)
        and the run goes on; ``SystemExit``, ``KeyboardInterrupt`` and a closed loader
        still end it.
        """
        while True:
            if self.closed:
                raise self._end_error()
            t0 = time.monotonic_ns()
            entry = self._take_aside(group)
            if entry is None:
                try:
                    entry = await self.ready.get()
                except asyncio.CancelledError:
                    raise await self._cancelled() from None
            if entry is _WAKE:
                continue  # the loop head reports how the run ended
            if isinstance(entry, _Terminal):
                self.ended = entry.error is None
                await self._end_in_take()
                if entry.error is not None:
                    raise entry.error
                raise StopAsyncIteration
            unit = self.units[entry]
            if group is not None and unit.group != group:
                self.aside.append(entry)  # a later group's unit, finished early
                continue
            try:
                # Shielded: a consumer cancelled while it waits must not cancel the unit
                # itself (its dispatcher could not tell that from a pool event on 3.10);
                # the run's own close cancels units, with the dispatcher told first. A
                # finished unit (the common case) is read without the shield's future.
                res = entry.result() if entry.done() else await asyncio.shield(entry)
            except asyncio.CancelledError:
                raise await self._cancelled() from None
            except Exception as exc:
                if not self.cfg.fail_fast and not isinstance(exc, (LoaderClosedError, *self.cfg.fatal)):
                    # Delivered like a batch: its slot is held until the consumer takes it,
                    # so errors taken ahead count against the window too.
                    return Delivery(unit, None, (), exc, entry, time.monotonic_ns() - t0)
                self._release(entry)
                await self._end_in_take()
                raise
            if type(res) is Raised:  # SystemExit, KeyboardInterrupt: the run ends
                self._release(entry)
                await self._end_in_take()
                raise res.exc
            data = res.data
            if data is not None:
                if self.cfg.decode is not None:
                    data = self.cfg.decode(data)
                policy = self.growth
                if policy is not None:
                    # The first delivery is weighed, then one in 4 while the window is
                    # above its start (so a change of size shrinks it soon), else one in 32.
                    if not self.cfg.recorder.batches % (4 if policy.window > policy.base else 32):
                        policy.observe_bytes(nbytes(data))
            return Delivery(unit, data, res.skipped, None, entry, time.monotonic_ns() - t0)

    def release(self, d: Delivery, rec: _Epoch, waited_ns: int | None = None) -> None:
        """The consumer took ``d``: count it in ``rec`` (``waited_ns``: how long the
        consumer waited for it, if not :meth:`take`'s wait) and free its slot. From any
        thread; from another than the run's loop's, the loop frees it soon after."""
        if d.slot is None:
            return
        if self._void:
            # Closed under the consumer (a new iteration, close()): what was taken ahead
            # for it is void, as what was not taken yet.
            raise self._end_error()
        now = time.monotonic_ns()
        waited = d.waited_ns if waited_ns is None else waited_ns
        if threading.get_ident() == self._thread:
            self._count_and_free(d, rec, waited, now)
        else:  # sharing a wake-up of the loop with results and other releases
            self._waker.call(self._count_and_free, d, rec, waited, now)

    async def _end_in_take(self) -> None:
        """The run ends where the consumer will see why (its end, or a unit's error):
        what was taken before stays the consumer's to release."""
        await self.aclose(void=False)

    def _count_and_free(self, d: Delivery, rec: _Epoch, waited: int, now: int) -> None:
        # Counted before the slot frees: a pull that the freed slot allows is never seen
        # before the delivery that allowed it.
        if d.data is not None:
            self.cfg.recorder.delivered(rec, d.unit.size - len(d.skipped), waited, now)
        self._release(d.slot)

    async def _cancelled(self) -> BaseException:
        """The consumer saw ``CancelledError``: its own cancellation (re-raised), or the
        run closed under it (the end, or LoaderClosedError if the loader was closed)."""
        # Without Task.cancelling() (Python 3.10): a run that was already closed when the
        # consumer saw the error cancelled it; otherwise the consumer itself is cancelled.
        own = cancelling() if _HAS_CANCELLING else not self.closed
        await self.aclose()
        if own:
            return asyncio.CancelledError()
        return self._end_error()

    def _take_aside(self, group: int | None) -> asyncio.Future[Any] | None:
        for t in self.aside:
            if group is None or self.units[t].group == group:
                self.aside.remove(t)
                return t
        return None

    def _end_error(self) -> BaseException:
        if self.cfg.is_closed():
            return closed_while_iterating(self.cfg.kind)
        return StopAsyncIteration()

    def _release(self, t: asyncio.Future[Any]) -> None:
        # The slot frees when the consumer takes the unit, not when the worker ends it;
        # once per unit, whichever path takes it.
        if self.units.pop(t, None) is not None:
            self._free_slot()
            self.cfg.recorder.released()

    # ------------------------------------------------------------------- closing
    async def aclose(self, *, void: bool = True) -> None:
        """Cancel pending work, close the source, and wait until all of it stopped.
        Runs on the run's loop; idempotent (a second caller waits for the first).
        ``void``: what was taken and not yet released can no longer be (all but take()'s
        own ending, which hands the consumer the units before it)."""
        self._void = self._void or void
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
        self.ready.put_nowait(_WAKE)
        pending: list[asyncio.Future[Any]] = [t for t in self.units if not t.done()]
        if self._producer is not None and not self._producer.done():
            pending.append(self._producer)
        if self.grouper is not None:
            pending.extend(self.grouper.stop())
        pending.extend(self.dispatcher.stop())
        for t in pending:
            t.cancel()
        try:
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
        finally:
            for t in self.units:  # results nobody will take: retrieve them quietly
                if t.done() and not t.cancelled():
                    t.exception()
                self.cfg.recorder.released()
            self.units.clear()
            self.aside.clear()
            if self.fetcher is not None:
                await self.fetcher.aclose()
            await self.source.aclose()

    def close_threadsafe(self) -> cf.Future[None] | None:
        """Start :meth:`aclose` on the run's own loop from any thread or loop.

        Returns a future to wait on, or ``None`` when there is nothing to wait for: on
        the run's own loop (a task was started; a loop cannot wait for itself), or when
        that loop no longer runs (its own shutdown cancels what is left).
        """
        self._void = True  # at once, not when the loop gets to it
        loop = self.loop
        if loop.is_closed():
            self._abandoned()
            return None
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            loop.create_task(self.aclose())
            return None
        if not loop.is_running():
            return None
        done: cf.Future[None] = cf.Future()
        try:
            loop.call_soon_threadsafe(self._close_on_loop, done)
        except RuntimeError:  # the loop closed in between
            return None
        return done

    def _close_on_loop(self, done: cf.Future[None]) -> None:
        """:meth:`close_threadsafe`'s callback, on the run's loop: ``done`` is set once
        the run is closed.

        The coroutine is made here, not in the caller's thread: a loop that closes
        before it gets here drops a plain callback, and no coroutine is left never
        awaited. A task made while ``asyncio.run`` shuts its loop down could be destroyed
        pending. So none is made for a run that its consumer already closed, or whose
        tasks the loop's owner cancelled.
        """
        closing: asyncio.Future[None] | None = self._close_done
        if closing is None and self._cut:  # the loop is ending, its tasks are cancelled
            self._abandoned()
            done.set_result(None)
            return
        if closing is None:
            closing = self.loop.create_task(self.aclose())
        if closing.done():
            done.set_result(None)
        else:
            closing.add_done_callback(lambda _: done.set_result(None))

    def _abandoned(self) -> None:
        """The run's loop closed under it (``asyncio.run`` ended while the run had gone
        on into the next epoch): its units will never be taken; stop counting them."""
        if self._close_done is None and not self.closed:
            self.closed = True
            for _ in self.units:
                self.cfg.recorder.released()
            self.units.clear()
            self.aside.clear()

    async def aclose_from_any_loop(self) -> None:
        """:meth:`aclose` from a coroutine on whichever loop is running."""
        if asyncio.get_running_loop() is self.loop:
            await self.aclose()
            return
        fut = self.close_threadsafe()
        if fut is not None:
            try:
                await asyncio.wrap_future(fut)
            except Exception:  # the run's loop went away while closing it
                pass

    def close_and_wait(self, timeout: float = 10.0) -> None:
        """:meth:`aclose` from plain code (any thread), waiting up to ``timeout``."""
        fut = self.close_threadsafe()
        if fut is None:
            return
        deadline = time.monotonic() + timeout
        # In slices: a loop that closes first drops the callback, and fut never ends.
        while not self.loop.is_closed() and time.monotonic() < deadline:
            try:
                fut.result(_CLOSE_SLICE)
                return
            except cf.TimeoutError:
                continue
            except (cf.CancelledError, RuntimeError):
                return
        if self.loop.is_closed():
            self._abandoned()

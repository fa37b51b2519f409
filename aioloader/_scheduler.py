"""The async core: one epoch of batches through a bounded in-flight window.

An :class:`EpochRun` lives on one event loop. A producer task acquires a slot of the
semaphore, then starts a *fetch* task for the next batch; the consumer takes finished
fetches in order (or as they complete) and releases the slot when it takes the batch,
not when the worker finishes it. So batches submitted, running, or done but not yet
taken never exceed ``prefetch``.

A fetch task owns one batch from submission to result: it resubmits after a worker
crash (charging the batch only when it was the one running on the dead worker), sends
the dataset along when a borrowed executor's worker has not seen it yet, and turns a
watchdog verdict into :class:`~aioloader.LoaderTimeout`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _worker
from ._dispatch import Dispatcher, cancelling
from ._pool import WorkerPool
from ._stats import Recorder, _Epoch
from .errors import LoaderClosedError, TooManySkippedError

__all__ = ["EpochRun", "RunConfig"]

@dataclass
class RunConfig:
    """What an epoch run needs from its loader."""

    token: str
    pool: WorkerPool
    payload: Callable[[], bytes | None]
    seed: int
    prefetch: int
    ordered: bool
    timeout: float | None
    max_retries: int
    max_skipped: int | None
    decode: Callable[[Any], Any] | None
    recorder: Recorder
    is_closed: Callable[[], bool]


class EpochRun:
    """One epoch (or the rest of one) for one iterator, on the running event loop.

    ``positions`` are the batch positions to deliver, in plan order.
    """

    def __init__(
        self,
        cfg: RunConfig,
        epoch: int,
        batches: Sequence[Any],
        positions: Sequence[int],
        *,
        sem: asyncio.Semaphore | None = None,
    ) -> None:
        self.cfg = cfg
        self.epoch = epoch
        self.batches = batches
        self.positions = positions
        self.loop = asyncio.get_running_loop()
        self.sem = sem if sem is not None else asyncio.Semaphore(cfg.prefetch)
        self.ready: asyncio.Queue[asyncio.Task[Any]] = asyncio.Queue()
        self.tasks: set[asyncio.Task[Any]] = set()
        self.taken = 0
        self.delivered: list[int] = []  # positions handed to the consumer, in order taken
        self.skipped: list[tuple[int, str]] = []
        self.closed = False
        self.finished = False
        self.submitted_all = False
        self.dispatcher = Dispatcher(cfg.pool, cfg.recorder, cfg.timeout, cfg.max_retries, cfg.is_closed)
        self._epoch_rec: _Epoch | None = None
        self._producer: asyncio.Task[None] | None = None
        self._closed_event: asyncio.Event | None = None
        self.on_submitted_all: Callable[[EpochRun], None] | None = None

    # ----------------------------------------------------------------- lifecycle
    def start(self) -> None:
        if self._producer is None:
            self._producer = self.loop.create_task(self._produce())

    @property
    def complete(self) -> bool:
        """Has the consumer taken every batch of this run?"""
        return self.taken >= len(self.positions)

    def begin_consuming(self) -> None:
        """Mark the moment the consumer started this epoch (for stall statistics)."""
        if self._epoch_rec is None:
            self._epoch_rec = self.cfg.recorder.epoch_started(self.epoch)

    async def aclose(self) -> None:
        """Cancel everything still pending and wait until it has stopped. Idempotent: a
        second caller waits for the first one's close to finish."""
        if self.closed:
            if self._closed_event is not None and asyncio.get_running_loop() is self.loop:
                await self._closed_event.wait()
            return
        self.closed = True
        self._closed_event = asyncio.Event()
        try:
            await self._aclose()
        finally:
            self._closed_event.set()

    async def _aclose(self) -> None:
        self.ready.put_nowait(_CLOSED)  # wakes a consumer waiting for the next batch
        pending: list[asyncio.Task[Any]] = [t for t in self.tasks if not t.done()]
        if self._producer is not None and not self._producer.done():
            pending.append(self._producer)
        pending.extend(self.dispatcher.stop())
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        # Retrieve results nobody will take, so asyncio does not warn about them.
        for t in self.tasks:
            if t.done() and not t.cancelled():
                t.exception()
        for _ in range(len(self.tasks)):  # batches submitted but never taken
            self.cfg.recorder.released()
        self.tasks.clear()

    # ------------------------------------------------------------------ producer
    async def _produce(self) -> None:
        ordered = self.cfg.ordered
        for pos in self.positions:
            await self.sem.acquire()
            if self.closed:
                self.sem.release()
                return
            t = self.loop.create_task(self._fetch(pos, self.batches[pos]))
            self.tasks.add(t)
            self.cfg.recorder.submitted(time.monotonic_ns())
            if ordered:
                self.ready.put_nowait(t)
            else:
                t.add_done_callback(self.ready.put_nowait)
        self.submitted_all = True
        if self.on_submitted_all is not None:
            self.on_submitted_all(self)

    # -------------------------------------------------------------------- fetch
    async def _fetch(self, pos: int, indices: Any) -> tuple[int, _worker.BatchResult]:
        cfg = self.cfg

        # Raw int64 bytes pickle ~5x faster than a numpy array (it runs for every batch).
        packed = np.asarray(indices, dtype=np.int64).tobytes()

        def make_task(task_id: int, with_payload: bool) -> _worker.BatchTask:
            return _worker.BatchTask(
                cfg.token,
                task_id,
                self.epoch,
                pos,
                packed,
                cfg.seed,
                cfg.payload() if with_payload else None,
            )

        res = await self.dispatcher.run(
            _worker.run_batch, make_task, indices, f"batch {pos} of epoch {self.epoch}"
        )
        return pos, res

    # ----------------------------------------------------------------- consumer
    async def next_batch(self) -> Any:
        """The next batch, or ``StopAsyncIteration`` at the end of the epoch."""
        cfg = self.cfg
        while True:
            if self.closed:
                if cfg.is_closed():
                    raise LoaderClosedError("the loader was closed while it was being iterated")
                raise StopAsyncIteration
            if self.taken >= len(self.positions):
                self.finished = True
                raise StopAsyncIteration
            self.begin_consuming()
            t0 = time.monotonic_ns()
            t: Any = None
            try:
                t = await self.ready.get()
                if t is _CLOSED:
                    t = None
                    continue  # the loop head reports how the run ended
                pos, res = await t
            except asyncio.CancelledError:
                if t is not None:
                    self._take(t)
                await self.aclose()
                if cfg.is_closed() and not cancelling():
                    raise LoaderClosedError("the loader was closed while it was being iterated") from None
                raise
            except Exception as exc:
                if t is not None:
                    self._take(t)
                await self.aclose()
                self._add_context(exc)
                raise
            self._take(t)
            now = time.monotonic_ns()
            self.delivered.append(pos)
            if res.skipped:
                self.skipped.extend(res.skipped)
                cfg.recorder.skipped += len(res.skipped)
                if cfg.max_skipped is not None and len(self.skipped) > cfg.max_skipped:
                    await self.aclose()
                    raise TooManySkippedError(
                        f"on_error='skip' dropped {len(self.skipped)} samples in epoch {self.epoch}, "
                        f"more than max_skipped={cfg.max_skipped}; first: index "
                        f"{self.skipped[0][0]} ({self.skipped[0][1]})",
                        skipped=list(self.skipped),
                    )
            if res.data is None:  # every sample of the batch was skipped
                continue
            n = len(self.batches[pos]) - len(res.skipped)
            assert self._epoch_rec is not None
            cfg.recorder.delivered(self._epoch_rec, n, now - t0, now)
            data = res.data
            if cfg.decode is not None:
                data = cfg.decode(data)
            return data

    def _take(self, t: asyncio.Task[Any]) -> None:
        # The slot frees when the consumer takes the batch, not when the worker ends it.
        self.taken += 1
        self.tasks.discard(t)
        self.sem.release()
        self.cfg.recorder.released()

    def _add_context(self, exc: BaseException) -> None:
        if isinstance(exc, (LoaderClosedError,)):
            return
        if getattr(exc, "__notes__", None) and any("aioloader:" in n for n in exc.__notes__):
            return
        with contextlib.suppress(Exception):
            exc.add_note(f"aioloader: raised while loading epoch {self.epoch}")


class _Closed:
    def __repr__(self) -> str:
        return "<run closed>"


_CLOSED: Any = _Closed()

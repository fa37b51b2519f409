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
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _worker
from ._pool import Generation, WorkerPool
from ._stats import Recorder, _Epoch
from .errors import LoaderClosedError, LoaderTimeout, TooManySkippedError, WorkerCrashedError

__all__ = ["Dispatcher", "EpochRun", "RunConfig"]

_task_ids = itertools.count(1)


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


class Dispatcher:
    """Runs tasks on a pool until they succeed, fail in user code, or exhaust retries.

    Shared by epoch runs and streams. Owns the timeout watchdog of the tasks it runs.
    A task object must have a ``task_id`` attribute; ``make_task(task_id, with_payload)``
    builds a fresh one for every (re)submission.
    """

    def __init__(
        self,
        pool: WorkerPool,
        recorder: Recorder,
        timeout: float | None,
        max_retries: int,
        is_closed: Callable[[], bool],
    ) -> None:
        self.pool = pool
        self.recorder = recorder
        self.timeout = timeout
        self.max_retries = max_retries
        self.is_closed = is_closed
        self.stopping = False
        self._running: dict[int, tuple[Generation, asyncio.Future[Any], int]] = {}
        self._timed_out: set[int] = set()
        self._watchdog: asyncio.Task[None] | None = None

    def stop(self) -> list[asyncio.Task[None]]:
        """Mark the dispatcher as stopping; returns the watchdog task to cancel and await."""
        self.stopping = True
        w = self._watchdog
        self._watchdog = None
        return [w] if w is not None and not w.done() else []

    async def run(
        self,
        fn: Callable[[Any], Any],
        make_task: Callable[[int, bool], Any],
        indices: Any,
        label: str,
    ) -> Any:
        """Submit ``fn(make_task(task_id, with_payload))`` and return its result.

        ``label`` names the work in error messages ("batch 3 of epoch 0").
        """
        loop = asyncio.get_running_loop()
        pool = self.pool
        if self.timeout is not None and self._watchdog is None and not self.stopping:
            self._watchdog = loop.create_task(self._watch(self.timeout))
        attempts = 0
        with_payload = False
        while True:
            if self.is_closed():
                raise LoaderClosedError("the loader was closed while this batch was pending")
            gen = pool.started_generation()
            if gen is None:
                try:
                    gen = await loop.run_in_executor(None, pool.start)
                except RuntimeError as exc:  # the pool was shut down under us
                    if self.is_closed() or pool.closed:
                        raise LoaderClosedError("the loader was closed while this batch was pending") from exc
                    raise
            task = make_task(next(_task_ids), with_payload)
            task_id = task.task_id
            submit_ns = time.monotonic_ns()
            try:
                cfut = pool.submit(gen, fn, task)
                fut = asyncio.wrap_future(cfut, loop=loop)
                self._running[task_id] = (gen, fut, submit_ns)
                try:
                    res = await fut
                finally:
                    self._running.pop(task_id, None)
            except asyncio.CancelledError:
                if self.stopping or self.is_closed() or cancelling():
                    raise  # this task itself is being cancelled
                if task_id in self._timed_out:
                    raise self._timeout_error(label, indices) from None
                continue  # an abandoned thread generation cancelled it: run it again
            except Exception as exc:
                if self.is_closed():
                    raise LoaderClosedError("the loader was closed while this batch was pending") from exc
                if not pool.is_crash(exc):
                    raise
                info = await loop.run_in_executor(None, pool.recover, gen)
                if task_id in self._timed_out:
                    raise self._timeout_error(label, indices) from None
                if not info.known or task_id in info.culprits:
                    attempts += 1
                    if attempts > self.max_retries:
                        code = info.culprits.get(task_id)
                        if code is not None:
                            how = f"exit code {_describe_code(code)}"
                        else:
                            codes = sorted({_describe_code(c) for c in info.exitcodes.values() if c is not None})
                            how = (
                                f"the culprit could not be told apart; dead workers' exit codes: {codes or 'unknown'}."
                                " Workers that die before running any task usually cannot import the main"
                                " module or the dataset's module (run from a file, not stdin; guard the"
                                " entry point with if __name__ == '__main__')"
                            )
                        raise WorkerCrashedError(
                            f"{label} (sample indices {_short(indices)}) was lost to a dying worker "
                            f"{attempts} times ({how}); max_retries={self.max_retries}",
                            indices=_as_list(indices),
                            exitcode=code,
                            attempts=attempts,
                        ) from exc
                self.recorder.retries += 1
                continue
            if isinstance(res, str) and res == _worker.NEED_PAYLOAD:
                with_payload = True
                self.recorder.retries += 1
                continue
            self.recorder.finished(res.pid, res.start_ns, res.end_ns, submit_ns, time.monotonic_ns(), label)
            return res

    def _timeout_error(self, label: str, indices: Any) -> LoaderTimeout:
        t = self.timeout
        how = {
            "process": "the worker was killed and the pool rebuilt",
            "thread": "the stuck thread was abandoned (it ends when its sample returns)",
        }.get(self.pool.kind, "the borrowed executor's task could not be stopped")
        return LoaderTimeout(
            f"{label} (sample indices {_short(indices)}) was not delivered within timeout={t} s "
            f"of a worker starting it; {how}",
            indices=_as_list(indices),
            timeout=t,
        )

    async def _watch(self, timeout: float) -> None:
        pool = self.pool
        loop = asyncio.get_running_loop()
        period = min(0.05, timeout / 4)
        limit = int(timeout * 1e9)
        while True:
            await asyncio.sleep(period)
            now = time.monotonic_ns()
            for task_id, (gen, fut, submit_ns) in list(self._running.items()):
                if task_id in self._timed_out:
                    continue
                if pool.kind == "process":
                    started = gen.running_tasks().get(task_id, (0, 0))[1]
                elif pool.kind == "thread":
                    started = _worker.thread_starts.get(task_id, 0)
                else:
                    started = submit_ns
                if not started or now - started <= limit:
                    continue
                self._timed_out.add(task_id)
                if pool.kind == "process":
                    if not await loop.run_in_executor(None, pool.kill_task, gen, task_id):
                        # it finished between our look and the kill: not a timeout
                        self._timed_out.discard(task_id)
                else:
                    if pool.kind == "thread":
                        pool.abandon(gen)
                    fut.cancel()


class _Closed:
    def __repr__(self) -> str:
        return "<run closed>"


_CLOSED: Any = _Closed()


def cancelling() -> bool:
    """Is the current task itself being cancelled (as opposed to something it awaited)?"""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)
    return bool(cancelling()) if cancelling is not None else True


def _as_list(indices: Any) -> list[int]:
    return [int(i) for i in indices]


def _short(indices: Any, limit: int = 16) -> str:
    ids = _as_list(indices)
    if len(ids) <= limit:
        return str(ids)
    return f"{ids[:limit]}... ({len(ids)} samples)"


def _describe_code(code: int | None) -> str:
    if code is None:
        return "unknown"
    if code < 0:
        import signal

        try:
            return f"{code}, killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"{code}, killed by signal {-code}"
    return str(code)

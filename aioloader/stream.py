"""``StreamLoader``: batches from a stream of unknown length, with a latency bound.

Data flow, one iteration::

    source ──(feed: lazy, credit-gated)──▶ batcher ──(one unit per micro-batch)──▶ pool
                                           │ size / deadline rule          fn + collate_fn
    consumer ◀──(ready queue, in order or as completed)──◀─────────────────────┘

The feed (:mod:`aioloader._engine.feeds`) takes items from the source only against
credits; the batcher (:mod:`aioloader._engine.batcher`) is the run's unit source, so the
window, crash recovery, retries and timeouts are the DataLoader's own engine
(:mod:`aioloader._engine.run`). One micro-batch is one pool task: the items travel with
it, the worker applies ``fn`` and ``collate_fn``, and only the collated batch comes back.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import os
import threading
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable, Iterator, Sequence
from multiprocessing.context import BaseContext
from typing import Any, ClassVar, Generic, Literal

from ._collate import default_collate
from ._engine.batcher import Batcher
from ._engine.epochs import WorkerSide
from ._engine.feeds import END, _EndOfStream, make_feed
from ._engine.fetch import DEFAULT_IO_BUFFER, FetchConfig, resolve_remote
from ._engine.run import Run
from ._engine.units import Delivery, RunConfig
from ._facade import IterableLoader
from ._pool import WorkerPool
from ._stats import Recorder
from ._types import Batch, StreamSource
from ._validate import check_bool, check_choice, check_int, check_seconds
from ._worker import tasks as _tasks
from ._worker.stream import Chain, StreamContext

__all__ = ["END", "StreamLoader"]


class StreamLoader(IterableLoader, Generic[Batch]):
    """Batches from an (async) iterable or an ``asyncio.Queue``, built by a worker pool.

    ``async for batch in stream`` runs on the caller's event loop and never blocks it;
    ``for batch in stream`` runs the same machinery on a private loop in a background
    thread.

    Args:
        source: a synchronous iterable, an async iterable (async generator included), or
            an ``asyncio.Queue`` fed by other tasks. A queue ends when :data:`END`
            (``StreamLoader.END``) is taken from it, or when it is shut down
            (``queue.shutdown()``, Python 3.13+); the stream calls ``task_done()`` for
            every item it takes. A queue can only be consumed with ``async for`` on the
            loop that feeds it. Sources may be infinite.
        fn: applied in the pool to each item (``fn(item)``), or to the list of a
            micro-batch's items with ``batched_fn=True``. ``None``: items are collated
            as they are. With workers it must pickle (lambdas and closures do, by value).
        batch_size: most items in a batch.
        max_latency: emit a partial batch once this many seconds have passed since it
            received its first item. ``None``: wait for full batches. Either way the last
            partial batch is emitted when the source ends. ``0`` takes what is already
            waiting (in a queue, a collection, or pulled ahead) and never waits.
        batched_fn: call ``fn(items)`` once per micro-batch; it returns what
            ``collate_fn`` receives (for the default, a list of per-item results).
        collate_fn: turns the list of ``fn`` results into a batch, in the worker;
            default :func:`~aioloader.default_collate`.
        num_workers: worker processes; ``0`` runs ``fn`` in one background thread;
            ``"auto"``: as many as the CPUs this process may use (see ``DataLoader``).
        prefetch: micro-batches open at once: being assembled, submitted, running, or
            done and waiting for the consumer (default ``2 * num_workers``, at least 2).
            At most ``prefetch * batch_size`` items are taken from the source and not
            yet delivered.
        ordered: deliver batches in source order (``True``) or as they complete.
        on_error: ``"raise"`` the first exception from ``fn`` (the stream stops), or
            ``"skip"`` failing items (with ``batched_fn``, the whole micro-batch);
            counted in ``stats().skipped``.
        max_retries: resubmissions of a task whose worker died while running it. A
            micro-batch of several items is not resubmitted whole: its items run again
            one a task, each with this many retries (see :doc:`streaming`).
        timeout: seconds a micro-batch may take from the moment it is due (its worker
            could start it: sent to an idle worker, or the task ahead of it answered); on
            expiry the worker is killed and replaced, and the items run again one a task;
            one that overruns alone raises :class:`~aioloader.LoaderTimeout`.
        mp_context: start method name or context (default ``forkserver``, else ``spawn``).
        pool: a :class:`~aioloader.WorkerPool` shared with other loaders (never closed
            by the stream).
        executor: any ``concurrent.futures.Executor`` (never shut down by the stream).
        trace: write a Chrome trace-event file here when the stream closes (see
            :meth:`tracing` to trace a part of a run).
        fetch: an async callable applied to each item on the event loop (many at once)
            before its micro-batch goes to a worker; the worker then gets the fetched
            values, which must pickle. See :doc:`fetch`.
        transform: applied in the worker to each item (the fetched value, without
            ``fetch`` the item itself) before ``fn``.
        io_concurrency: most fetches running at once.
        io_buffer: bytes fetched and not yet handed to a worker at most (the oldest
            micro-batch waiting is always let through).
        fetch_retries: retries of a fetch that failed transiently (connection errors,
            timeouts, HTTP 5xx/429), with exponential backoff; ``timeout`` bounds each try.
        fetch_timeout: seconds one sample's fetch may take in all, every try and the
            waits between them together (default 60; ``None``: no bound). A fetch still
            unanswered then fails with its last error, or with
            :class:`~aioloader.LoaderTimeout` if no try has ended.

    Guarantees and errors: exceptions from ``fn``/``collate_fn`` keep their type and
    gain a note with the item's source position (:class:`~aioloader.RemoteError` if
    they do not pickle); an exception raised by the source itself is raised after the
    batches of the items taken before it. :class:`~aioloader.WorkerCrashedError` names
    the one item that killed its worker ``max_retries + 1`` times when run alone (with
    ``on_error="skip"`` it is skipped, and the rest of its micro-batch is delivered as one
    batch); :class:`~aioloader.LoaderClosedError` when iterating a
    closed stream; :class:`~aioloader.DatasetPickleError` at construction when ``fn``
    or ``collate_fn`` cannot reach the workers.

    One iteration at a time: starting a new iteration closes a previous one that is
    still open. Each iteration calls ``iter()``/``aiter()`` on the source again, so a
    list is read from the start while a generator continues (or is already closed).
    Leaving an iteration early (``break``, an exception, cancellation) cancels pending
    work and closes the source's iterator when it is a generator or has ``aclose()``;
    after ``async for ... break`` that happens when the event loop finalizes the
    abandoned iterator (use ``async with stream`` or :meth:`aclose` to do it at a known
    point).
    """

    _kind = "StreamLoader"
    _portal_name = "aioloader-stream-portal"

    END: ClassVar[_EndOfStream] = END

    def __init__(
        self,
        source: StreamSource,
        fn: Callable[[Any], Any] | None = None,
        *,
        batch_size: int = 32,
        max_latency: float | None = None,
        batched_fn: bool = False,
        collate_fn: Callable[[Any], Any] | None = None,
        num_workers: int | Literal["auto"] = 0,
        prefetch: int | Literal["auto"] | None = None,
        ordered: bool = True,
        on_error: Literal["raise", "skip"] = "raise",
        max_retries: int = 2,
        timeout: float | None = None,
        mp_context: str | BaseContext | None = None,
        pool: WorkerPool | None = None,
        executor: cf.Executor | None = None,
        trace: str | os.PathLike[str] | None = None,
        fetch: Callable[[Any], Awaitable[Any]] | None = None,
        transform: Callable[[Any], Any] | None = None,
        io_concurrency: int = 64,
        io_buffer: int = DEFAULT_IO_BUFFER,
        fetch_retries: int = 3,
        fetch_timeout: float | None = 60.0,
    ) -> None:
        if not isinstance(source, (asyncio.Queue, AsyncIterable, Iterable)):
            raise TypeError(
                "source must be an iterable, an async iterable or an asyncio.Queue, "
                f"got {type(source).__name__}"
            )
        if fn is not None and not callable(fn):
            raise TypeError(f"fn must be callable or None, got {fn!r}")
        if collate_fn is not None and not callable(collate_fn):
            raise TypeError(f"collate_fn must be callable or None, got {collate_fn!r}")
        batched_fn = check_bool("batched_fn", batched_fn)
        ordered = check_bool("ordered", ordered)
        if batched_fn and fn is None:
            raise ValueError("batched_fn=True needs an fn")
        batch_size = check_int("batch_size", batch_size, 1)
        max_latency = check_seconds("max_latency", max_latency, allow_zero=True)
        timeout = check_seconds("timeout", timeout, allow_zero=False)
        check_choice("on_error", on_error, ("raise", "skip"))
        max_retries = check_int("max_retries", max_retries, 0)
        self._fetch = FetchConfig.make(
            fetch, io_concurrency, io_buffer, fetch_retries, timeout, on_error, fetch_timeout
        )
        _, _, transform = resolve_remote(None, None, transform)  # validates it
        self.fetch = fetch
        self.transform = transform

        self.source = source
        self.fn = fn
        self.batch_size = batch_size
        self.max_latency = max_latency
        self.batched_fn = batched_fn
        self.collate_fn: Callable[[Any], Any] = collate_fn if collate_fn is not None else default_collate
        self.ordered = ordered
        self.on_error: Literal["raise", "skip"] = on_error
        self.max_retries = max_retries
        self.timeout = timeout
        self._setup(
            num_workers=num_workers, mp_context=mp_context, pool=pool, executor=executor,
            prefetch=prefetch, transport="pickle", trace=trace,
        )  # fmt: skip
        self._inline_ctx: StreamContext | None = None
        self._active: Run | None = None
        self._iterations = 0
        # The consumer thread of the open iteration, as a ticket its pass clears at its end.
        self._consumer: list[tuple[int, int] | None] = [None]
        self._prepare_now()

    # -------------------------------------------------------------------- payload
    def _worker_context(self) -> StreamContext:
        return StreamContext(
            dataset=None,
            collate_fn=self.collate_fn,
            on_error=self.on_error,
            seed_samples=False,
            fn=self.fn if self.transform is None else Chain(self.transform, self.fn, self.batched_fn),
            batched_fn=self.batched_fn,
        )

    def _pickled_parts(self) -> Sequence[tuple[str, object]]:
        return (("fn", self.fn), ("transform", self.transform), ("collate_fn", self.collate_fn))

    def _install_inline(self, ctx: _tasks.WorkerContext) -> None:
        assert isinstance(ctx, StreamContext)
        self._inline_ctx = ctx  # rides along with every task: nothing is pickled

    def _forget_runs(self) -> None:
        self._active = None

    # ------------------------------------------------------------------ iteration
    def _claim(self) -> None:
        """One consumer thread at a time. A new iteration in the same thread takes over
        the open one (it ends); from another thread, while that one's consumer thread
        lives, it raises: a stream has one consumer, and two would each lose items."""
        me = threading.get_ident()
        with self._lock:
            held = self._consumer[0]
            if held is not None and held[0] != me and any(t.ident == held[0] for t in threading.enumerate()):
                raise RuntimeError(
                    f"this StreamLoader is being iterated in another thread (ident {held[0]}); "
                    "a stream has one consumer at a time: finish or close that iteration first, "
                    "or give each thread a StreamLoader of its own"
                )
            self._consumer[0] = (me, self._iterations)

    async def _begin(self) -> _StreamPass:
        with self._lock:
            self._check_open()
            prev, self._active = self._active, None
        if prev is not None:  # one iteration at a time (a run that ended is voided too:
            await prev.aclose_from_any_loop()  # its consumer may hold batches taken ahead)
        with self._lock:
            self._check_open()
            side = WorkerSide(self._token, 0, self._shared.get_payload, self._inline_ctx)
            feed = make_feed(self.source)
            run = Run(
                self._run_config(),
                Batcher(
                    side, feed, self._iterations, self.batch_size, self.max_latency, self.on_error == "skip"
                ),
            )
            ticket = self._consumer[0]
            p = _StreamPass(self._recorder, run, self._iterations, self._consumer, ticket)
            self._iterations += 1
            self._active = run
            self._runs.add(run)
        run.start()
        return p

    def _run_config(self) -> RunConfig:
        # a lost micro-batch runs again one item a task, so that only the culprit fails
        return self._config(ordered=self.ordered, fetch=self._fetch, isolate=True)

    def __aiter__(self) -> AsyncIterator[Batch]:
        return super().__aiter__()

    def __iter__(self) -> Iterator[Batch]:
        if isinstance(self.source, asyncio.Queue):
            raise TypeError(
                "an asyncio.Queue source belongs to the event loop that feeds it: iterate "
                "with `async for` on that loop"
            )
        return super().__iter__()

    def __repr__(self) -> str:
        return (
            f"<aioloader.StreamLoader batch_size={self.batch_size} max_latency={self.max_latency} "
            f"num_workers={self.num_workers} prefetch={self.prefetch} {self._state.value}>"
        )


class _StreamPass:
    """One consumer's pass over the stream (see :class:`~aioloader._facade.Pass`)."""

    def __init__(
        self,
        recorder: Recorder,
        run: Run,
        iteration: int,
        consumer: list[tuple[int, int] | None],
        ticket: tuple[int, int] | None,
    ) -> None:
        self.recorder = recorder
        self.run = run
        self.rec = recorder.epoch_started(iteration)
        self.consumer = consumer  # the stream's box of the open iteration's consumer
        self.ticket = ticket

    async def take(self) -> Delivery:
        return await self.run.take()

    def accept(self, d: Delivery, waited_ns: int | None = None) -> Any:
        self.run.release(d, self.rec, waited_ns)
        if d.skipped:  # counted, not kept: an infinite stream must not grow a list
            self.recorder.skipped += len(d.skipped)
        return d.data

    async def finish(self) -> None:
        if self.ticket is not None and self.consumer[0] is self.ticket:
            self.consumer[0] = None  # (a list item set: atomic; a later claim replaced it otherwise)
        await self.run.aclose()

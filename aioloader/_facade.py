"""What both loader facades share: the lifecycle, the pool they own or borrow, the
payload the workers need, one finalizer and one close path, and the two faces.

Lifecycle (:class:`Lifecycle`)::

    NEW ──(first iteration, or construction for a StreamLoader: payload sent)──▶ OPEN
     └──────────────────────────(close / aclose / GC)────────────────────────────┴──▶ CLOSED

Iterating or loading state into a CLOSED loader raises
:class:`~aioloader.LoaderClosedError`; a consumer that is mid-iteration when the loader
closes gets the same error from its next batch.

The faces: a facade defines ``_begin()``, a coroutine returning a *pass* (one consumer's
iteration, :class:`Pass`). ``async for`` drives it on the caller's loop; ``for`` drives
the same coroutines on the private portal loop, where a :class:`~aioloader._portal.Feed`
takes batches ahead and the iterating thread accepts them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import enum
import os
import threading
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Iterator, Sequence
from multiprocessing.context import BaseContext
from typing import Any, ClassVar, Protocol, TypeVar

from . import _mainguard
from ._cpus import available_cpus
from ._engine.run import Run
from ._engine.units import Delivery, Failed, RunConfig, closed_while_iterating
from ._goes_on import GoesOn
from ._payload import pickle_for_workers
from ._pool import WorkerPool
from ._portal import END, Feed, Portal
from ._shm import _dataseg
from ._shm._dataseg import DataSegment
from ._stats import LoaderStats, Recorder
from ._trace import Tracer
from ._transport import Transport, TransportKind, make_transport
from ._validate import check_choice, check_int, check_num_workers
from ._worker import tasks as _tasks
from .errors import LoaderClosedError

__all__ = ["IterableLoader", "Lifecycle", "LoaderBase", "Pass"]


class Lifecycle(enum.Enum):
    NEW = "new"  # constructed: no worker has seen this loader yet
    OPEN = "open"  # its worker context is with the pool
    CLOSED = "closed"


class Pass(Protocol):
    """One consumer's iteration (an epoch, or one pass over a stream).

    ``await take()`` (on the run's loop) gives the next delivery, its window slot still
    held, or raises ``StopAsyncIteration``; ``accept(d, waited_ns)`` (from the consumer's
    thread, whichever it is) is the consumer taking it: the position that
    ``state_dict()`` reports moves on, the slot frees, and the batch comes back (``None``
    when every sample of it was skipped: nothing to yield). A run closed under the pass
    after it took ``d`` voids it: ``accept`` raises ``StopAsyncIteration`` (or
    :class:`~aioloader.LoaderClosedError`, the loader closed). ``await finish()`` ends
    the pass early or late.
    """

    async def take(self) -> Delivery: ...

    def accept(self, d: Delivery, waited_ns: int | None = None) -> Any: ...

    async def finish(self) -> None: ...


class Shared:
    """What runs and units share with their facade. They hold this, never the facade,
    so a loader dropped while work is pending is collected at once (and its finalizer
    shuts everything down)."""

    def __init__(self) -> None:
        self.closed = False
        self.payload: bytes | None = None
        self.segment: DataSegment | None = None  # the payload's large arrays, if shared

    def is_closed(self) -> bool:
        return self.closed

    def get_payload(self) -> bytes | None:
        return self.payload


async def _close_feed_and_finish(feed: Feed[Delivery], p: Pass) -> None:
    await feed.aclose()
    await p.finish()


L = TypeVar("L", bound="LoaderBase")


class LoaderBase:
    """The shared half of :class:`~aioloader.DataLoader` and :class:`~aioloader.StreamLoader`."""

    _kind: ClassVar[str] = "loader"
    _portal_name: ClassVar[str] = "aioloader-portal"
    timeout: float | None  # set by each face before its first run
    max_retries: int

    def _setup(
        self,
        *,
        num_workers: Any,
        mp_context: str | BaseContext | None,
        pool: WorkerPool | None,
        executor: cf.Executor | None,
        prefetch: Any,
        transport: TransportKind,
        trace: str | os.PathLike[str] | None,
    ) -> None:
        """Validate the pool arguments and set up everything the lifecycle needs."""
        settings: list[str] = []
        if isinstance(num_workers, str) and num_workers == "auto":
            num_workers, why = available_cpus()
            settings.append(f"num_workers='auto' chose {num_workers}: {why}")
        num_workers = check_num_workers(num_workers)
        auto_prefetch = isinstance(prefetch, str) and prefetch == "auto"
        # Not given, or "auto": a DataLoader's window may grow while its batches are
        # cheap (the grouping policy decides, within a bound in batches and in bytes).
        self._window_grows = prefetch is None or auto_prefetch
        if not self._window_grows:
            prefetch = check_int("prefetch", prefetch, 1)
        check_choice("transport", transport, ("auto", "shm", "pickle"))
        if pool is not None and not isinstance(pool, WorkerPool):
            raise TypeError(f"pool must be an aioloader.WorkerPool, got {pool!r}")
        if pool is not None and executor is not None:
            raise ValueError("pass at most one of pool= and executor=")
        if (pool is not None or executor is not None) and (num_workers or mp_context is not None):
            raise ValueError(
                f"num_workers and mp_context configure the {self._kind}'s own pool; "
                "they conflict with pool= or executor="
            )
        if pool is not None:
            self._pool, owns_pool = pool, False
        elif executor is not None:
            self._pool, owns_pool = WorkerPool(executor=executor), False
        else:
            self._pool, owns_pool = WorkerPool(num_workers, mp_context=mp_context), True
        self.num_workers: int = num_workers
        if self._window_grows:
            prefetch = max(2, 2 * self._pool.concurrency)
        if auto_prefetch:
            settings.append(
                f"prefetch='auto' starts at {prefetch}: 2 a worker, at least 2 "
                "(a DataLoader's grows for cheap batches)"
            )
        self.prefetch: int = prefetch
        self._transport: Transport = make_transport(
            transport, pool_kind=self._pool.kind, prefetch=self.prefetch
        )
        self._token = uuid.uuid4().hex
        self._state = Lifecycle.NEW
        self._shared = Shared()
        self._lock = threading.RLock()
        self._runs: weakref.WeakSet[Run] = weakref.WeakSet()
        self._recorder = Recorder(settings=tuple(settings), prefetch=prefetch)
        if trace is not None:
            self._recorder.tracer = Tracer(trace)
        self._portal_box: list[Portal | None] = [None]
        self._finalizer = weakref.finalize(
            self,
            _cleanup,
            self._pool if owns_pool else None,
            self._pool,
            self._token,
            self._portal_box,
            self._transport,
            self._recorder,
            self._shared,
            self._runs,
        )

    # ------------------------------------------------------------------ payload
    def _worker_context(self) -> _tasks.WorkerContext:
        raise NotImplementedError

    def _pickled_parts(self) -> Sequence[tuple[str, object]]:
        raise NotImplementedError

    def _prepare(self) -> None:
        """NEW -> OPEN: hand the worker context to the pool (once; may be slow: the
        dataset is pickled, so the async face calls this in a thread)."""
        with self._lock:
            self._check_open()
            if self._state is Lifecycle.OPEN:
                return
            ctx = self._worker_context()
            if self._pool.kind == "thread":
                self._install_inline(ctx)
            else:
                own = self._pool.kind == "process"
                if own:  # before the payload's shared memory is made
                    _mainguard.refuse_while_main_imports()
                t0 = time.monotonic_ns()
                payload, segment = pickle_for_workers(
                    ctx,
                    self._pickled_parts(),
                    self._kind,
                    share=own and _dataseg.sharing_enabled(),
                    inherit=self._pool.start_method if own else None,
                )
                # An inherited payload reaches workers only as they start (never in a task).
                self._shared.payload = payload if isinstance(payload, bytes) else None
                self._shared.segment = segment
                rec = self._recorder
                rec.payload_ns = time.monotonic_ns() - t0
                rec.payload_bytes = len(payload) if isinstance(payload, bytes) else 0
                rec.shared_bytes = segment.size if segment is not None else 0
                self._pool.register(self._token, payload)
            self._state = Lifecycle.OPEN

    def _config(self, *, ordered: bool, **face: Any) -> RunConfig:
        """What a run of this face takes from it: the pool, the window, retries and
        timeouts, decoding, statistics and the lifecycle, which every face has, and in
        ``face`` what only some have (``fetch``, ``group``, ``fail_fast``)."""
        return RunConfig(
            kind=self._kind, pool=self._pool, prefetch=self.prefetch, ordered=ordered, timeout=self.timeout or None,
            max_retries=self.max_retries, decode=self._transport.decode, recorder=self._recorder,
            is_closed=self._shared.is_closed, **face,
        )  # fmt: skip

    def _prepare_now(self) -> None:
        """:meth:`_prepare` from a constructor (the stream faces: what ``fn`` and
        ``collate_fn`` need must reach the workers, so a bad one fails here, not at the
        first item); a failure frees what :meth:`_setup` made before it propagates."""
        try:
            self._prepare()
        except BaseException:
            self._finalizer()
            raise

    async def _open(self) -> None:
        """Before a pass begins: the loader must not be closed, and is made OPEN (the
        payload pickled off the caller's loop) if it is still NEW."""
        self._check_open()
        if self._state is Lifecycle.NEW:
            await asyncio.get_running_loop().run_in_executor(None, self._prepare_and_start)

    def _prepare_and_start(self) -> None:
        """:meth:`_prepare`, then the pool's workers started from the same thread: they
        take longest to be ready, so they start before the pass builds its plan and
        window. A pool that cannot start is left to the pass's first task, which reports
        it as it would have without this head start."""
        self._prepare()
        with contextlib.suppress(Exception):
            self._pool.start()

    def _install_inline(self, ctx: _tasks.WorkerContext) -> None:
        _tasks.install_context(self._token, ctx)

    # ---------------------------------------------------------------- lifecycle
    @property
    def closed(self) -> bool:
        return self._state is Lifecycle.CLOSED

    def _check_open(self) -> None:
        if self._state is Lifecycle.CLOSED:
            raise LoaderClosedError(f"this {self._kind} is closed; create a new one to iterate again")

    def _mark_closed(self) -> list[Run] | None:
        """Flip to CLOSED (every run sees it at once); ``None`` if it already was."""
        with self._lock:
            if self._state is Lifecycle.CLOSED:
                return None
            self._state = Lifecycle.CLOSED
            self._shared.closed = True
            self._forget_runs()
            return list(self._runs)

    def _forget_runs(self) -> None:
        """Drop references to runs the facade keeps for later (called under the lock)."""

    def close(self) -> None:
        """Stop all iteration, shut down the loader's own pool and threads. Idempotent.

        An iterator still running in another thread or task ends with
        :class:`~aioloader.LoaderClosedError`. A pool or executor passed in is left running.
        """
        runs = self._mark_closed()
        if runs is None:
            return
        for run in runs:
            run.close_and_wait()
        self._finalizer()

    async def aclose(self) -> None:
        """Async twin of :meth:`close`: runs on this loop close here, the rest of the
        teardown (other loops, the pool) runs off the event loop."""
        loop = asyncio.get_running_loop()
        runs = self._mark_closed()
        if runs is None:
            return
        for run in runs:
            if run.loop is loop:
                await run.aclose()
        others = [r for r in runs if r.loop is not loop]

        def teardown() -> None:
            for run in others:
                run.close_and_wait()
            self._finalizer()

        await loop.run_in_executor(None, teardown)

    def __enter__(self: L) -> L:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self: L) -> L:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _portal(self) -> Portal:
        with self._lock:
            self._check_open()
            portal = self._portal_box[0]
            if portal is None:
                portal = self._portal_box[0] = Portal(name=self._portal_name)
            return portal

    # --------------------------------------------------------------------- misc
    @contextlib.contextmanager
    def tracing(self, path: str | os.PathLike[str]) -> Iterator[Tracer]:
        """Record a Chrome trace of what happens inside the ``with`` block; the file is
        written when the block exits."""
        tracer = Tracer(path)
        previous = self._recorder.tracer
        self._recorder.tracer = tracer
        try:
            yield tracer
        finally:
            self._recorder.tracer = previous
            tracer.write()

    @property
    def pool(self) -> WorkerPool:
        return self._pool

    def worker_pids(self) -> list[int]:
        """Pids of the worker processes of the pool's current incarnation."""
        return self._pool.worker_pids()


class IterableLoader(LoaderBase):
    """A loader with the two faces, ``for`` and ``async for`` (see the module docstring)."""

    def stats(self) -> LoaderStats:
        """A frozen snapshot of the statistics (cheap; always on)."""
        return self._recorder.snapshot(self._pool.restarts, self._pool.concurrency)

    async def _begin(self) -> Pass:
        raise NotImplementedError

    def _claim(self) -> None:
        """Called in the consumer's thread as a pass begins: a face that allows one
        consumer thread at a time raises here for another (the stream)."""

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._aiterate()

    async def _aiterate(self) -> AsyncIterator[Any]:
        self._claim()
        p = await self._begin()
        try:
            while True:
                try:
                    batch = p.accept(await p.take())
                except StopAsyncIteration:
                    return
                if type(batch) is Failed:  # the run ends now, not in an aclose at collection
                    raise batch.error  # (asyncio.run may close the loop before that runs)
                if batch is not None:
                    yield batch
        finally:
            await p.finish()

    def __iter__(self) -> Iterator[Any]:
        portal = self._portal()
        if portal.in_portal():
            raise RuntimeError(f"cannot iterate a {self._kind} synchronously from its own event-loop thread")
        return GoesOn(self._iterate(portal))

    def _iterate(self, portal: Portal) -> Iterator[Any]:
        # A generator: the pass begins at the first next(), so an iterator created and
        # dropped unused costs nothing.
        self._claim()
        if self._state is Lifecycle.NEW:  # here, where the thread would only wait: no hop to a thread
            self._prepare_and_start()
        p = portal.call(self._begin())
        # The feed's end is a value, never StopAsyncIteration raised here: its traceback
        # would keep this iteration's frames (and the loader) alive after the epoch.
        feed: Feed[Delivery] = Feed(portal, p.take)
        try:
            while True:
                if self._state is Lifecycle.CLOSED or portal.loop.is_closed():
                    raise closed_while_iterating(self._kind)
                d, waited = feed.get()
                if d is END:
                    return
                try:
                    batch = p.accept(d, waited)
                except StopAsyncIteration:  # the run was closed under this iteration
                    return
                if batch is not None:
                    yield batch
        finally:
            if not portal.loop.is_closed():
                with contextlib.suppress(RuntimeError, cf.TimeoutError, LoaderClosedError):
                    portal.call(_close_feed_and_finish(feed, p), timeout=30.0)


def _cleanup(
    owned_pool: WorkerPool | None,
    pool: WorkerPool,
    token: str,
    portal_box: list[Portal | None],
    transport: Transport,
    recorder: Recorder,
    shared: Shared,
    runs: weakref.WeakSet[Run],
) -> None:
    # Reached from close() or, for a loader dropped without close(), from the GC or at
    # interpreter exit: either way every run must learn that the loader is gone.
    shared.closed = True
    for run in list(runs):
        run.close_threadsafe()
    tracer = recorder.tracer
    if tracer is not None:
        recorder.tracer = None
        tracer.write()
    portal = portal_box[0]
    portal_box[0] = None
    if portal is not None:
        portal.close()
    if owned_pool is not None:
        owned_pool.close()
    else:
        pool.unregister(token)
    if shared.segment is not None:  # no worker of this loader will start again
        shared.segment.unlink()
    transport.close()

"""The persistent worker pool, a ``concurrent.futures.Executor``.

A :class:`WorkerPool` owns its workers (processes, or the single thread of
``num_workers=0``) or borrows an executor the user passed in. An owned pool starts on
first use, lives across epochs, iterators and loaders, replaces a worker that dies, and
stops its workers on :meth:`WorkerPool.shutdown` (or :meth:`~WorkerPool.close`, or its
finalizer). A borrowed executor is never shut down.

Two ways in. The Executor face (``submit``, ``map``, ``shutdown``) runs any picklable
function on the same workers the loaders use. The engine's dispatcher takes the fast
path: :meth:`~WorkerPool.start`, :meth:`~WorkerPool.send` (a :class:`Job`),
:meth:`~WorkerPool.result` (the task's value, its own exception, or :class:`Lost`),
:meth:`~WorkerPool.due_at`, :meth:`~WorkerPool.stop` and
:meth:`~WorkerPool.kill_stuck_start`. Pool errors become aioloader errors here and in
the backends (:mod:`.procs`, :mod:`.local`), never anything of ``concurrent.futures``.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures as cf
import functools
import os
import pickle
import threading
import weakref
from collections.abc import Callable
from multiprocessing.context import BaseContext
from typing import Any, Literal

from .. import _mainguard
from .._cpus import available_cpus
from .._validate import resolve_context
from .._wake import waker_for
from .._worker import byvalue as _byvalue
from .._worker import reply as _reply
from .._worker import tasks as _tasks
from .._worker.slots import describe_exit
from ..errors import LoaderClosedError, WorkerCrashedError
from . import procs as _procs
from . import zygote as _zygote
from .jobs import Job, Lost
from .local import Borrowed, Thread

__all__ = ["Job", "Lost", "WorkerPool", "concurrency_of"]

PoolKind = Literal["process", "thread", "external"]
Backend = _procs.Procs | Thread | Borrowed


def concurrency_of(ex: cf.Executor) -> int:
    """How many tasks a borrowed executor runs at once, as far as public API tells:
    the CPUs this process may use (pass ``num_workers=`` with ``executor=`` to say)."""
    return available_cpus()[0]


class WorkerPool(cf.Executor):
    """A pool of workers that persists across epochs, iterators and loaders.

    Pass one pool to several loaders (``DataLoader(..., pool=pool)`` or
    ``StreamLoader(..., pool=pool)``) so that they share processes, and ``submit``
    functions of your own to the same workers. The workers start on first use.
    ``num_workers=0`` gives one background thread in this process.

    Args:
        num_workers: processes to run (default: the CPUs this process may use, its affinity
            mask and cgroup quota counted); ``0`` for a thread. With ``executor``: how
            many tasks it runs at once (default: those CPUs).
        mp_context: start method name or context for processes the pool cannot fork
            from its own fork server; default ``forkserver`` (else ``spawn``).
        executor: use this ``concurrent.futures.Executor`` instead of workers of our own.
            It is never shut down by aioloader.
    """

    def __init__(
        self,
        num_workers: int | None = None,
        *,
        mp_context: str | BaseContext | None = None,
        executor: cf.Executor | None = None,
    ) -> None:
        if executor is not None and not isinstance(executor, cf.Executor):
            raise TypeError(f"executor must be a concurrent.futures.Executor, got {executor!r}")
        if num_workers is None:
            num_workers = available_cpus()[0] if executor is None else concurrency_of(executor)
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(f"num_workers must be an int >= 0, got {num_workers!r}")
        self.kind: PoolKind = (
            "external" if executor is not None else "process" if num_workers > 0 else "thread"
        )
        self.num_workers = num_workers
        self._context = resolve_context(mp_context) if self.kind == "process" else None
        self._external = executor
        self._payloads: dict[str, bytes | _byvalue.Inherited] = {}
        self._lock = threading.RLock()
        self._closed = False
        self._shutting_down = False
        self._pid = os.getpid()
        if self._context is not None and self._context.get_start_method() == "forkserver":
            _zygote.ensure()  # the process's fork server, now, before the event loop's thread exists
        # The finalizer must not reference self: it gets a box holding the live backend.
        self._box: list[Backend | None] = [None]
        self._finalizer = weakref.finalize(self, WorkerPool._close_box, self._box)
        self._restarts_before = 0  # replacements counted by backends already closed

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def owned(self) -> bool:
        return self.kind != "external"

    @property
    def concurrency(self) -> int:
        """How many tasks the pool runs at once."""
        return max(self.num_workers, 1)

    @property
    def crosses_processes(self) -> bool:
        """Do its tasks travel to other processes (pickled)? Not on threads."""
        external_procs = self.kind == "external" and not isinstance(self._external, cf.ThreadPoolExecutor)
        return self.kind == "process" or external_procs

    @property
    def start_method(self) -> str | None:
        return self._context.get_start_method() if self._context is not None else None

    @property
    def restarts(self) -> int:
        """Workers replaced after a death, since the pool was made."""
        backend = self._box[0]
        own = backend.restarts if isinstance(backend, _procs.Procs) else 0
        return self._restarts_before + own

    # ------------------------------------------------------------------ payloads
    def register(self, token: str, payload: bytes | _byvalue.Inherited) -> None:
        """Make a loader's payload known to every worker this pool starts from now on.

        An :class:`~aioloader._worker.byvalue.Inherited` payload can reach a worker only as it
        starts: workers that started without it are stopped, and their jobs run again on
        the workers that replace them (no job counts this as a crash)."""
        with self._lock:
            self._payloads[token] = payload
            backend = self._box[0]
            if not isinstance(payload, _byvalue.Inherited) or not isinstance(backend, _procs.Procs):
                return
            self._retire(backend)
            self._restarts_before += 1 if backend.started else 0
        backend.close(grace=0.0)

    def unregister(self, token: str) -> None:
        with self._lock:
            self._payloads.pop(token, None)
        _tasks.forget_context(token)

    def _payloads_now(self) -> dict[str, bytes | _byvalue.Inherited]:
        with self._lock:
            return dict(self._payloads)

    # ------------------------------------------------------------------ backends
    def _backend(self) -> Backend:
        """The live backend, made (not started) if there is none."""
        if self._pid != os.getpid():  # a forked child: the parent's workers are not ours
            self._pid, self._lock = os.getpid(), threading.RLock()
            old = self._box[0]
            if isinstance(old, _procs.Procs):
                old.abandon()
            self._box[0] = None
        with self._lock:
            if self._closed or self._shutting_down:
                raise LoaderClosedError("the worker pool is closed")
            backend = self._box[0]
            if isinstance(backend, _procs.Procs) and (backend.fatal is not None or backend.closed):
                self._retire(backend)  # broken for good, or stopped at exit: the next start begins afresh
                backend.close(grace=0.0)
                backend = None
            if backend is None:
                backend = self._box[0] = self._make()
            return backend

    def _make(self) -> Backend:
        if self._external is not None:
            return Borrowed(self._external)
        if self._context is None:
            return Thread()
        if _procs.exiting:
            raise LoaderClosedError("the interpreter is shutting down: no worker starts now")
        _mainguard.refuse_while_main_imports()  # before this process makes anything
        forkserver = self._context.get_start_method() == "forkserver"
        session = _zygote.session() if forkserver else None
        return _procs.Procs(self.num_workers, self._context, self._payloads_now, session)

    def _retire(self, backend: Backend) -> None:
        """Take ``backend`` out of the box (the lock held); the caller closes it."""
        if self._box[0] is backend:
            self._box[0] = None
            if isinstance(backend, _procs.Procs):
                self._restarts_before += backend.restarts

    def ready(self) -> bool:
        """Is the pool started (so :meth:`send` never blocks)? Raises if it is closed."""
        if self._closed:
            raise LoaderClosedError("the worker pool is closed")
        backend = self._box[0]
        if backend is None or self._pid != os.getpid():
            return False
        return backend.started and backend.fatal is None and not backend.closed

    def start(self) -> WorkerPool:
        """Start the workers (blocking: call from a thread). Returns once tasks can be
        sent; the workers may still be starting, and take them when they are up."""
        self._backend().start()
        return self

    # ------------------------------------------------------------- the fast path
    def send(
        self,
        fn: Callable[[Any], Any],
        task: Any,
        *,
        alone: bool = False,
        on_part: Callable[[Job, Any], None] | None = None,
        timeout: float | None = None,
    ) -> Job:
        """Run ``fn(task)`` on a worker (``task.task_id`` names it); never raises but
        :class:`~aioloader.LoaderClosedError`. ``alone``: the task holds its worker for
        long (a shard), so it goes to an idle worker and nothing waits behind it.
        ``on_part``: takes the messages the task sends while it runs (see :meth:`tell`).

        ``timeout``: owned processes stop the task once it has been due that long (see
        :meth:`due_at`), whoever awaits it; its :meth:`result` then raises :class:`Lost`
        with ``timed_out`` saying what hung, and ``job.timeout_ns`` is set. Other
        backends leave the timeout to the caller."""
        job = Job(_reply.Entry(fn, _reply.origin()), (task,), task.task_id)
        job.alone = alone
        job.on_part = on_part
        backend = self._backend()
        if timeout and isinstance(backend, _procs.Procs):
            job.timeout_ns = max(int(timeout * 1e9), 1)
        if not backend.started:  # the dispatcher starts it first: this is a fallback
            backend.start()
        backend.submit(job)
        return job

    async def result(self, job: Job) -> Any:
        """The task's return value; raises its own exception, or :class:`Lost`.
        Cancelling the awaiting task leaves the job running."""
        if not job.done:
            loop = asyncio.get_running_loop()
            job.waiter = loop.create_future()
            job.waker = waker_for(loop)
            if not job.done:
                await job.waiter
        if job.lost is not None:
            if job.lost.fatal is not None:  # one error for every task: its traceback from here only
                raise job.lost.fatal.with_traceback(None)
            raise job.lost
        assert job.outcome is not None
        return job.outcome.unwrap()

    def tell(self, job: Job, message: Any) -> bool:
        """Send ``message`` to ``job``'s running task (what its link's ``recv`` returns);
        ``False`` if it is not running (not started yet, ended, or its worker died)."""
        backend = self._box[0]
        if backend is None or isinstance(backend, Borrowed):
            return False
        return backend.tell(job, message)

    def due_at(self, job: Job) -> int | None:
        """``time.monotonic_ns()`` since when the task is *due*: its worker could start
        it. For a worker process: since it was sent to that worker with nothing ahead of
        it, since the job ahead of it was answered, or since the worker finished
        starting. For the loader's thread: since the thread took it; for a borrowed
        executor: since its submission. ``None`` if it is not due (yet, or any more)."""
        backend = self._box[0]
        return backend.due_at(job) if backend is not None else None

    def stop(self, job: Job) -> str | None:
        """Stop a task that overran its timeout; says what was done (for the error), or
        ``None`` if it was no longer due. Its :meth:`result` then raises :class:`Lost`."""
        backend = self._box[0]
        return backend.stop(job) if backend is not None else None

    def kill_stuck_start(self, limit_ns: int) -> tuple[int, list[Job], str] | None:
        """Kill a worker still starting ``limit_ns`` after it started; its pid, its jobs
        and what hung."""
        backend = self._box[0]
        if isinstance(backend, _procs.Procs):
            return backend.kill_stuck_start(limit_ns)
        return None

    # --------------------------------------------------------- the Executor face
    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> cf.Future[Any]:
        """Run ``fn(*args, **kwargs)`` on one of the pool's workers (see
        ``concurrent.futures.Executor.submit``). A worker that dies while it runs the
        function fails its future with :class:`~aioloader.WorkerCrashedError`; the other
        tasks go on, and the worker is replaced. A future cancelled before a worker takes
        its task never runs; once one has (a worker may hold one task ahead of the one it
        runs; a borrowed executor takes each at once), ``cancel()`` returns ``False``."""
        with self._lock:
            if self._shutting_down or self._closed:
                raise RuntimeError("cannot schedule new futures after shutdown")
        fut: cf.Future[Any] = cf.Future()
        call = functools.partial(fn, *args, **kwargs) if kwargs else fn
        call_args = args if not kwargs else ()
        if self.kind == "process" and _zygote.main_by_value() and _names_main((call, call_args)):
            # The workers' __main__ is not the consumer's: what it defined goes by value.
            call, call_args = _byvalue.run_by_value, (_byvalue.dumps_by_value((call, call_args)),)
        job = Job(call, call_args, None)
        job.callback = functools.partial(_to_future, fut)
        job.gate = fut.set_running_or_notify_cancel  # a future cancelled before it leaves never runs
        backend = self._backend()
        backend.start()
        backend.submit(job)
        return fut

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop taking work, then stop the workers (see
        ``concurrent.futures.Executor.shutdown``). Tasks already submitted run to their
        end unless ``cancel_futures``."""
        with self._lock:
            self._shutting_down = True
            backend = self._box[0]
        if cancel_futures and isinstance(backend, _procs.Procs):
            backend.drop_pending()
        if not wait:
            threading.Thread(target=self._drain_and_close, name="aioloader-shutdown", daemon=True).start()
            return
        self._drain_and_close()

    def _drain_and_close(self) -> None:
        backend = self._box[0]
        if isinstance(backend, _procs.Procs):
            backend.drain()
        self.close()

    def worker_pids(self) -> list[int]:
        """Pids of the pool's worker processes, as of now (empty for threads/borrowed).
        Safe from any thread at any moment."""
        backend = self._box[0]
        return backend.pids() if isinstance(backend, _procs.Procs) else []

    def close(self) -> None:
        """Stop the workers. Idempotent; a running task gets a short grace, then its
        worker is killed."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._payloads.clear()
        self._finalizer()

    @staticmethod
    def _close_box(box: list[Backend | None]) -> None:
        backend, box[0] = box[0], None
        if backend is not None:
            backend.close(grace=0.25)

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown(wait=True)

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<aioloader.WorkerPool {self.kind} workers={self.num_workers} {state}>"


def _names_main(obj: object) -> bool:
    """Does ``obj`` pickle with a reference to ``__main__``? (``False`` if it does not pickle:
    its own error comes when it is sent.)"""
    try:
        return b"__main__" in pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:
        return False


def _to_future(fut: cf.Future[Any], job: Job) -> None:
    """The Executor face: a settled job's outcome onto its ``concurrent.futures`` future."""
    try:
        _settle_future(fut, job)
    except cf.InvalidStateError:  # the caller cancelled it
        pass


def _settle_future(fut: cf.Future[Any], job: Job) -> None:
    if fut.cancelled():
        return
    lost = job.lost
    if lost is not None:
        if lost.fatal is not None:
            fut.set_exception(lost.fatal)
        elif lost.charged:
            fut.set_exception(
                WorkerCrashedError(
                    f"worker pid {lost.pid} died while it ran this task (exit code "
                    f"{describe_exit(lost.code)})",
                    exitcode=lost.code,
                )
            )
        elif fut.cancel():  # shutdown(cancel_futures=True), or the pool closed first
            pass
        return
    assert job.outcome is not None
    if job.outcome.ok:
        fut.set_result(job.outcome.value)
    else:
        fut.set_exception(job.outcome.value)


atexit.register(_procs.close_all, 0.1)

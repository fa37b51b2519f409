"""The persistent worker pool: the one boundary between aioloader and the executor.

Ownership: a :class:`WorkerPool` either *owns* its executor (it created it: a process
pool, or the single thread of ``num_workers=0``) or *borrows* one the user passed in.
An owned pool is created on first use, lives across epochs and iterators, is replaced by
a new *generation* after a worker dies, and is shut down by :meth:`WorkerPool.close` (or
its finalizer). A borrowed executor is never shut down or rebuilt.

What the dispatcher gets, whatever the executor: :meth:`~WorkerPool.start`,
:meth:`~WorkerPool.submit` (a :class:`Job`), :meth:`~WorkerPool.result` (the task's
value, its own exception, or :class:`Lost`), :meth:`~WorkerPool.started_at`,
:meth:`~WorkerPool.stop` and :meth:`~WorkerPool.recover`. Executor errors become
aioloader errors here and nowhere else; no concurrent future is cancelled while its
executor may still complete it (a broken ``ProcessPoolExecutor`` sets an exception on
every pending future, and a cancelled one makes its manager thread die).

Crash attribution (the deaths are recorded by :mod:`aioloader._generation`, which
holds every private name of ``concurrent.futures`` and ``multiprocessing`` we read): a
worker that died holding a task is charged with it; one that died idle is not; a
generation whose workers died before any of them was ready is a startup failure, and
:data:`MAX_START_FAILURES` of those in a row end in :class:`~aioloader.PoolBrokenError`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import functools
import os
import signal
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.context import BaseContext
from typing import Any, Literal

from . import _byvalue, _forkserver, _mainguard, _reply, _slots, _worker
from ._cpus import available_cpus
from ._generation import Generation, concurrency_of, interpreter_exiting, live_boxes
from ._slots import CrashInfo, Slots, describe_exit
from ._validate import default_mp_context, resolve_context
from ._wake import Waker, waker_for
from .errors import LoaderClosedError, PoolBrokenError

__all__ = [
    "CrashInfo",
    "Generation",
    "Job",
    "Lost",
    "WorkerPool",
    "concurrency_of",
    "default_mp_context",
    "describe_exit",
]

PoolKind = Literal["process", "thread", "external"]
MAX_START_FAILURES = 3


class Lost(Exception):
    """Pool → dispatcher, never to a user: the task's worker is gone (it died, it was
    stopped, or its generation was retired first). Call :meth:`WorkerPool.recover`."""


@dataclass(eq=False)
class Job:
    """One submission of one task."""

    gen: Generation
    task_id: int
    submit_ns: int
    future: cf.Future[Any] | None = None
    stopped: bool = False
    waiter: asyncio.Future[None] | None = None  # what the awaiting task waits on
    waker: Waker | None = None

    def wake(self, *_: object) -> None:
        """Wake the task awaiting :meth:`WorkerPool.result` (from any thread)."""
        if self.waker is not None and self.waiter is not None:
            self.waker.wake(self.waiter)


class WorkerPool:
    """A pool of workers that persists across epochs, iterators and loaders.

    Pass one pool to several loaders (``DataLoader(..., pool=pool)`` or
    ``StreamLoader(..., pool=pool)``) so that they share processes. The pool is created
    lazily on first use. ``num_workers=0`` gives one background thread in this process.

    Args:
        num_workers: processes to run (default: the CPUs this process may use, its affinity
            mask and cgroup quota counted); ``0`` for a thread.
        mp_context: start method name or context; default ``forkserver`` (else ``spawn``).
        executor: use this ``concurrent.futures.Executor`` instead of creating one. It is
            never shut down or rebuilt by aioloader.
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
            num_workers = available_cpus()[0]
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(f"num_workers must be an int >= 0, got {num_workers!r}")
        self.kind: PoolKind = (
            "external" if executor is not None else "process" if num_workers > 0 else "thread"
        )
        self.num_workers = num_workers
        self._context = resolve_context(mp_context) if self.kind == "process" else None
        if self._context is not None:  # now, before the event loop's thread exists
            _forkserver.prepare(self._context)
        self._external = executor
        self._payloads: dict[str, bytes | _byvalue.Inherited] = {}
        self._lock = threading.RLock()
        self._gen: Generation | None = None
        self._gen_count = 0
        self._closed = False
        self._start_failures = 0
        self.restarts = 0
        self._pid = os.getpid()
        # The finalizer must not reference self: it gets a box holding the live generation.
        self._box: list[Generation | None] = [None]
        self._finalizer = weakref.finalize(self, WorkerPool._shutdown_gen, self._box)
        live_boxes[id(self._box)] = self._box

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def owned(self) -> bool:
        return self.kind != "external"

    @property
    def concurrency(self) -> int:
        """How many tasks the pool runs at once (a guess for borrowed executors)."""
        if self.kind != "external":
            return max(self.num_workers, 1)
        assert self._external is not None
        return concurrency_of(self._external)

    @property
    def crosses_processes(self) -> bool:
        """Do its tasks travel to other processes (pickled, through pipes)? Not on threads."""
        external_procs = self.kind == "external" and not isinstance(self._external, cf.ThreadPoolExecutor)
        return self.kind == "process" or external_procs

    @property
    def start_method(self) -> str | None:
        return self._context.get_start_method() if self._context is not None else None

    # ------------------------------------------------------------------ payloads
    def register(self, token: str, payload: bytes | _byvalue.Inherited) -> None:
        """Make a loader's payload known to every future worker of this pool.

        An :class:`~aioloader._byvalue.Inherited` payload can reach a worker only as it
        starts: if the live generation has started without it, it is retired, and its
        tasks run again on the next one, which has it (no task counts this as a crash)."""
        with self._lock:
            self._payloads[token] = payload
            gen = self._gen
            if not (isinstance(payload, _byvalue.Inherited) and gen is not None and token not in gen.tokens):
                return
            self._drop(gen, CrashInfo({}))  # nobody's fault: no task is charged
        gen.retire(grace=0.0)

    def unregister(self, token: str) -> None:
        with self._lock:
            self._payloads.pop(token, None)
        _worker.forget_context(token)

    # ---------------------------------------------------------------- generations
    def current(self) -> Generation:
        """The live generation, created (not yet started) if there is none."""
        if self._pid != os.getpid():  # a forked child: the parent's workers are not ours
            self._pid, self._gen, self._lock = os.getpid(), None, threading.RLock()
            live_boxes[id(self._box)] = self._box
        with self._lock:
            if self._closed:
                raise LoaderClosedError("the worker pool is closed")
            if self._gen is None:
                if interpreter_exiting():
                    raise LoaderClosedError("the interpreter is shutting down: no worker starts now")
                self._gen_count += 1
                self._gen = self._box[0] = self._create(self._gen_count)
            return self._gen

    def _create(self, number: int) -> Generation:
        if self._external is not None:
            return Generation.borrowed(number, self._external)
        if self._context is None:
            return Generation.thread(number)
        _mainguard.refuse_while_main_imports()  # before this process makes anything
        _reply.sweep_spills()  # what runs killed with their workers left behind
        try:
            return Generation.processes_of(number, self._context, self.num_workers, self._payloads)
        except OSError as exc:
            raise PoolBrokenError(
                f"cannot start the worker pool: multiprocessing could not create its semaphores or "
                f"shared memory ({type(exc).__name__}: {exc}). Process pools need a writable /dev/shm "
                "with free space and inodes (docker run --shm-size=1g, or a tmpfs mounted there); "
                "num_workers=0 needs none",
                errno=exc.errno,
            ) from exc

    def started_generation(self) -> Generation | None:
        """The live generation if it is created and started, else ``None`` (never blocks:
        creating a process pool starts helper processes, so the event loop leaves that to
        :meth:`start` in a thread)."""
        if self._closed:
            raise LoaderClosedError("the worker pool is closed")
        gen = self._gen
        return gen if gen is not None and gen.started and self._pid == os.getpid() else None

    def start(self) -> Generation:
        """Create the generation and have its workers started (blocking; call from a
        thread). With lanes it returns once tasks can be sent, while the workers are
        still being forked (see :meth:`Generation.start_workers`). Raises only aioloader
        errors; a generation that fails while it starts is returned anyway, and its
        first task comes back :class:`Lost`."""
        gen = self.current()
        with gen.lock:
            if not gen.started:
                if gen.processes is not None:
                    try:
                        gen.start_workers(self.num_workers)
                    except Exception as exc:
                        self._refused(gen, exc)
                # Only now: a task submitted to the executor while it launched its processes
                # would make it spawn one more for itself.
                gen.started = True
        return gen

    def submit(self, gen: Generation, fn: Callable[[Any], Any], task: Any) -> Job:
        """Submit ``fn(task)`` (``task.task_id`` names it). Raises only aioloader errors."""
        job = Job(gen, task.task_id, time.monotonic_ns())
        if gen.failure is not None:  # it refused work once: it is retired, not trusted
            job.stopped = True
            return job
        try:
            job.future = gen.submit(_reply.Entry(fn, gen.origin), task)
            gen.jobs.add(job)
        except Exception as exc:
            self._refused(gen, exc)
            job.stopped = True
        return job

    def _refused(self, gen: Generation, exc: Exception) -> None:
        if self._closed:
            raise LoaderClosedError("the worker pool is closed") from exc
        if interpreter_exiting():
            raise LoaderClosedError("the interpreter is shutting down") from exc
        if isinstance(exc, cf.BrokenExecutor):
            gen.broken = True
        elif not gen.owned:
            raise PoolBrokenError(f"the user-supplied executor refused new work: {exc}") from exc
        if gen.failure is None:  # a worker died as it started, the forkserver is gone...
            gen.failure = exc

    async def result(self, job: Job) -> Any:
        """The task's return value; raises its own exception, or :class:`Lost`.

        Cancelling the awaiting task does not cancel the concurrent future."""
        if not job.stopped and job.future is not None:
            loop = asyncio.get_running_loop()
            waiter: asyncio.Future[None] = loop.create_future()
            job.waiter = waiter
            job.waker = waker_for(loop)
            # Weakly: a settled future keeps its callbacks, and a cycle through job.wake
            # would keep the batch (and its shared-memory slab) until the cyclic GC ran.
            job.future.add_done_callback(functools.partial(_wake_job, weakref.ref(job)))
            if _stopped(job):  # stop() ran before it could wake us
                job.wake()
            await waiter
        fut = job.future
        if job.stopped or fut is None or fut.cancelled() or not fut.done():
            raise Lost
        exc = fut.exception()
        if isinstance(exc, cf.BrokenExecutor):
            job.gen.broken = True
            raise Lost
        if exc is not None:
            raise exc  # the executor's own verdict (dask's KilledWorker, an unpicklable task)
        value = fut.result()
        if not isinstance(value, _reply.Outcome):
            return value
        if value.ok:
            self._start_failures = 0
        return value.unwrap()

    def started_at(self, job: Job) -> int | None:
        """``time.monotonic_ns()`` when a worker started the task (submission, for a
        borrowed executor), or ``None`` if it is not running."""
        if job.future is None or job.future.done() or job.stopped:
            return None
        gen = job.gen
        if gen.slots is not None:
            running = gen.slots.running(job.task_id)
            return running[1] if running is not None else None
        return _slots.local_starts.get(job.task_id) if gen.owned else job.submit_ns

    def stop(self, job: Job) -> str | None:
        """Stop a task that overran its timeout; says what was done (for the error), or
        ``None`` if it was no longer running. Its :meth:`result` then raises :class:`Lost`."""
        gen, fut = job.gen, job.future
        if fut is None or fut.done() or job.stopped:
            return None
        if gen.slots is not None:
            running = gen.slots.running(job.task_id)
            if running is None:
                return None
            with contextlib.suppress(ProcessLookupError):
                os.kill(running[0], signal.SIGKILL)
            return f"its worker (pid {running[0]}) was killed and the pool rebuilt"
        if gen.owned:
            if job.task_id not in _slots.local_starts:
                return None
            self._drop(gen, CrashInfo({}))
            gen.abandon_thread()
            how = "the stuck thread was abandoned (it ends when its sample returns)"
        elif isinstance(gen.executor, cf.ThreadPoolExecutor) and fut.cancel():
            how = "it was cancelled on the borrowed executor before it started"
        else:
            how = "the borrowed executor's task could not be stopped; it was abandoned"
        job.stopped = True
        job.wake()
        return how

    def _drop(self, gen: Generation, crash: CrashInfo | None = None) -> None:
        with self._lock:
            if crash is not None and gen.crash is None:
                gen.crash = crash
            if self._gen is gen:
                self._gen = self._box[0] = None
                self.restarts += 1

    def recover(self, gen: Generation) -> CrashInfo:
        """Called by every task of ``gen`` that came back :class:`Lost` (blocking; call
        from a thread). The first caller retires the generation and works out who died
        holding what; later callers get the same answer. Raises
        :class:`~aioloader.PoolBrokenError` for a borrowed executor that broke, and
        after :data:`MAX_START_FAILURES` generations in a row that could not start."""
        with gen.lock:
            if gen.crash is None:
                if not gen.owned:
                    if gen.broken:
                        raise PoolBrokenError(
                            "a worker of the user-supplied executor died and aioloader may not rebuild "
                            "an executor it does not own; create a new executor and loader"
                        )
                    return CrashInfo({})  # a stopped task: nothing died
                self._drop(gen)
                gen.retire(grace=0.0)
                gen.crash = self._conclude(gen)
                _release_stranded(gen)
        if gen.crash.fatal is not None:  # one error for every task: its traceback from here only
            raise gen.crash.fatal.with_traceback(None)
        return gen.crash

    def _conclude(self, gen: Generation) -> CrashInfo:
        dead, rows = gen.final_deaths()
        charged: dict[int, int | None] = {}
        pids: dict[int, int] = {}
        for pid, code in dead.items():
            phase, task_id, _ = rows.get(pid, (Slots.STARTING, -1, 0))
            if phase >= Slots.ACCEPTED and task_id >= 0:
                charged[task_id], pids[task_id] = code, pid
        ready = any(phase >= Slots.READY for phase, _, _ in rows.values())
        startup = gen.processes is not None and not ready and bool(dead or gen.failure)
        info = CrashInfo(charged, startup=startup, pids=pids)
        info.fatal = _mainguard.verdict(dead)  # the script re-imported in a worker: no retry helps
        self._start_failures = self._start_failures + 1 if info.startup else 0
        if self._start_failures >= MAX_START_FAILURES and info.fatal is None:
            self._start_failures = 0
            code = next(iter(dead.values()), None)
            why = f"; the last error: {type(gen.failure).__name__}: {gen.failure}" if gen.failure else ""
            info.fatal = PoolBrokenError(
                f"the pool's workers keep dying before they finish starting ({MAX_START_FAILURES} "
                f"generations in a row; exit codes {sorted(describe_exit(c) for c in dead.values())}{why}). "
                "A worker that cannot import the main module or the dataset's module, or that crashes "
                "while unpickling the dataset, does this: run from a file rather than stdin, guard the "
                "entry point with `if __name__ == '__main__':`, and check that the dataset unpickles in "
                "a fresh interpreter",
                exitcode=code,
            )
            info.fatal.__cause__ = gen.failure
        return info

    def worker_pids(self) -> list[int]:
        """Pids of the current generation's processes (empty for threads/borrowed)."""
        gen = self._gen
        return gen.pids() if gen is not None else []

    def close(self) -> None:
        """Shut down an owned executor. Idempotent; a running task gets a short grace, then its worker is killed."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._payloads.clear()
            self._gen = None
        self._finalizer()

    @staticmethod
    def _shutdown_gen(box: list[Generation | None]) -> None:
        live_boxes.pop(id(box), None)
        gen, box[0] = box[0], None
        if gen is not None and gen.owned:
            gen.retire(grace=0.25)

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<aioloader.WorkerPool {self.kind} workers={self.num_workers} {state}>"


def _wake_job(ref: weakref.ref[Job], _fut: object) -> None:
    job = ref()
    if job is not None:
        job.wake()


def _stopped(job: Job) -> bool:
    return job.stopped


def _release_stranded(gen: Generation) -> None:
    """A future a retired process generation left unsettled never will be: it is
    reported lost (and resubmitted, charged only if its own worker died holding it). A
    safety net: no path is known to leave one, but a hang here would be silent."""
    if gen.processes is None:
        return  # threads: a task still running after retire() is running, not stranded
    for job in list(gen.jobs):
        if job.future is None or not job.future.done():
            job.stopped = True
            job.wake()

"""The persistent worker pool, and the one place where executor failures are translated.

Ownership: a :class:`WorkerPool` either *owns* its executor (it created it: a process
pool, or the single thread of ``num_workers=0``) or *borrows* one the user passed in.
An owned pool is created on first use, lives across epochs and iterators, is rebuilt
after a worker dies, and is shut down by :meth:`WorkerPool.close` (or its finalizer).
A borrowed executor is never shut down or rebuilt by aioloader.

Why private attributes of ``ProcessPoolExecutor`` are read here: before Python 3.14 the
public API offers no way to learn which processes a pool runs, to tell which one died,
or to stop a worker stuck in a task, so we read ``_processes`` (pid → Process) and kill
processes ourselves, only on pools we created. ``_launch_processes`` starts every worker
before the first submit (alone, the executor spawns one per submit that finds no idle
worker, and can stay short of ``num_workers``).
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from multiprocessing.context import BaseContext
from typing import Any, Literal

import numpy as np

from . import _byvalue, _worker
from ._validate import default_mp_context, resolve_context
from .errors import LoaderClosedError, PoolBrokenError

__all__ = ["CrashInfo", "Generation", "WorkerPool", "default_mp_context", "resolve_context"]

PoolKind = Literal["process", "thread", "external"]


@dataclass
class CrashInfo:
    """What a broken generation left behind."""

    culprits: dict[int, int | None]  # task_id -> exit code of the process that ran it
    exitcodes: dict[int, int | None]  # pid -> exit code
    known: bool  # False when the dead process could not be told apart from the others


@dataclass
class Generation:
    """One incarnation of the executor. A crash ends a generation; the next one replaces it."""

    number: int
    executor: cf.Executor
    processes: Any = None  # the executor's own pid -> Process mapping
    table: np.ndarray | None = None
    crash: CrashInfo | None = None
    started: bool = False
    owned: bool = True
    lock: threading.Lock = field(default_factory=threading.Lock)
    tokens: frozenset[str] = frozenset()  # the payloads its workers receive when they start

    def running_tasks(self) -> dict[int, tuple[int, int]]:
        """task_id -> (pid, start_ns) of the tasks the workers are computing now."""
        out: dict[int, tuple[int, int]] = {}
        if self.table is not None:
            t = self.table.reshape(-1, 3).copy()
            for pid, task_id, start in t.tolist():
                if pid > 0 and start > 0 and task_id >= 0:
                    out[task_id] = (pid, start)
        return out


class WorkerPool:
    """A pool of workers that persists across epochs, iterators and loaders.

    Pass one pool to several loaders (``DataLoader(..., pool=pool)`` or
    ``StreamLoader(..., pool=pool)``) so that they share processes. The pool is created
    lazily on first use. ``num_workers=0`` gives one background thread in this process.

    Args:
        num_workers: processes to run (default: ``os.cpu_count()``); ``0`` for a thread.
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
            num_workers = os.cpu_count() or 1
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
        self._gen: Generation | None = None
        self._gen_count = 0
        self._closed = False
        self.restarts = 0
        # The finalizer must not reference self: it gets a box holding the live generation.
        self._box: list[Generation | None] = [None]
        self._finalizer = weakref.finalize(self, WorkerPool._shutdown_gen, self._box)
        _live_boxes[id(self._box)] = self._box

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def owned(self) -> bool:
        return self.kind != "external"

    @property
    def concurrency(self) -> int:
        """How many tasks the pool runs at once (a guess for borrowed executors)."""
        if self.kind == "process":
            return self.num_workers
        if self.kind == "thread":
            return 1
        n = getattr(self._external, "_max_workers", None)
        return int(n) if isinstance(n, int) and n > 0 else os.cpu_count() or 1

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
            gen.crash = CrashInfo({}, {}, known=True)  # nobody's fault: no task is charged
            self._drop(gen)
        _retire(gen, grace=0.0)

    def unregister(self, token: str) -> None:
        with self._lock:
            self._payloads.pop(token, None)
        _worker.forget_context(token)

    # ---------------------------------------------------------------- generations
    def current(self) -> Generation:
        """The live generation, created (not yet started) if there is none."""
        with self._lock:
            if self._closed:
                raise LoaderClosedError("the worker pool is closed")
            gen = self._gen
            if gen is None:
                gen = self._create()
                self._gen = gen
                self._box[0] = gen
            return gen

    def _create(self) -> Generation:
        self._gen_count += 1
        if self.kind == "external":
            assert self._external is not None
            return Generation(self._gen_count, self._external, started=True, owned=False)
        if self.kind == "thread":
            ex = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="aioloader-worker")
            return Generation(self._gen_count, ex, started=True)
        ctx = self._context
        assert ctx is not None
        if ctx.get_start_method() != "fork":
            _byvalue.drop_fake_main_file()
        if ctx.get_start_method() == "forkserver":
            _preload_forkserver(ctx)
        n = self.num_workers
        table = ctx.RawArray("q", 3 * n)
        lock = _slot_lock(ctx)
        counter = ctx.RawValue("i", 0)
        pex = cf.ProcessPoolExecutor(
            max_workers=n,
            mp_context=ctx,
            initializer=_worker.pool_initializer,
            initargs=(dict(self._payloads), table, lock, counter, n, os.getpid()),
        )
        view = np.frombuffer(table, dtype=np.int64)
        return Generation(
            self._gen_count, pex, processes=pex._processes, table=view, tokens=frozenset(self._payloads)
        )

    def started_generation(self) -> Generation | None:
        """The live generation if it is created and started, else ``None`` (never blocks:
        creating a process pool starts helper processes, so the event loop leaves that to
        :meth:`start` in a thread)."""
        if self._closed:
            raise LoaderClosedError("the worker pool is closed")
        gen = self._gen
        return gen if gen is not None and gen.started else None

    def start(self) -> Generation:
        """Create the generation and start all its workers in parallel (blocking; call
        from a thread). Workers that are still starting do not delay the first task: the
        pool hands it to the first one ready."""
        gen = self.current()
        with gen.lock:
            if not gen.started:
                if self.kind == "process":
                    # On its own the executor spawns a process per submit that finds no
                    # idle one, so quick first tasks can leave it short of num_workers.
                    launch = getattr(gen.executor, "_launch_processes", None)
                    if launch is not None and getattr(gen.executor, "_executor_manager_thread", None) is None:
                        launch()
                    for _ in range(self.num_workers):
                        gen.executor.submit(_worker.noop)
                # Only now: a task submitted while the processes were being launched would
                # make the executor spawn one more for itself.
                gen.started = True
        return gen

    def submit(self, gen: Generation, fn: Callable[..., Any], *args: Any) -> cf.Future[Any]:
        try:
            return gen.executor.submit(fn, *args)
        except RuntimeError as exc:
            if self._closed:
                raise LoaderClosedError("the worker pool is closed") from exc
            if isinstance(exc, BrokenProcessPool):
                raise
            if self.kind == "external":
                raise PoolBrokenError(f"the user-supplied executor refused new work: {exc}") from exc
            raise

    def is_crash(self, exc: BaseException) -> bool:
        """Does ``exc`` (raised by a task's future) mean a worker died?"""
        return isinstance(exc, BrokenProcessPool)

    def recover(self, gen: Generation) -> CrashInfo:
        """Called by every task that saw ``gen`` break; the first caller works out who
        died and retires the generation, later callers get the same answer."""
        with self._lock:
            if gen.crash is not None:
                return gen.crash
            if self.kind == "external":
                raise PoolBrokenError(
                    "a worker of the user-supplied executor died and aioloader may not rebuild "
                    "an executor it does not own; create a new executor and loader"
                )
            gen.crash = self._autopsy(gen)
            self._drop(gen)
        _retire(gen, grace=0.0)
        return gen.crash

    def _drop(self, gen: Generation) -> None:
        """Stop handing out ``gen`` (the caller holds the lock); the next task gets a new one."""
        if self._gen is gen:
            self._gen = self._box[0] = None
            self.restarts += 1

    @staticmethod
    def _autopsy(gen: Generation) -> CrashInfo:
        procs = dict(gen.processes or {})
        # Let the pool's manager thread finish first: it terminates the survivors and joins
        # every process. Reading exit codes while it joins races with it on forkserver's
        # status pipe (the loser reads EOF and records 255 instead of the real code).
        manager = getattr(gen.executor, "_executor_manager_thread", None)
        if manager is not None and manager is not threading.current_thread():
            manager.join(5.0)
        deadline = time.monotonic() + 1.0
        codes: dict[int, int | None] = {}
        while True:
            codes = {pid: p.exitcode for pid, p in procs.items()}
            if any(c is not None for c in codes.values()) or time.monotonic() > deadline:
                break
            time.sleep(0.005)
        dead = {pid for pid, c in codes.items() if c is not None and c != -signal.SIGTERM}
        known = bool(dead)
        if not known:
            dead = {pid for pid, c in codes.items() if c is not None}
        culprits: dict[int, int | None] = {}
        if gen.table is not None:
            for pid, task_id, _start in gen.table.reshape(-1, 3).tolist():
                if pid in dead and task_id >= 0:
                    culprits[task_id] = codes.get(pid)
        return CrashInfo(culprits, codes, known and bool(culprits))

    def kill_task(self, gen: Generation, task_id: int) -> bool:
        """Kill the process running ``task_id`` (owned process pools only)."""
        running = gen.running_tasks()
        if task_id not in running:
            return False
        try:
            os.kill(running[task_id][0], signal.SIGKILL)
        except ProcessLookupError:
            return False
        return True

    def abandon(self, gen: Generation) -> None:
        """Drop a thread generation whose thread is stuck (a timeout in thread mode)."""
        with self._lock:
            self._drop(gen)
        gen.executor.shutdown(wait=False, cancel_futures=True)
        _forget_threads(gen.executor)

    def worker_pids(self) -> list[int]:
        """Pids of the current generation's processes (empty for threads/borrowed)."""
        gen = self._gen
        if gen is None or gen.processes is None:
            return []
        return sorted(gen.processes)

    def close(self) -> None:
        """Shut down the executor if this pool owns it. Idempotent; never waits for a
        running task longer than a short grace period (the worker is then killed)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._payloads.clear()
            self._gen = None
        self._finalizer()

    @staticmethod
    def _shutdown_gen(box: list[Generation | None]) -> None:
        _live_boxes.pop(id(box), None)
        gen = box[0]
        box[0] = None
        if gen is not None and gen.owned:
            _retire(gen, grace=0.25)

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<aioloader.WorkerPool {self.kind} workers={self.num_workers} {state}>"


def _forget_threads(ex: cf.Executor) -> None:
    """Let interpreter exit proceed past an abandoned thread stuck in user code.

    ``concurrent.futures`` joins every executor thread at exit, without a timeout; a
    thread we abandoned after a timeout may never return. Dropping it from that registry
    (a private one) lets the process exit; the thread dies with it.
    """
    from concurrent.futures import thread as cf_thread

    registry = getattr(cf_thread, "_threads_queues", None)
    for t in list(getattr(ex, "_threads", ())):
        if registry is not None:
            registry.pop(t, None)


def _retire(gen: Generation, grace: float) -> None:
    """Shut an owned generation down without hanging on a stuck task."""
    ex = gen.executor
    if isinstance(ex, cf.ThreadPoolExecutor):
        ex.shutdown(wait=False, cancel_futures=True)
        deadline = time.monotonic() + max(grace, 0.0) + 5.0
        for t in list(getattr(ex, "_threads", ())):
            t.join(max(0.0, deadline - time.monotonic()))
        _forget_threads(ex)
        return
    procs = list((gen.processes or {}).values())
    manager = getattr(ex, "_executor_manager_thread", None)
    ex.shutdown(wait=False, cancel_futures=True)
    deadline = time.monotonic() + grace
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.exitcode is None:
            p.kill()
    for p in procs:
        p.join(5.0)
    if manager is not None and manager is not threading.current_thread():
        manager.join(10.0)


# Generation boxes of the pools not yet shut down (removed by _shutdown_gen).
_live_boxes: dict[int, list[Generation | None]] = {}


def _retire_all_at_exit() -> None:
    """Interpreter exit: stop every owned pool's workers before ``concurrent.futures``
    waits for them.

    ``concurrent.futures.process`` registers a hook (run before ``atexit``) that joins each
    pool's manager thread, which waits for running tasks: a worker stuck in a sample would
    hang the exit, Ctrl-C included. Threading exit hooks run newest first, and this one is
    registered after that module's, so it runs first and kills what is still running.
    """
    for box in list(_live_boxes.values()):
        gen = box[0]
        box[0] = None
        if gen is not None and gen.owned and gen.processes is not None:
            _retire(gen, grace=0.1)


threading._register_atexit(_retire_all_at_exit)  # type: ignore[attr-defined]

_preload_lock = threading.Lock()
_slot_locks: dict[str, Any] = {}


def _slot_lock(ctx: Any) -> Any:
    """The lock workers take to claim a slot of their generation's table: one per start
    method for the whole process, not one per generation. (A multiprocessing lock that the
    garbage collector finalizes while this thread talks to the resource tracker makes
    CPython 3.12's tracker raise ``ReentrantCallError`` and keep descriptors.)"""
    method = ctx.get_start_method()
    with _preload_lock:
        lock = _slot_locks.get(method)
        if lock is None:
            lock = _slot_locks[method] = ctx.Lock()
        return lock


def _preload_forkserver(ctx: BaseContext) -> None:
    """Let forkserver children start with numpy and aioloader already imported.

    Only takes effect if the interpreter's forkserver has not started yet, and only
    adds to what is preloaded (``__main__`` stays, as multiprocessing does by default).
    """
    from multiprocessing import forkserver

    with _preload_lock:
        server = forkserver._forkserver
        if getattr(server, "_forkserver_pid", None) is not None:
            return
        current = list(getattr(server, "_preload_modules", ["__main__"]))
        if "aioloader._worker" not in current:
            ctx.set_forkserver_preload([*current, "aioloader._worker"])

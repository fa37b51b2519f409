"""One incarnation of a pool's executor, and every private name of ``concurrent.futures``
and ``multiprocessing`` that aioloader reads (no other module reads any, but
:mod:`aioloader._forkserver` those of the forkserver).

A :class:`Generation` wraps one executor: the process pool or thread an owned
:class:`~aioloader.WorkerPool` created, or the executor a user lent it. A crash ends a
generation; the pool replaces it. This module knows how to create, watch and retire
one; what a death means for the tasks is the pool's business.

Watching a break: when a ``ProcessPoolExecutor`` breaks, its manager thread calls
``terminate()`` on each surviving worker's ``Process``. Each of those, once forked, is
given a ``terminate`` that first records (:meth:`Generation.note_deaths`) which
workers were already dead and what their rows of the slot table
(:class:`~aioloader._slots.Slots`) said; :meth:`Generation.retire` records the same
before it kills any. So the deaths that broke the pool are told apart from the
terminations that followed, whatever their exit codes, and however early the break
(the executor may fail a future before a callback could be added to it).

Private names read, because before Python 3.14 the public API cannot tell which
processes a pool runs, which one died, or stop a stuck worker:

=================================================  ===============================================
``ProcessPoolExecutor._processes``                 worker pids, exit codes at a break, killing;
                                                   its manager calling their ``terminate()``
``ProcessPoolExecutor._executor_manager_thread``   is a callback in it; joining it when retired
``ProcessPoolExecutor._launch_processes``          forking every worker, before any task
``ProcessPoolExecutor``'s calls of ``Process``      numbering its workers (see :class:`_Numbered`)
``ProcessPoolExecutor._max_workers``,              concurrency of a borrowed executor
``ThreadPoolExecutor._max_workers``
``ThreadPoolExecutor._threads``,                   letting interpreter exit pass an abandoned,
``concurrent.futures.thread._threads_queues``      stuck thread
``concurrent.futures.process._global_shutdown``,   telling interpreter exit from a broken pool
``concurrent.futures.thread._shutdown``
``threading._register_atexit``                     stopping our workers before concurrent.futures
                                                   joins them at interpreter exit
=================================================  ===============================================
"""

from __future__ import annotations

import concurrent.futures as cf
import concurrent.futures.process  # its exit hook must be registered before ours: see below
import concurrent.futures.thread  # noqa: F401
import contextlib
import functools
import gc
import itertools
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass, field
from multiprocessing import resource_tracker as mp_tracker
from multiprocessing import util as mp_util
from multiprocessing.connection import wait as wait_ready
from multiprocessing.context import BaseContext
from typing import Any, cast

from . import _byvalue, _forkserver, _lanes, _reply, _worker
from ._slots import CrashInfo, Rows, Slots

# What multiprocessing imports when the first process pool is made (its locks, shared
# values, the forkserver's Popen): imported with aioloader instead, not inside the first
# iteration's time to its first batch. (A platform without them fails later, as before.)
with contextlib.suppress(ImportError):
    import multiprocessing.popen_forkserver
    import multiprocessing.sharedctypes
    import multiprocessing.synchronize  # noqa: F401

__all__ = ["Generation", "concurrency_of", "interpreter_exiting"]


@dataclass(eq=False)
class Generation:
    """One executor incarnation and what is known about it."""

    number: int
    executor: cf.Executor
    origin: _reply.Origin
    owned: bool = True
    processes: MutableMapping[int, Any] | None = None  # the executor's own pid -> Process mapping
    slots: Slots | None = None
    manager: threading.Thread | None = None
    started: bool = False
    broken: bool = False  # one of its futures failed with BrokenExecutor
    failure: BaseException | None = None  # why it refused work
    deaths: tuple[dict[int, Any], Rows] | None = None  # pid -> Process, dead before any was stopped; rows
    noting: threading.Lock = field(default_factory=threading.Lock)
    crash: CrashInfo | None = None  # the pool's verdict, once retired
    lock: threading.Lock = field(default_factory=threading.Lock)
    tokens: frozenset[str] = frozenset()  # the payloads its workers receive when they start
    # Its submissions (the pool's Jobs), for the ones left unsettled once it is retired.
    jobs: weakref.WeakSet[Any] = field(default_factory=weakref.WeakSet)
    lanes: _lanes.Lanes | None = None  # an owned process pool's way round its threads
    launcher: threading.Thread | None = None  # starting the workers of the lanes
    launched_ns: int = 0  # time.monotonic_ns() when its workers were asked to start
    started_all: bool = False  # every worker was seen past its start

    @classmethod
    def processes_of(
        cls, number: int, ctx: BaseContext, n: int, payloads: dict[str, bytes | _byvalue.Inherited]
    ) -> Generation:
        """A process pool of ``n`` workers (none started yet). Raises ``OSError`` when
        multiprocessing cannot create its semaphores or shared memory."""
        method = ctx.get_start_method()
        if method != "fork":
            _byvalue.drop_fake_main_file()
        _forkserver.prepare(ctx)  # again: a forked child rebuilding a pool has no forkserver
        _retire_at_child_exit()
        origin = _reply.origin(True)
        lanes = _lanes.Lanes.open(n)
        try:
            with tracker_safe():
                table = ctx.RawArray("q", Slots.WIDTH * n)
                paths = lanes.paths() if lanes is not None else None
                args = (dict(payloads), table, n, os.getpid(), paths, origin)
                # A context in all but type: it passes every other name through.
                numbered = cast(BaseContext, _Numbered(ctx))
                pex = cf.ProcessPoolExecutor(n, numbered, _worker.pool_initializer, args)
        except BaseException:
            if lanes is not None:
                lanes.join()
            raise
        return cls(
            number,
            pex,
            origin,
            processes=pex._processes,
            slots=Slots(table),
            tokens=frozenset(payloads),
            lanes=lanes,
        )

    def launch(self) -> None:
        """Start every worker process now, in parallel. Alone, the executor spawns one per
        submit that finds no idle worker, and can stay short of its size."""
        launch = getattr(self.executor, "_launch_processes", None)
        if launch is not None and getattr(self.executor, "_executor_manager_thread", None) is None:
            with tracker_safe():
                launch()
            me = weakref.ref(self)
            for p in list((self.processes or {}).values()):  # no manager thread yet to stop one
                p.terminate = functools.partial(_terminate_noted, me, weakref.ref(p))

    @classmethod
    def thread(cls, number: int) -> Generation:
        ex = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="aioloader-worker")
        return cls(number, ex, _reply.origin(False))

    @classmethod
    def borrowed(cls, number: int, ex: cf.Executor) -> Generation:
        # Replies may be spilled only through a process pool's pipe: it is read, and
        # every reply unpickled, as soon as it arrives.
        return cls(number, ex, _reply.origin(isinstance(ex, cf.ProcessPoolExecutor)), owned=False)

    def start_workers(self, n: int) -> None:
        """Start an owned process pool's ``n`` workers.

        With lanes (:mod:`aioloader._lanes`) this returns at once: each worker serves
        its lane from the end of its initializer, so a task sent now waits in its lane's
        pipe and runs the moment that worker is up, while the next one is still being
        forked (the forkserver forks one at a time). A thread of its own
        (:meth:`_launch`) forks them. Without lanes (turned off, or no FIFOs here) it
        forks them all and gives each a first task, which starts the executor's
        manager thread."""
        self.launched_ns = time.monotonic_ns()
        if self.lanes is None:
            self.launch()
            for _ in range(n):
                self.submit(_worker.noop)
            return
        self.launcher = threading.Thread(target=self._launch, args=(self.lanes,), name="aioloader-launch", daemon=True)
        self.launcher.start()

    def _launch(self, lanes: _lanes.Lanes) -> None:
        """The launcher thread: start the lanes' thread, fork the workers, then submit
        one task that no worker runs while it serves its lane. Submitting it starts the
        executor's manager thread, which watches the workers; when one dies, the executor
        fails that task, and the lanes fail theirs (:meth:`~aioloader._lanes.Lanes.watch`).
        A failure to fork (the forkserver gone, no more processes) fails the tasks sent
        so far, as a worker dying as it started would: they come back lost and the pool
        rebuilds the generation."""
        try:
            lanes.start()
            self.launch()
            lanes.watch(self._submit(_worker.noop))
        except BaseException as exc:
            if isinstance(exc, cf.BrokenExecutor):
                self.broken = True
            if self.failure is None:
                self.failure = exc
            lanes.fail(f"the pool could not start its workers ({type(exc).__name__}: {exc})")

    def launched(self) -> None:
        """Wait until every worker of the lanes has been forked (or failed to be)."""
        launcher = self.launcher
        if launcher is not None and launcher is not threading.current_thread():
            launcher.join(_LAUNCH_WAIT)

    def submit(self, fn: Callable[..., Any], *args: Any) -> cf.Future[Any]:
        """``executor.submit``, or through the lanes once they are open, watched for a
        break (raises what the executor raises)."""
        lanes = self.lanes
        if lanes is None:
            return self._submit(fn, *args)
        # Not watched itself: a break fails the serve tasks first, which are.
        return lanes.submit(fn, *args)

    def _submit(self, fn: Callable[..., Any], *args: Any) -> cf.Future[Any]:
        fut = self.executor.submit(fn, *args)
        if self.manager is None and self.processes is not None:
            self.manager = getattr(self.executor, "_executor_manager_thread", None)
        fut.add_done_callback(self.settled)
        return fut

    def settled(self, fut: cf.Future[Any]) -> None:
        """Done callback of the executor's futures: notes a break (and, in the manager
        thread, the dead: where ``launch`` could not give the processes their hook)."""
        if not fut.cancelled() and isinstance(fut.exception(), cf.BrokenExecutor):
            self.broken = True
            if threading.current_thread() is self.manager:
                self.note_deaths()

    def note_deaths(self) -> None:
        """Record, once, which workers are dead and their slot rows. Called before any
        worker is stopped, so those died on their own. Liveness is read from the
        sentinels, not the exit codes: reading one takes it from the forkserver's
        status pipe, which the manager thread reads."""
        with self.noting:
            if self.deaths is not None or self.processes is None:
                return
            procs = {}
            for pid, p in list(self.processes.items()):
                with contextlib.suppress(ValueError):  # a closed Process object
                    procs[p.sentinel] = pid, p
            dead = dict(procs[s] for s in wait_ready(list(procs), 0))
            self.deaths = (dead, self.slots.snapshot() if self.slots is not None else {})

    def final_deaths(self) -> tuple[dict[int, int | None], Rows]:
        """Once retired: who died on their own (pid -> exit code), and the slot rows."""
        if self.deaths is None:
            return {}, self.slots.snapshot() if self.slots is not None else {}
        dead, rows = self.deaths
        return {pid: p.exitcode for pid, p in dead.items()}, rows

    def kill_stuck_start(self, limit_ns: int) -> tuple[int, list[cf.Future[Any]]] | None:
        """SIGKILL a worker of this owned process pool that has not finished starting
        (its row of the slot table is still ``STARTING``, or it has none yet) ``limit_ns``
        after the workers were asked to start: its ``worker_init_fn``, the unpickling of a
        dataset, or an import hangs. Returns its pid and the futures of the tasks sent on
        its lane, which no other worker can take (none without lanes: a worker that never
        starts holds no task then); ``None`` while every worker has started or may still."""
        if self.started_all or self.slots is None or self.processes is None or self.broken:
            return None
        if not self.launched_ns or time.monotonic_ns() - self.launched_ns <= limit_ns:
            return None
        rows = self.slots.snapshot()
        procs = list(self.processes.items())
        for pid, process in procs:
            if rows.get(pid, (Slots.STARTING,))[0] == Slots.STARTING:
                with contextlib.suppress(ValueError, OSError):  # a closed Process object; gone
                    process.kill()
                slot = getattr(process, _worker.SLOT_ATTR, -1)
                return pid, self.lanes.unanswered(slot) if self.lanes is not None else []
        self.started_all = len(procs) >= len(self.slots.rows)
        return None

    def pids(self) -> list[int]:
        self.launched()
        return sorted(list(self.processes)) if self.processes is not None else []

    def abandon_thread(self) -> None:
        """Drop a stuck thread generation: queued tasks are cancelled (a thread pool
        has no manager thread to race with), the stuck one runs on unwatched."""
        self.executor.shutdown(wait=False, cancel_futures=True)
        _forget_threads(self.executor)

    def retire(self, grace: float) -> None:
        """Shut an owned generation down without hanging on a stuck task, then remove
        the spill files of its dead workers.

        Exit codes are left to the manager thread (reading them from another thread
        races with it on forkserver's status pipe): this waits on the sentinels."""
        ex = self.executor
        if isinstance(ex, cf.ThreadPoolExecutor):
            ex.shutdown(wait=False, cancel_futures=True)
            deadline = time.monotonic() + max(grace, 0.0) + 5.0
            for t in list(getattr(ex, "_threads", ())):
                t.join(max(0.0, deadline - time.monotonic()))
            _forget_threads(ex)
            return
        self.launched()  # no worker may be forked after the shutdown
        self.note_deaths()  # before this kills any
        lanes = self.lanes
        if lanes is not None:
            lanes.stop()  # the workers stop serving and take the executor's shutdown
        procs = list((self.processes or {}).values())
        manager = self.manager or getattr(ex, "_executor_manager_thread", None)
        # The manager thread cancels the queued tasks itself: no cancel races a break.
        ex.shutdown(wait=False, cancel_futures=True)
        sentinels = {p.sentinel: p for p in procs}
        deadline = time.monotonic() + grace
        while sentinels and time.monotonic() < deadline:
            for s in wait_ready(list(sentinels), max(0.0, deadline - time.monotonic())):
                sentinels.pop(s)
        for p in sentinels.values():
            with contextlib.suppress(ValueError):  # a closed Process object
                p.kill()
        if sentinels:
            wait_ready(list(sentinels), 5.0)
        # Never started: its start failed (at interpreter exit, after it was created).
        if manager is not None and manager is not threading.current_thread() and manager.ident is not None:
            manager.join(10.0)
        if lanes is not None:
            lanes.join()
        _reply.sweep_spills([p.pid for p in procs])


_LAUNCH_WAIT = 30.0  # seconds: forking a worker takes milliseconds; a stuck forkserver is not waited on for ever


@contextlib.contextmanager
def tracker_safe() -> Iterator[None]:
    """No cyclic garbage collection while a pool is created or its processes started.

    Both call into multiprocessing's resource tracker (semaphores are registered, the
    tracker's pipe is handed to new processes). A collection that runs inside such a
    call and finalizes a retired executor's semaphore calls the tracker again from the
    same thread: CPython 3.11.7+/3.12/3.13 then refuse with ``ReentrantCallError``
    (reported as an unraisable exception, and the semaphore may leak). Collections
    wait until the section ends."""
    if not hasattr(mp_tracker, "ReentrantCallError") or not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def concurrency_of(ex: cf.Executor) -> int:
    n = getattr(ex, "_max_workers", None)
    return int(n) if isinstance(n, int) and n > 0 else os.cpu_count() or 1


def interpreter_exiting() -> bool:
    """Whether this process is exiting: its pools were retired by the exit hook below,
    or ``concurrent.futures`` began its own shutdown."""
    from concurrent.futures import process, thread

    return _exiting or bool(getattr(process, "_global_shutdown", False) or getattr(thread, "_shutdown", False))


def _forget_threads(ex: cf.Executor) -> None:
    """``concurrent.futures`` joins every executor thread at exit, without a timeout:
    drop an abandoned one from that registry, so that it dies with the process."""
    from concurrent.futures import thread as cf_thread

    registry = getattr(cf_thread, "_threads_queues", None)
    for t in list(getattr(ex, "_threads", ())):
        if registry is not None:
            registry.pop(t, None)


# Generation boxes of the pools not yet shut down (a pool removes its own).
live_boxes: dict[int, list[Generation | None]] = {}
_exiting = False  # set by the exit hook: from then on no pool starts workers


def _retire_all_at_exit() -> None:
    """Interpreter exit: stop every owned pool's workers before ``concurrent.futures``
    waits for them. Its exit hook joins each pool's manager thread, which waits for
    running tasks: a worker stuck in a sample would hang the exit, Ctrl-C included.
    Threading exit hooks run newest first, and this one is registered after that
    module's (imported above), so it runs first and kills what is still running.
    From then on no pool makes a generation: the tasks those workers held come back
    lost, and a retry must not fork new workers while the process exits (they would
    start after its semaphores are gone and die printing a ``FileNotFoundError``)."""
    global _exiting
    _exiting = True
    for box in list(live_boxes.values()):
        gen, box[0] = box[0], None
        if gen is not None and gen.owned and gen.processes is not None:
            gen.retire(grace=0.1)


threading._register_atexit(_retire_all_at_exit)  # type: ignore[attr-defined]

_exit_hook_pid = 0


def _retire_at_child_exit() -> None:
    """In a ``multiprocessing`` child, retire our pools before the child's exit joins
    its children. When a child's target returns or raises, ``multiprocessing.util``'s
    exit function joins every non-daemonic child it started (our workers included) before
    any ``atexit`` or threading exit hook runs: without this, a child that still holds a
    loader never exits. Its finalizers with an exit priority run before that join, so
    one is registered in each process that creates a pool (a fork clears them)."""
    global _exit_hook_pid
    if _exit_hook_pid != os.getpid():
        _exit_hook_pid = os.getpid()
        mp_util.Finalize(None, _retire_all_at_exit, exitpriority=100)


def _terminate_noted(gen: weakref.ref[Generation], process: weakref.ref[Any]) -> None:
    """A worker's ``terminate()`` (the manager thread's, at a break): the dead first."""
    g, p = gen(), process()
    if g is not None:
        g.note_deaths()
    if p is not None:
        type(p).terminate(p)


class _Numbered:
    """The context a generation's executor is given: each process it makes carries its
    number (``0 .. n-1``, in the order made), the worker's row of the slot table and its
    lane. It travels with the process object (pickled, or inherited by a fork), so no
    worker takes a shared lock as it starts: one killed holding it (a crash's survivors,
    a stuck start) would leave it held, and every later pool waiting on it for ever."""

    def __init__(self, ctx: BaseContext) -> None:
        self._ctx: Any = ctx  # one of multiprocessing's contexts (the base type has no Process)
        self._made = itertools.count()

    def Process(self, *args: Any, **kwargs: Any) -> Any:  # the name the executor calls
        process = self._ctx.Process(*args, **kwargs)
        setattr(process, _worker.SLOT_ATTR, next(self._made))
        return process

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_ctx", "_made"):  # copy and pickle look before __init__
            raise AttributeError(name)
        return getattr(self._ctx, name)


def _after_fork_in_child() -> None:
    """A child forked from this process inherits its pools and its forkserver's
    bookkeeping, none of which it owns: without this it would kill its parent's workers
    at exit, and its first pool would fail with ``ChildProcessError``."""
    global _exiting
    _exiting = False  # a child forked while its parent exits is not exiting itself
    for box in live_boxes.values():
        box[0] = None
    live_boxes.clear()
    _forkserver.after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)

"""The dispatcher: runs one unit of work on the pool until it succeeds, fails in user
code, or exhausts its retries; owns the timeout watchdog of the work it runs.

It knows nothing of pool kinds. A task's timeout counts from when it is *due*: when its
worker could start it (see :meth:`WorkerPool.due_at`), not when it was queued. A pool of
worker processes enforces it itself, for every task sent with a timeout, so a task
whose run ended (abandoned) is still stopped; elsewhere the watchdog here asks the
pool since when a task is due and has it stopped. A task that lasts (a shard) brings
its own clock: since when it owes the consumer something. A lost task is
resubmitted, and charged against ``max_retries`` only when its own worker died holding
it; a task that reaches a borrowed executor's worker before the loader's payload does
is resubmitted once with the payload attached.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from .._pool import Job, Lost, WorkerPool, describe_exit
from .._stats import Recorder
from .._worker import tasks as _tasks
from .._worker.slots import torch_crash_words
from ..errors import LoaderClosedError, LoaderTimeout, WorkerCrashedError, add_note

__all__ = ["Dispatcher", "Named", "Raised", "Split", "Unsent", "cancelling"]

_task_ids = itertools.count(1)
# A worker that has not finished starting max(timeout, this) after its pool was asked to
# start is stuck there (a worker_init_fn that never returns, a hung import): a start
# may take a few seconds (a spawned interpreter importing torch) where a batch does not.
START_FLOOR_S = 30.0


class Raised:
    """``SystemExit``/``KeyboardInterrupt`` from user code: carried to the consumer as
    a value, because raised inside a task it would stop the event loop itself."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class Split(Exception):
    """Dispatcher → group or isolation stage, never to a user: the task of several units
    (or items) was lost to its own dying worker, or overran; ``why`` says which."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


class Unsent(Exception):
    """Dispatcher → isolation stage, never to a user: the task of one item could not be
    pickled to travel to a worker; ``exc`` is pickle's error, with a note naming the item."""

    def __init__(self, exc: BaseException) -> None:
        super().__init__(str(exc))
        self.exc = exc


class Named(Protocol):
    """What names a unit of work in errors (a unit is one)."""

    @property
    def label(self) -> str: ...

    @property
    def indices(self) -> Any: ...


@dataclass(eq=False)
class Dispatcher:
    """Runs tasks on a pool until they succeed, fail in user code, or exhaust retries.

    Shared by epoch runs and streams. Owns the timeout watchdog of the tasks it runs.
    A task object must have a ``task_id`` attribute; ``make_task(task_id, with_payload)``
    builds a fresh one for every (re)submission.
    """

    pool: WorkerPool
    recorder: Recorder
    timeout: float | None
    max_retries: int
    is_closed: Callable[[], bool]
    alone: bool = False  # each task holds its worker for long (shards): one a worker, nothing behind it
    # The face whose work this runs ("DataLoader", "StreamLoader", "Batcher"): only a
    # DataLoader's crash message adds torch's words for a dead worker.
    kind: str = "DataLoader"
    stopping: bool = False
    _running: dict[int, Job] = field(default_factory=dict)
    # task id -> its own clock (see run's ``owing``), for the tasks that bring one
    _clocks: dict[int, Callable[[], int | None]] = field(default_factory=dict)
    # task id -> why it was not delivered (the end of its LoaderTimeout's message)
    _timed_out: dict[int, str] = field(default_factory=dict)
    _watchdog: asyncio.Task[None] | None = None
    _starting: asyncio.Future[Any] | None = None  # the one pool.start every waiting task shares

    def stop(self) -> list[asyncio.Task[None]]:
        """Mark the dispatcher as stopping; returns the watchdog task to cancel and await."""
        self.stopping = True
        w = self._watchdog
        self._watchdog = None
        return [w] if w is not None and not w.done() else []

    def jobs(self) -> list[Job]:
        """The jobs of the tasks running now."""
        return list(self._running.values())

    async def _start(self, loop: asyncio.AbstractEventLoop) -> Any:
        """``pool.start()`` in a thread, once for all the tasks that find the pool not
        started: they resume in the order they asked, so the first unit of the run is
        the first one submitted (and goes to the first worker up)."""
        fut = self._starting
        if fut is None or fut.done():
            fut = self._starting = loop.run_in_executor(None, self.pool.start)
            fut.add_done_callback(_retrieved)  # every waiter may have been cancelled
        return await asyncio.shield(fut)

    async def run(
        self,
        fn: Callable[[Any], Any],
        make_task: Callable[[int, bool], Any],
        named: Named,
        *,
        split: bool = False,
        unsent: bool = False,
        on_part: Callable[[Job, Any], None] | None = None,
        owing: Callable[[], int | None] | None = None,
    ) -> Any:
        """Submit ``fn(make_task(task_id, with_payload))`` and return its result.

        ``named.label`` names the work in error messages ("batch 3 of epoch 0") and
        ``named.indices`` its samples; both are read only when needed (this runs for
        every batch). ``split``: the task is several units (a group) or items (a
        micro-batch); its worker dying while it held the task, the task overrunning
        its timeout, or the task not pickling, raises :class:`Split` instead, so that
        they run again one per task and only the culprit is charged or named.
        ``unsent``: a task that does not pickle raises :class:`Unsent` (the part of a
        micro-batch run alone), not pickle's error itself.

        A task that lasts talks with its consumer: ``on_part`` takes its messages (see
        :meth:`~aioloader.WorkerPool.send`), and ``owing()`` says since when
        (``time.monotonic_ns()``) it owes the consumer something, or ``None``: the
        timeout counts from there rather than from the task's start.
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
            if not pool.ready():
                try:
                    await self._start(loop)
                except RuntimeError as exc:  # the loop's default executor is shut down
                    if self.is_closed() or pool.closed:
                        raise LoaderClosedError("the loader was closed while this batch was pending") from exc
                    raise
            task = make_task(next(_task_ids), with_payload)
            task_id = task.task_id
            submit_ns = time.monotonic_ns()
            timeout = self.timeout if owing is None else None  # a clock of its own: watched here
            job = pool.send(fn, task, alone=self.alone, on_part=on_part, timeout=timeout)
            self._running[task_id] = job
            if owing is not None:
                self._clocks[task_id] = owing
            try:
                res = await pool.result(job)
            except Lost as lost:
                if self.is_closed():
                    raise LoaderClosedError("the loader was closed while this batch was pending") from None
                why = self._timed_out.get(task_id)
                if why is None and lost.timed_out is not None:
                    why = self._overran(lost.timed_out)
                if split and why is not None:
                    raise Split(f"overran timeout={self.timeout} s") from None
                if split and lost.charged:
                    raise Split("was lost to a dying worker") from None
                if why is not None:
                    raise self._timeout_error(named, why) from None
                if lost.charged:
                    attempts += 1
                    if attempts > self.max_retries:
                        code, indices = lost.code, named.indices
                        raise WorkerCrashedError(
                            f"{_name(named)} was lost to a dying worker "
                            f"{attempts} times (exit code {describe_exit(code)}); max_retries={self.max_retries}"
                            + self._crash_words(lost.pid, code),
                            indices=_as_list(indices),
                            exitcode=code,
                            attempts=attempts,
                        ) from lost
                self.recorder.retries += 1
                continue
            except Exception as exc:
                if self.is_closed():
                    raise LoaderClosedError("the loader was closed while this batch was pending") from exc
                if not job.unsent:
                    raise
                if split:
                    raise Split("did not pickle as a whole") from None
                add_note(exc, f"aioloader: {_name(named)} could not be pickled to travel to a worker")
                if unsent:
                    raise Unsent(exc) from None
                raise
            finally:
                self._running.pop(task_id, None)
                self._clocks.pop(task_id, None)
                self._timed_out.pop(task_id, None)
            if isinstance(res, str) and res == _tasks.NEED_PAYLOAD:
                with_payload = True
                self.recorder.retries += 1
                continue
            self.recorder.finished(res.pid, res.start_ns, res.end_ns, submit_ns, time.monotonic_ns(), named)
            return res

    def _crash_words(self, pid: int | None, code: int | None) -> str:
        """The end of a crash message: torch's words for a DataLoader (tools match on
        them), the dead worker's pid for the other faces."""
        if self.kind == "DataLoader":
            return ". " + torch_crash_words(pid, code)
        return "" if pid is None else f"; the last worker to die was pid {pid}"

    def _timeout_error(self, named: Named, why: str) -> LoaderTimeout:
        return LoaderTimeout(
            f"{_name(named)} was not delivered {why}", indices=_as_list(named.indices), timeout=self.timeout
        )

    def _overran(self, how: str) -> str:
        return f"within timeout={self.timeout} s of being due; {how}"

    async def _watch(self, timeout: float) -> None:
        """One timer for the run, not one per task: every ``period`` it looks at the
        tasks the pool does not time itself (a shard's own clock, the loader's thread,
        a borrowed executor) and at workers stuck in their start."""
        pool = self.pool
        period = min(0.05, timeout / 4)
        limit = int(timeout * 1e9)
        while True:
            await asyncio.sleep(period)
            self.expire_stuck_start()
            now = time.monotonic_ns()
            for task_id, job in list(self._running.items()):
                if task_id in self._timed_out or job.timeout_ns:  # the pool's own watch
                    continue
                clock = self._clocks.get(task_id)
                due = pool.due_at(job) if clock is None else clock()
                if due is None or now - due <= limit:
                    continue
                await self.expire(task_id)

    def expire_stuck_start(self) -> None:
        """A worker still starting max(timeout, START_FLOOR_S) seconds after it was
        started is killed and replaced; the tasks sent to it then raise
        :class:`~aioloader.LoaderTimeout`."""
        if self.timeout is None:
            return
        limit = max(self.timeout, START_FLOOR_S)
        try:
            stuck = self.pool.kill_stuck_start(int(limit * 1e9))
        except LoaderClosedError:  # its tasks end with that error
            return
        if stuck is None:
            return
        pid, jobs, what = stuck
        why = (
            f"because worker pid {pid} had not finished starting {limit:g} s after the pool started "
            f"(a start may take max(timeout, {START_FLOOR_S:g} s)): {what}; it was killed and replaced"
        )
        held = {id(j) for j in jobs}
        for task_id, job in self._running.items():
            if id(job) in held and task_id not in self._timed_out:
                self._timed_out[task_id] = why

    async def expire(self, task_id: int) -> bool:
        """Stop running task ``task_id`` for overrunning the timeout: its :meth:`run`
        raises :class:`~aioloader.LoaderTimeout`. Returns whether it was stopped (not
        if it finished first)."""
        job = self._running.get(task_id)
        if job is None or task_id in self._timed_out:
            return False
        self._timed_out[task_id] = self._overran("the pool stopped it")
        how = await asyncio.get_running_loop().run_in_executor(None, self.pool.stop, job)
        if how is None:  # it finished between our look and the stop: no timeout
            self._timed_out.pop(task_id, None)
            return False
        self._timed_out[task_id] = self._overran(how)
        return True


def _name(named: Named) -> str:
    """``"batch 3 of epoch 0 (sample indices [...])"``; the label alone without indices,
    or when it names them itself (``names_indices``: a request, an item run alone)."""
    indices = named.indices
    if not len(indices) or getattr(named, "names_indices", False):
        return named.label
    return f"{named.label} (sample indices {_short(indices)})"


def _as_list(indices: Any) -> list[int]:
    return [int(i) for i in indices]


def _short(indices: Any, limit: int = 16) -> str:
    ids = _as_list(indices)
    if len(ids) <= limit:
        return str(ids)
    return f"{ids[:limit]}... ({len(ids)} samples)"


def _retrieved(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()


def cancelling() -> bool:
    """Is the current task itself being cancelled (as opposed to something it awaited)?

    Python 3.10 has no ``Task.cancelling()``: there the answer is "no", and callers must
    tell their own shutdown apart by their own flags (the dispatcher's ``stopping``, the
    loader's closed flag), which are set before anything is cancelled."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)
    return bool(cancelling()) if cancelling is not None else False

"""The dispatcher: runs one unit of work on the pool until it succeeds, fails in user
code, or exhausts its retries; owns the timeout watchdog of the work it runs.

Crash handling: a task whose worker died is resubmitted (and charged against
``max_retries`` only when it was the one running on the dead worker); a task that reaches
a borrowed executor's worker before the loader's payload does is resubmitted once with
the payload attached.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from typing import Any

from . import _worker
from ._pool import Generation, WorkerPool
from ._stats import Recorder
from .errors import LoaderClosedError, LoaderTimeout, WorkerCrashedError

__all__ = ["Dispatcher", "cancelling"]

_task_ids = itertools.count(1)

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
                                " script or the dataset's module (guard a script's entry point with"
                                " if __name__ == '__main__'); their traceback is on stderr"
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


def cancelling() -> bool:
    """Is the current task itself being cancelled (as opposed to something it awaited)?

    Python 3.10 has no ``Task.cancelling()``: there the answer is "no", and callers must
    tell their own shutdown apart by their own flags (the dispatcher's ``stopping``, the
    loader's closed flag), which are set before anything is cancelled."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)
    return bool(cancelling()) if cancelling is not None else False

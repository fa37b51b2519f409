"""The pool's two backends without owned processes: the loader's own thread
(``num_workers=0``), and a borrowed executor.

:class:`Thread` runs jobs one at a time on a daemon thread of this process. A job
that overran its timeout is abandoned: a new thread takes the queue, and the old one
ends when the user's code returns (its outcome is dropped).

:class:`Borrowed` is the one adapter to any ``concurrent.futures.Executor`` a user
lends (the stdlib's process or thread pools, dask's client executor): ``submit`` and
a done callback. Its errors are mapped here and nowhere else. What it cannot do: it
cannot say which task a dead worker held (a broken executor fails every task it had,
and ends the loader with :class:`~aioloader.PoolBrokenError`), replace one worker, or
stop a running task (a timeout abandons it).
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import queue
import threading
import time
from typing import Any

from .._worker import channel as _channel
from .._worker import reply as _reply
from ..errors import PoolBrokenError
from .jobs import Job, Lost

__all__ = ["Borrowed", "Thread"]


class Thread:
    """One background thread of this process runs the jobs, in order."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._running: Job | None = None
        self._link: _ThreadLink | None = None  # the running job's, if it talks with its consumer
        self.closed = False
        self.fatal: Exception | None = None  # never: a thread cannot break

    @property
    def started(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        with self._lock:
            if self._thread is None and not self.closed:
                self._new_thread()

    def _new_thread(self) -> None:
        t = threading.Thread(target=self._serve, name="aioloader-worker", daemon=True)
        self._thread = t
        t.start()

    def _serve(self) -> None:
        me = threading.current_thread()
        while True:
            job = self._queue.get()
            if job is None or self._thread is not me:
                if job is not None:
                    self._queue.put(job)  # the thread that took over runs it
                return
            if job.done:
                continue
            if not job.begins():  # cancelled by its submitter before it ran
                job.settle(lost=Lost())
                continue
            link = None if job.on_part is None else _ThreadLink(job)
            job.sent_ns = time.monotonic_ns()  # due from now: the thread takes it
            with self._lock:
                self._running = job
                self._link = link
            fn, args = job.fn, job.args
            _channel.set_link(link)
            try:
                outcome = fn(*args)
                if not isinstance(outcome, _reply.Outcome):
                    outcome = _reply.Outcome(True, outcome)
            except BaseException as exc:  # the Executor face's own functions
                outcome = _reply.Outcome(False, exc)
            finally:
                _channel.set_link(None)
            del fn, args
            with self._lock:
                if self._running is job:
                    self._running = self._link = None
                current = self._thread is me
            job.settle(outcome)
            if not current:
                return  # abandoned while it ran: its successor serves the queue

    def submit(self, job: Job) -> None:
        if self.closed:
            job.settle(lost=Lost())
            return
        self._queue.put(job)

    def tell(self, job: Job, message: Any) -> bool:
        with self._lock:
            link = self._link
            if link is None or link.job is not job or job.done:
                return False
        link.inbox.put(message)
        return True

    def due_at(self, job: Job) -> int | None:
        with self._lock:
            if self._running is not job or job.done:
                return None
        return job.sent_ns

    def stop(self, job: Job) -> str | None:
        with self._lock:
            if self._running is not job or job.done:
                return None
            self._running = None
            link, self._link = self._link, None
            self._new_thread()  # takes the queue; the stuck one ends when its sample returns
        job.stopped = True
        job.settle(lost=Lost())
        if link is not None:
            link.inbox.put(None)  # a stuck shard ends at its next credit wait
        return "the stuck thread was abandoned (it ends when its sample returns)"

    def close(self, grace: float) -> None:
        with self._lock:
            self.closed = True
            t = self._thread
            link = self._link
        if link is not None:
            link.inbox.put(None)  # a shard ends at its next credit wait
        self._queue.put(None)
        if t is not None and t is not threading.current_thread():
            t.join(max(grace, 0.0) + 5.0)
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                job.settle(lost=Lost())


class _ThreadLink:
    """The running job's link on the loader's thread (see
    :func:`aioloader._worker.channel.current_link`): its messages go to the job as they
    are (nothing is pickled), and what it is told waits in a queue."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()

    def send(self, message: Any) -> None:
        on_part = self.job.on_part
        if on_part is not None:
            on_part(self.job, message)

    def recv(self) -> Any:
        return self.inbox.get()


class Borrowed:
    """A user's executor, through ``submit`` and a done callback (see module doc)."""

    def __init__(self, executor: cf.Executor) -> None:
        self.executor = executor
        self.closed = False
        self.started = True  # the user's: running already
        self.fatal: Exception | None = None  # its own break is each job's (see _done)
        self._futures: dict[int, cf.Future[Any]] = {}

    def start(self) -> None:
        pass

    def submit(self, job: Job) -> None:
        if not job.begins():  # cancelled by its submitter already
            job.settle(lost=Lost())
            return
        try:
            fut = self.executor.submit(job.fn, *job.args)
        except Exception as exc:
            job.settle(lost=Lost(fatal=_refused(exc)))
            return
        self._futures[id(job)] = fut
        fut.add_done_callback(functools.partial(self._done, job))

    def _done(self, job: Job, fut: cf.Future[Any]) -> None:
        self._futures.pop(id(job), None)
        if fut.cancelled():
            job.settle(lost=Lost())
            return
        exc = fut.exception()
        if isinstance(exc, cf.BrokenExecutor):
            job.settle(lost=Lost(fatal=_broken(exc)))
        elif exc is not None:  # the executor's own verdict (dask's KilledWorker, an unpicklable task)
            job.settle(_reply.Outcome(False, exc))
        else:
            value = fut.result()
            job.settle(value if isinstance(value, _reply.Outcome) else _reply.Outcome(True, value))

    def due_at(self, job: Job) -> int | None:
        return None if job.done else job.submit_ns

    def stop(self, job: Job) -> str | None:
        fut = self._futures.get(id(job))
        if fut is None or job.done:
            return None
        if isinstance(self.executor, cf.ThreadPoolExecutor) and fut.cancel():
            how = "it was cancelled on the borrowed executor before it started"
        else:
            how = "the borrowed executor's task could not be stopped; it was abandoned"
        job.stopped = True
        job.settle(lost=Lost())
        return how

    def close(self, grace: float) -> None:
        self.closed = True  # never shut down: it is the user's


def _broken(exc: BaseException) -> PoolBrokenError:
    err = PoolBrokenError(
        "a worker of the user-supplied executor died and aioloader may not rebuild an executor it "
        f"does not own; create a new executor and loader ({type(exc).__name__}: {exc})"
    )
    err.__cause__ = exc
    return err


def _refused(exc: BaseException) -> PoolBrokenError:
    if isinstance(exc, cf.BrokenExecutor):
        return _broken(exc)
    err = PoolBrokenError(f"the user-supplied executor refused new work: {exc}")
    err.__cause__ = exc
    return err


"""A task's submission as the pool tracks it (:class:`Job`), and how a lost one ends
(:class:`Lost`). Shared by every backend of the pool.

This module never imports asyncio at run time: a job wakes its awaiting task through
the loop's :class:`~aioloader._wake.Waker`, from whichever thread settles it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from .._wake import Waker
from .._worker.reply import Outcome

__all__ = ["Job", "Lost"]

_settling = threading.Lock()  # one for all jobs: held for two assignments, never contended long


class Lost(Exception):
    """Pool → dispatcher, never to a user: the task did not come back.

    ``charged``: its worker died while it held it (exit ``code``, ``pid``); otherwise it
    was stopped (a timeout), the pool closed, or ``fatal`` says why no worker can run
    anything (every task of the pool gets the same error). ``timed_out``: the pool
    stopped it for its own ``timeout`` and says what hung."""

    def __init__(
        self,
        *,
        charged: bool = False,
        code: int | None = None,
        pid: int | None = None,
        fatal: Exception | None = None,
        timed_out: str | None = None,
    ) -> None:
        super().__init__("the task's worker is gone")
        self.charged = charged
        self.code = code
        self.pid = pid
        self.fatal = fatal
        self.timed_out = timed_out


class Job:
    """One submission of one task: what to run, and, once settled, its outcome."""

    __slots__ = (
        "__weakref__", "alone", "args", "callback", "done", "fn", "frame", "gate", "lost", "on_part", "outcome",
        "sent_ns", "seq", "stopped", "submit_ns", "task_id", "timeout_ns", "unsent", "waiter", "waker", "why_stopped",
        "worker",
    )  # fmt: skip

    def __init__(
        self, fn: Callable[..., Any], args: tuple[Any, ...], task_id: int | None = None
    ) -> None:
        self.fn = fn
        self.args = args
        self.frame: Any = None  # its pickle, made before it waits for a worker (a backend's own)
        self.task_id = task_id
        self.alone = False  # it holds its worker for long: nothing may wait behind it
        # The running task's messages (its link's ``send``), from whichever thread reads
        # them, in the order sent and before the job settles: ``on_part(job, message)``.
        self.on_part: Callable[[Job, Any], None] | None = None
        self.submit_ns = time.monotonic_ns()
        self.outcome: Outcome | None = None
        self.lost: Lost | None = None
        self.done = False
        self.stopped = False  # a timeout stopped it: it ends Lost, uncharged, not run again
        self.why_stopped = ""  # what hung, when the pool stopped it for its own timeout
        self.timeout_ns = 0  # the pool stops it once it has been due this long (0: never)
        self.unsent = False  # it could not be pickled: its error is from here, not a worker
        self.worker: Any = None  # where it was sent (a backend's own record), if anywhere
        self.seq = -1  # its number on that worker's channel
        self.sent_ns = 0  # when it was written to that channel (or a thread took it)
        self.waiter: Any = None  # the asyncio future the awaiting task waits on
        self.waker: Waker | None = None
        self.callback: Callable[[Job], None] | None = None  # the Executor face's future
        # The Executor face's ``Future.set_running_or_notify_cancel``: asked once, as the
        # job first leaves for a worker; false means its submitter cancelled it.
        self.gate: Callable[[], bool] | None = None

    def begins(self) -> bool:
        """May the job go to a worker now? Always, but for a job whose submitter
        cancelled it before any worker took it (then it never runs)."""
        gate = self.gate
        if gate is None:
            return True
        self.gate = None  # once: a job sent again after a death is running already
        return gate()

    def settle(self, outcome: Outcome | None = None, lost: Lost | None = None) -> bool:
        """Give the job its outcome (or say it is lost), once; wakes whoever waits.
        Returns whether this call settled it."""
        with _settling:
            if self.done:
                return False
            self.outcome, self.lost, self.done = outcome, lost, True
        self.fn = self.args = None  # type: ignore[assignment]  # nothing kept past its end
        self.wake()
        cb = self.callback
        if cb is not None:
            cb(self)
        return True

    def wake(self) -> None:
        waker, waiter = self.waker, self.waiter
        if waker is not None and waiter is not None:
            waker.wake(waiter)

"""Submitting to an owned process pool without a trip through the executor's threads.

``ProcessPoolExecutor.submit`` records a work item and wakes the executor's manager
thread; that thread moves the item onto the call queue, whose feeder thread pickles it
and writes it to the pipe the workers read. Three threads of the consumer's process take
their turn, under one interpreter lock, for every task before a worker can start it. On
small batches those turns are a large part of what a batch costs the consumer.

:class:`DirectSubmit` does the executor's bookkeeping itself, under the executor's own
lock (the same work item, id and pending-items entry as ``submit``), then pickles the
call item and writes it to the workers' pipe from the submitting thread, when that can
neither block nor starve the manager thread:

* nothing is waiting in the executor's own queue or in the call queue's feeder buffer
  (first come, first served; but for a task the feeder thread is pickling at that very
  moment, which the direct one may overtake);
* the call queue has a slot for this item *and one more*: the manager thread looks for a
  free slot before it takes one and then waits for it, so a slot it saw must stay free;
* the pipe can take the message now: its unread bytes (``FIONREAD``) plus the message and
  two pages of slack fit in its capacity (``F_GETPIPE_SZ``), so the write never waits
  for a worker to read;
* the call queue's write lock is free (its feeder thread is not writing).

Otherwise the task takes the executor's way: queued and the manager woken, or, once
pickled, handed to the call queue's feeder thread (which writes it when a worker has
read enough). Workers receive the same call item either way; results, breaks, timeouts
and shutdown stay the executor's business. A pool breaking while a task is submitted
here can leave its future unsettled, as it can with ``submit`` itself: the pool reports
such a future lost once it retires the generation (``_pool._release_stranded``).

Private names read, besides those listed in :mod:`aioloader._generation`:
``ProcessPoolExecutor._shutdown_lock``, ``_broken``, ``_shutdown_thread``,
``_queue_count``, ``_pending_work_items``, ``_work_ids``,
``_executor_manager_thread_wakeup``, ``_call_queue``; ``concurrent.futures.process``'s
``_WorkItem``, ``_CallItem``; ``multiprocessing.Queue``'s ``_sem``, ``_wlock``,
``_reader``, ``_writer``, ``_notempty``, ``_buffer``, ``_thread``, ``_start_thread``,
``_on_queue_feeder_error``.

``AIOLOADER_DIRECT_SUBMIT=0`` turns this off (every task goes through ``submit``).
"""

from __future__ import annotations

import concurrent.futures as cf
import fcntl
import os
import pickle
import struct
import sys
import termios
import threading
from concurrent.futures import process as cf_process
from multiprocessing.reduction import ForkingPickler
from typing import Any

__all__ = ["ENV", "DirectSubmit"]

ENV = "AIOLOADER_DIRECT_SUBMIT"
_F_GETPIPE_SZ = 1032  # Linux's fcntl command for a pipe's capacity
_SLACK = 2 * 4096  # a partly read page at the head and a partly written one at the tail
_NEEDED = (
    "_shutdown_lock", "_broken", "_shutdown_thread", "_queue_count", "_pending_work_items", "_work_ids",
    "_executor_manager_thread", "_executor_manager_thread_wakeup", "_call_queue",
)  # fmt: skip


class _Pickled:
    """A call item pickled already, handed to the feeder thread: it travels as its bytes
    and unpickles, in the worker, as the call item."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data  # bytes: ForkingPickler.dumps returns a memoryview, which cannot pickle

    def __reduce__(self) -> tuple[Any, ...]:
        return (pickle.loads, (self.data,))


class DirectSubmit:
    """Direct submission to one ``ProcessPoolExecutor`` (see the module doc); ``direct``
    and ``queued`` count the tasks that went each way."""

    def __init__(self, ex: cf.ProcessPoolExecutor, capacity: int) -> None:
        self.ex = ex
        self.queue: Any = ex._call_queue  # type: ignore[attr-defined]
        self.capacity = capacity
        self.lock = threading.Lock()  # one direct writer at a time
        self.direct = 0
        self.queued = 0

    @classmethod
    def of(cls, ex: cf.ProcessPoolExecutor) -> DirectSubmit | None:
        """The direct path for ``ex``, or ``None`` where it cannot be taken (turned off,
        not Linux, or an executor without the internals it needs)."""
        if os.environ.get(ENV, "1").strip() == "0" or not sys.platform.startswith("linux"):
            return None
        if not all(hasattr(ex, name) for name in _NEEDED):
            return None
        q: Any = getattr(ex, "_call_queue", None)
        if not all(hasattr(q, n) for n in ("_sem", "_wlock", "_reader", "_writer", "_notempty", "_buffer")):
            return None
        if not all(hasattr(cf_process, n) for n in ("_WorkItem", "_CallItem", "_global_shutdown")):
            return None
        try:
            capacity = fcntl.fcntl(q._writer.fileno(), _F_GETPIPE_SZ)
        except (OSError, AttributeError):
            return None
        return cls(ex, capacity)

    def submit(self, fn: Any, *args: Any) -> cf.Future[Any]:
        """``executor.submit(fn, *args)``, written to the workers' pipe when it can be."""
        ex: Any = self.ex
        if ex._executor_manager_thread is None:  # a manager that ended left the pool broken or shut down
            first: cf.Future[Any] = ex.submit(fn, *args)  # it starts the manager thread
            return first
        q = self.queue
        with self.lock:
            with ex._shutdown_lock:
                if ex._broken:
                    raise cf_process.BrokenProcessPool(ex._broken)
                if ex._shutdown_thread:
                    raise RuntimeError("cannot schedule new futures after shutdown")
                if cf_process._global_shutdown:
                    raise RuntimeError("cannot schedule new futures after interpreter shutdown")
                fut: cf.Future[Any] = cf.Future()
                work_id = ex._queue_count
                ex._queue_count += 1
                ex._pending_work_items[work_id] = cf_process._WorkItem(fut, fn, args, {})
                room = ex._work_ids.empty() and not q._buffer and q._sem.acquire(False)
                if room and q._sem._semlock._is_zero():  # that was the manager's slot
                    q._sem.release()
                    room = False
                if not room:
                    ex._work_ids.put(work_id)
                    ex._executor_manager_thread_wakeup.wakeup()
                    self.queued += 1
                    return fut
                fut.set_running_or_notify_cancel()  # as the manager marks what it queues
            self._send(cf_process._CallItem(work_id, fn, args, {}))
        return fut

    def _send(self, item: Any) -> None:
        """Write ``item`` (its call-queue slot taken) to the pipe, or give it to the
        feeder thread; a pickling error fails its future, as the feeder thread does."""
        q = self.queue
        try:
            data = ForkingPickler.dumps(item)
        except Exception as exc:
            q._sem.release()
            q._on_queue_feeder_error(exc, item)
            return
        if q._wlock.acquire(False):
            try:
                if self._fits(len(data) + 4):
                    q._writer.send_bytes(data)
                    self.direct += 1
                    return
            except OSError:
                # The pool broke under us (the executor closed its end of the pipe, or no
                # worker is left to read): the manager settles or strands the future.
                return
            finally:
                q._wlock.release()
        self.queued += 1
        with q._notempty:
            if q._thread is None:
                q._start_thread()
            q._buffer.append(_Pickled(bytes(data)))
            q._notempty.notify()

    def _fits(self, size: int) -> bool:
        fd = self.queue._reader.fileno()  # raises OSError once the executor closed it
        (unread,) = struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))
        return bool(unread + size + _SLACK <= self.capacity)

"""An owned pool's worker processes: one channel each, one I/O thread for all.

Each worker has one duplex channel (a Unix socket pair, :mod:`aioloader._worker.channel`) and
a row of the pool's slot table (:mod:`aioloader._worker.slots`). One thread of the consumer
(``aioloader-pool``) reads every channel, settles the jobs, writes what a socket could
not take at once, and watches every worker for its death.

Sending. A job goes to the worker with the fewest unanswered jobs: at most two while
tasks are short (one running, one waiting in its socket: no idle gap between two) and
one once they take :data:`LONG_NS` or more. A job sent ``alone`` (an iterable dataset's
shard, which holds its worker for the epoch) goes only to an idle worker, and nothing
is queued behind it. Beyond that it waits here, and goes out the
moment a worker answers, from the I/O thread. A worker runs its channel's tasks in
order, so a reply answers the oldest unanswered job of that channel.

A death. The worker's process says it (the zygote's report with its exit code, or the
sentinel of a process multiprocessing started). Replies it wrote first are read. Its
row in the slot table names the task it held (``seq``, phase ``ACCEPTED`` or later):
that job is lost, *charged* with the exit code. The other jobs it had not started go
back to the front of the queue, uncharged. A job stopped by a timeout ends lost,
uncharged. Then a new worker takes the same slot; the other workers keep their pids
and their jobs. Workers that die before they finish starting, :data:`MAX_START_FAILURES`
times in a row, end in a ``PoolBrokenError`` for every job.

Timeouts. A job sent with a timeout is *due* once its worker could start it: when it
was sent to a worker with nothing else, when the job ahead of it was answered, or when
a worker that was starting finished its start. The I/O thread looks at each worker's
oldest job every tick (while timed jobs are out); one due for longer than its timeout
is stopped: its worker is killed (a stopped process too) and replaced, and the job
ends lost with an account of what hung, read from the slot table. A job waiting
behind another is not due, so a long but healthy job ahead costs it nothing. A
loader whose payload hung while a worker loaded it (its unpickling, its
``worker_init_fn``) reaches the workers started after that lazily, with its first task,
so that it does not hold up every start.

Starting. From the zygote (:mod:`aioloader._pool.zygote`) where there is one: a
request, no wait. Otherwise multiprocessing starts the process (``ctx.Process``).
Loaders' payloads go as the channel's first frame, or as the process's arguments
(those holding multiprocessing primitives can travel only that way).
"""

from __future__ import annotations

import collections
import contextlib
import mmap
import os
import pickle
import selectors
import signal
import socket
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from multiprocessing.context import BaseContext
from typing import Any

from .. import _mainguard
from .._worker import byvalue as _byvalue
from .._worker import channel as _channel
from .._worker import reply as _reply
from .._worker import tasks as _tasks
from .._worker.channel import HEAD, PART, READ, SIZE
from .._worker.slots import SharedTable, Slots, describe_exit
from ..errors import PoolBrokenError
from . import zygote as _zygote
from .jobs import Job, Lost

# What multiprocessing imports when it starts its first process: imported with the pool
# instead, not inside the first iteration's time to its first batch.
with contextlib.suppress(ImportError):
    import multiprocessing.connection
    import multiprocessing.forkserver
    import multiprocessing.popen_fork
    import multiprocessing.popen_forkserver
    import multiprocessing.popen_spawn_posix
    import multiprocessing.resource_tracker
    import multiprocessing.spawn
    import multiprocessing.util  # noqa: F401

__all__ = ["DEPTH", "LONG_NS", "MAX_START_FAILURES", "TICK_NS", "Procs", "close_all"]

DEPTH = 2  # unanswered jobs a worker holds at most: one running, one waiting in its socket
LONG_NS = 3_000_000  # jobs this long (on average) go one to a worker at a time
MAX_START_FAILURES = 3
TICK_NS = 50_000_000  # how often timed jobs are looked at, at most (a quarter of the shortest timeout)
_ALPHA = 0.25  # weight of the newest job in the average
_SOCKBUF = 1 << 20  # send buffer asked of each channel's consumer end

_live: weakref.WeakSet[Procs] = weakref.WeakSet()
exiting = False  # set by the exit hook: from then on no worker starts


class _Worker:
    """One worker process as the pool sees it."""

    __slots__ = (
        "born_ns", "channel", "code", "end", "eof", "fd", "inbuf", "kill_asked", "last_ns", "out", "pid", "process",
        "ready", "replacement", "sent", "seqs", "session", "slot", "start", "starting", "tokens", "watched",
        "why_killed",
    )  # fmt: skip

    def __init__(self, slot: int, channel: socket.socket) -> None:
        self.slot = slot
        self.channel = channel
        self.fd = channel.fileno()
        self.pid = 0  # known once started (a zygote's report may come after its replies)
        self.process: Any = None  # multiprocessing's Process, where it started this one
        self.session: _zygote.Session | None = None  # the fork server's, where it started this one
        self.starting = False  # multiprocessing is starting its process, in a thread of its own
        self.replacement = False  # started after a death, not with the pool
        self.sent: collections.deque[Job] = collections.deque()  # unanswered, in channel order
        self.out: collections.deque[memoryview] = collections.deque()  # what the socket did not take yet
        self.inbuf = bytearray(READ)  # what it wrote: frames in [start, end)
        self.start = self.end = 0
        self.watched = False  # the I/O thread waits for the socket to take more
        self.seqs = 0  # jobs sent on this channel
        self.born_ns = time.monotonic_ns()
        self.last_ns = 0  # when it last answered
        self.code: int | None = None
        self.eof = False
        self.ready = False  # it answered once: past its start
        self.kill_asked = False  # killed before its pid was known: kill it when it is
        self.why_killed = ""  # the pool killed it (a timeout, a stuck start, closing)
        self.tokens: list[str] = []  # the loaders whose payloads it was given to start with, in order


class Procs:
    """The owned worker processes of one pool (see module doc)."""

    def __init__(
        self,
        n: int,
        ctx: BaseContext,
        payloads: Callable[[], dict[str, bytes | _byvalue.Inherited]],
        zygote: _zygote.Session | None,
    ) -> None:
        self.n = n
        self._ctx: Any = ctx  # one of multiprocessing's contexts (the base type has no Process)
        self._payloads = payloads
        self._zygote = zygote
        self._lock = threading.RLock()
        self._idle = threading.Condition(self._lock)  # notified as jobs leave the workers
        self._pending: collections.deque[Job] = collections.deque()
        self._unsent: list[tuple[Job, _reply.Outcome | None]] = []
        self._workers: list[_Worker | None] = [None] * n
        self._by_pid: dict[int, _Worker] = {}
        self._requests: dict[int, int] = {}  # the zygote's request number -> slot, until answered
        self._turn = 0
        self.depth = DEPTH
        self.task_ns: float | None = None
        self.restarts = 0
        # (pid, exit code) of the last workers that died on their own
        self.deaths: collections.deque[tuple[int, int | None]] = collections.deque(maxlen=64)
        self._start_failures = 0
        self._lazy: set[str] = set()  # loaders whose payload hung in a worker: not sent at start
        self._tick_ns: int | None = None  # the I/O thread's tick while timed jobs are out
        self._next_scan = 0
        self.fatal: Exception | None = None
        self.closed = False
        self.started = False
        self._pids: list[int] = []  # a snapshot, safe to read from any thread
        size = Slots.WIDTH * 8 * n
        self._table_size = size
        self._table_fd = -1
        self._table: Any
        if hasattr(os, "memfd_create"):
            self._table_fd = os.memfd_create("aioloader-slots", os.MFD_CLOEXEC)
            os.ftruncate(self._table_fd, size)
            self._table = mmap.mmap(self._table_fd, size)
            self._shared: Any = SharedTable(self._table_fd, size)  # what a Process argument carries
        else:
            self._table = self._shared = ctx.RawArray("q", Slots.WIDTH * n)
        self.slots = Slots(self._table)
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        if zygote is not None:
            self._sel.register(zygote.sock, selectors.EVENT_READ, "zygote")
        self._starters: set[threading.Thread] = set()  # starting multiprocessing's processes
        self._thread = threading.Thread(target=self._serve, name="aioloader-pool", daemon=True)
        self._ended = threading.Event()
        _live.add(self)

    # ------------------------------------------------------------------ starting
    def start(self) -> None:
        """Start every worker (each returns at once: a request to the fork server, or a
        thread that has multiprocessing start it), then the I/O thread. Tasks may be sent
        at once."""
        with self._lock:
            if self.started or self.closed:  # closed first: start nothing (its jobs end lost)
                return
            self.started = True
            for slot in range(self.n):
                self._spawn(slot)
            # Under the lock: close() sees either no thread for ever, or a running one.
            self._thread.start()
        self._settle_unsent()

    def _spawn(self, slot: int, replacement: bool = False) -> None:
        """A new worker in ``slot`` (the lock held). A failure to start it counts as a
        worker that died as it started."""
        ours, theirs_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        theirs: socket.socket | None = theirs_end
        with contextlib.suppress(OSError):
            ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCKBUF)
        ours.setblocking(False)
        w = _Worker(slot, ours)
        w.replacement = replacement
        self._workers[slot] = w
        payloads = self._payloads()
        if self._lazy:  # they come with their loader's first task instead
            payloads = {
                t: p for t, p in payloads.items() if t not in self._lazy or isinstance(p, _byvalue.Inherited)
            }
        w.tokens = list(payloads)
        inherited = any(isinstance(p, _byvalue.Inherited) for p in payloads.values())
        zygote = None if inherited else self._live_session()
        try:
            if zygote is not None:
                w.out.append(_channel.frame(payloads))  # the worker's first frame
                w.session = zygote
                self._requests[zygote.request(slot, theirs_end.fileno(), self._table_fd, self._table_size, self.n)] = slot
            else:
                if self._ctx.get_start_method() != "fork":
                    _byvalue.drop_fake_main_file()
                process = self._ctx.Process(
                    target=_tasks.worker_main,
                    args=(theirs_end, slot, self._shared, self.n, os.getpid(), payloads),
                    name=f"aioloader-worker-{slot}",
                    daemon=True,
                )
                process.start()
                w.process, w.pid = process, process.pid
                self._by_pid[w.pid] = w
        except Exception as exc:
            w.starting = False
            if theirs is not None:
                theirs.close()
            self._register(w)
            self._died(w, None, exc)  # as a worker that died as it started
            return
        finally:
            if theirs is not None:
                with contextlib.suppress(OSError):
                    theirs.close()
        self._register(w)
        self._flush_pending(w)

    def _live_session(self) -> _zygote.Session | None:
        """The pool's session with the fork server; a new one if the server died (its
        standby serves now). ``None`` if this pool has none (the lock held)."""
        old = self._zygote
        if old is None or not old.dead:
            return old
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(old.sock)
        old.close()
        new = self._zygote = _zygote.session()
        if new is not None:
            self._sel.register(new.sock, selectors.EVENT_READ, "zygote")
        return new

    def _register(self, w: _Worker) -> None:
        self._sel.register(w.fd, selectors.EVENT_READ, w)
        if w.process is not None and not w.starting:
            self._sel.register(w.process.sentinel, selectors.EVENT_READ, ("sentinel", w))
        if w.out:
            self._wake()
        self._snapshot_pids()

    def _snapshot_pids(self) -> None:
        self._pids = sorted(w.pid for w in self._workers if w is not None and w.pid)

    def pids(self) -> list[int]:
        return list(self._pids)

    # ------------------------------------------------------------------- sending
    def submit(self, job: Job) -> None:
        """Send ``job`` to a worker, or queue it. Settles it at once if the pool cannot
        run anything (closed, or fatally broken). It is pickled here, before the lock:
        a large task takes no time from the I/O thread or from other senders."""
        try:
            job.frame = _channel.frame_parts((job.fn, job.args))
        except BaseException as exc:
            traceback.clear_frames(exc.__traceback__)
            job.unsent = True
            job.settle(_reply.Outcome(False, exc))
            return
        error = None
        tick = False
        with self._lock:
            timeout = job.timeout_ns
            if timeout and (self._tick_ns is None or timeout // 4 < self._tick_ns):
                self._tick_ns = min(TICK_NS, max(timeout // 4, 1))
                tick = True
            if self.fatal is not None or self.closed:
                lost = Lost(fatal=self.fatal)
            else:
                lost = None
                w = self._least_busy()
                if w is None or self._pending or not self._takes(w, job):
                    self._pending.append(job)
                elif not job.begins():
                    lost = Lost()  # cancelled by its submitter before it went anywhere
                else:
                    error = self._send(w, job)
        if tick:
            self._wake()  # the I/O thread's wait now has an end
        if lost is not None:
            job.settle(lost=lost)
        elif error is not None:
            job.settle(error)
        self._settle_unsent()

    def _live(self) -> list[_Worker]:
        return [w for w in self._workers if w is not None]

    def _least_busy(self) -> _Worker | None:
        """The live worker with the fewest unanswered jobs; a replacement still starting last."""
        workers, n = self._workers, self.n
        best = None
        for k in range(n):
            w = workers[(self._turn + k) % n]
            if w is None or w.code is not None or w.why_killed:
                continue
            if best is None or (_waits(w), len(w.sent)) < (_waits(best), len(best.sent)):
                best = w
        self._turn += 1
        return best

    def _takes(self, w: _Worker, job: Job) -> bool:
        """May ``job`` go to ``w`` now? A job ``alone`` (a shard: it holds its worker for
        the epoch) goes only to a worker with nothing else, and nothing goes behind it.
        A replacement not up yet takes jobs only while no other worker is up: its start
        may be slow, and must not hold work that a live worker could do. (The pool's first
        workers take jobs as they start: each begins the moment it is up.)"""
        if w.code is not None or w.why_killed:
            return False
        if w.replacement and not w.ready and any(o.ready and o.code is None and not o.why_killed for o in self._live()):
            return False
        if w.sent:
            return not job.alone and not w.sent[0].alone and len(w.sent) < self.depth
        return True

    def _send(self, w: _Worker, job: Job) -> _reply.Outcome | None:
        """Write ``job`` into ``w``'s channel (the lock held). Its pickle was made as it
        was submitted; a job sent again (its worker died before it started it) is pickled
        again here. A job that cannot be pickled is not sent: its error comes back as its
        outcome, to settle once the lock is released."""
        parts, job.frame = job.frame, None
        try:
            if parts is None:
                parts = _channel.frame_parts((job.fn, job.args))
        except BaseException as exc:
            traceback.clear_frames(exc.__traceback__)
            job.unsent = True
            return _reply.Outcome(False, exc)
        job.worker, job.seq, job.sent_ns = w, w.seqs, time.monotonic_ns()
        w.seqs += 1
        w.sent.append(job)
        for part in parts:
            self._put(w, part)
        return None

    def tell(self, job: Job, message: Any) -> bool:
        """Write ``message`` to the running task of ``job`` (its link's :meth:`recv`).
        ``False`` if the job is not running on a live worker."""
        parts = _channel.frame_parts(message, PART, beside=False)
        with self._lock:
            w = job.worker
            if job.done or not isinstance(w, _Worker) or not w.sent or w.sent[0] is not job:
                return False
            if w.code is not None or w.eof or w.why_killed:
                return False
            for part in parts:
                self._put(w, part)
        return True

    def _put(self, w: _Worker, data: memoryview) -> None:
        n = 0
        if not w.out:
            with contextlib.suppress(BlockingIOError, BrokenPipeError, ConnectionResetError):
                n = os.write(w.fd, data)
            if n == len(data):
                return
        w.out.append(data[n:])
        if not w.watched:
            self._wake()

    def _flush_pending(self, w: _Worker) -> None:
        """Give ``w`` queued jobs while it has room (the lock held). A job that cannot be
        pickled, or that its submitter cancelled (``None``), waits in :attr:`_unsent` to be
        settled once the lock is released."""
        while self._pending and self._takes(w, self._pending[0]):
            job = self._pending.popleft()
            if job.done:
                continue
            if not job.begins():  # cancelled by its submitter: it ends unsent
                self._unsent.append((job, None))
                continue
            error = self._send(w, job)
            if error is not None:
                self._unsent.append((job, error))

    def _settle_unsent(self) -> None:
        """Settle the jobs that could not be pickled (the lock not held)."""
        while self._unsent:
            try:
                job, error = self._unsent.pop()
            except IndexError:
                return
            if error is None:
                job.settle(lost=Lost())  # its submitter cancelled it
            else:
                job.settle(error)

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"\0")

    # ----------------------------------------------------------------- the I/O thread
    def _serve(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # a bug here must not leave a job waiting for ever
            self._break(PoolBrokenError(f"the pool's I/O thread failed: {type(exc).__name__}: {exc}"))
        finally:
            self._ended.set()

    def _loop(self) -> None:
        while True:
            tick = self._tick_ns
            for key, events in self._sel.select(None if tick is None else tick / 1e9):
                data = key.data
                if data is None:
                    with contextlib.suppress(BlockingIOError):
                        os.read(self._wake_r, 4096)
                    if self.closed and self._all_gone():
                        return
                    self._watch()
                elif data == "zygote":
                    self._reports()
                elif isinstance(data, tuple):
                    self._sentinel(data[1])
                elif data.code is None and not data.eof:  # else its channel closed earlier in this batch
                    if events & selectors.EVENT_WRITE:
                        self._flush(data)
                    if events & selectors.EVENT_READ:
                        self._read(data)
            if self._tick_ns is not None:
                now = time.monotonic_ns()
                if now >= self._next_scan:
                    self._next_scan = now + self._tick_ns
                    self._expire_overdue(now)

    def _all_gone(self) -> bool:
        return all(w is None or w.code is not None for w in self._workers)

    def _watch(self) -> None:
        with self._lock:
            for w in self._workers:
                if w is not None and w.out and not w.watched and w.code is None and not w.eof:
                    self._sel.modify(w.fd, selectors.EVENT_READ | selectors.EVENT_WRITE, w)
                    w.watched = True

    def _flush(self, w: _Worker) -> None:
        with self._lock:
            out = w.out
            try:
                while out:
                    n = os.write(w.fd, out[0])
                    if n < len(out[0]):
                        out[0] = out[0][n:]
                        break
                    out.popleft()
            except BlockingIOError:
                pass
            except OSError:  # the worker is gone: its death says what it held
                out.clear()
            if not out and w.watched and w.code is None and not w.eof:
                self._sel.modify(w.fd, selectors.EVENT_READ, w)
                w.watched = False

    def _read(self, w: _Worker, dying: bool = False) -> None:
        """Read what ``w`` wrote into its buffer, and settle the replies it completes.

        One buffer a worker, reused (a fresh buffer for each read would be allocated,
        faulted in and freed by the kernel each time); a frame larger than it gets a
        buffer of its own size, read into directly. Each reply is unpickled from the
        buffer before the next read."""
        while True:
            buf = w.inbuf
            if w.end == len(buf):
                if not self._make_room(w):
                    break
                buf = w.inbuf
            try:
                with memoryview(buf) as view:
                    n = os.readv(w.fd, [view[w.end :]])
            except BlockingIOError:
                break
            except OSError:
                n = 0
            if not n:
                if not dying:
                    self._ended_channel(w)
                break
            w.end += n
            if w.end < len(buf):
                break
            self._replies(w)  # the buffer is full: what it completes goes now
        self._replies(w)

    def _make_room(self, w: _Worker) -> bool:
        """The buffer is full: drop what was consumed, or grow it to the frame it holds.
        ``False`` if it holds complete frames still to settle."""
        buf, start, end = w.inbuf, w.start, w.end
        need = len(buf)
        if end - start >= HEAD.size:
            (word,) = HEAD.unpack_from(buf, start)
            need = HEAD.size + (word & SIZE)
            if end - start >= need:
                return False
        if start == 0 and need > len(buf):
            bigger = bytearray(need)
            bigger[:end] = buf[:end]
            w.inbuf = bigger
        elif start > 0:
            if need > len(buf) - start:
                room = bytearray(max(need, READ))
                room[: end - start] = buf[start:end]
                w.inbuf = room
            else:
                buf[: end - start] = buf[start:end]
            w.start, w.end = 0, end - start
        return True

    def _replies(self, w: _Worker) -> None:
        """Settle the jobs whose replies are in ``w``'s buffer, and hand the running
        task's messages (frames with :data:`PART` set) to its job, in channel order."""
        buf, pos, end = w.inbuf, w.start, w.end
        spans = []
        while end - pos >= HEAD.size:
            (word,) = HEAD.unpack_from(buf, pos)
            stop = pos + HEAD.size + (word & SIZE)
            if end < stop:
                break
            spans.append((pos + HEAD.size, stop, word & PART))
            pos = stop
        if pos == end:  # all consumed: start over, and give back a buffer grown for a large frame
            pos = end = 0
            if len(buf) > READ:
                w.inbuf = bytearray(READ)
        w.start, w.end = pos, end
        if not spans:
            return
        jobs = []
        now = time.monotonic_ns()
        with self._lock:
            up = not w.ready  # its first frame: it says it is up (see channel.serve)
            w.ready = True
            self._start_failures = 0
            answered = False
            for span in spans:
                if span[2]:  # a message of the running task: the oldest unanswered job's
                    jobs.append(w.sent[0] if w.sent and span[1] > span[0] else None)
                    continue
                answered = True
                job = w.sent.popleft() if w.sent else None
                if job is not None:  # its time on the worker: from its sending or the answer before it
                    self._observe(now - max(job.sent_ns, w.last_ns))
                jobs.append(job)
            if answered:
                w.last_ns = now
            if answered or up:
                self._flush_pending(w)
                self._idle.notify_all()
        self._settle_unsent()
        with memoryview(buf) as view:
            for job, (a, b, part) in zip(jobs, spans, strict=True):
                with view[a:b] as data:
                    if part:
                        _hand(job, data)
                        continue
                    outcome = _reply.arrived(data)  # even with nobody waiting: it frees what the reply holds
                if job is not None:
                    job.settle(outcome)

    def _observe(self, ns: int) -> None:
        t = self.task_ns
        t = self.task_ns = ns if t is None else (1 - _ALPHA) * t + _ALPHA * ns
        self.depth = 1 if t >= LONG_NS else DEPTH

    def _ended_channel(self, w: _Worker) -> None:
        """The worker's end of its channel closed: it exited, or is exiting."""
        if w.eof:
            return
        w.eof = True
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(w.fd)
        if w.process is None and not w.starting and (w.session is None or w.session.dead):
            self._died(w, None)  # nobody will report its exit code

    def _reports(self) -> None:
        zygote = self._zygote
        assert zygote is not None
        for kind, pid, value in zygote.reports():
            with self._lock:
                if kind == b"F":
                    slot = self._requests.pop(value, -1)
                    w = self._workers[slot] if slot >= 0 else None
                    if w is not None and not w.pid and w.process is None:
                        w.pid = pid
                        self._by_pid[pid] = w
                        self._snapshot_pids()
                        if w.kill_asked:
                            _kill(pid)
                    continue
            if kind == b"X":
                w = self._by_pid.get(pid)
                if w is not None:
                    self._died(w, value)
            elif kind == b"E":
                slot = self._requests.pop(pid, -1)
                w = self._workers[slot] if slot >= 0 else None
                if w is not None and not w.pid:
                    self._died(w, None, OSError(value, os.strerror(value)))
        if zygote.dead:  # the server died; its workers live on, and the next one starts from its standby
            with contextlib.suppress(KeyError, ValueError):
                self._sel.unregister(zygote.sock)
            _zygote.notice_death()
            for w in list(self._workers):  # no more exit codes: their channels' ends say it
                if w is not None and w.code is None and w.session is zygote and w.eof:
                    self._died(w, None)

    def _sentinel(self, w: _Worker) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(w.process.sentinel)
        w.process.join(5.0)
        self._died(w, w.process.exitcode)

    # ---------------------------------------------------------------------- deaths
    def _died(self, w: _Worker, code: int | None, failure: Exception | None = None) -> None:
        """Worker ``w`` is gone with exit ``code``: settle or requeue what it held, and
        put a new worker in its slot (see module doc). Runs in the I/O thread (or where
        a start failed)."""
        if w.code is not None:
            return
        if not w.eof:
            with contextlib.suppress(OSError):
                self._read(w, dying=True)  # what it answered before it died
        with self._lock:
            if _dead(w):  # another thread saw it first, while this one read
                return
            w.code = code if code is not None else -255 if failure is None else -254
            if not w.eof:
                with contextlib.suppress(KeyError, ValueError):
                    self._sel.unregister(w.fd)
            w.eof = True
            pid, phase, seq, _, _ = self.slots.row(w.slot) if w.pid else (0, Slots.STARTING, -1, 0, 0)
            if pid != w.pid:  # it died before it claimed its row: the row is its predecessor's
                phase, seq = Slots.STARTING, -1
            started = w.ready or phase >= Slots.READY
            settle: list[tuple[Job, Lost]] = []
            requeue: list[Job] = []
            for job in w.sent:
                if job.stopped or self.closed:
                    settle.append((job, Lost(timed_out=job.why_stopped or None)))
                elif job.seq == seq and phase >= Slots.ACCEPTED and not w.why_killed:
                    settle.append((job, Lost(charged=True, code=code, pid=w.pid or None)))
                else:  # it had not started it, or the pool killed it for another job's sake
                    requeue.append(job)
            w.sent.clear()
            w.out.clear()
            self._pending.extendleft(reversed(requeue))
            if not w.why_killed:
                self.deaths.append((w.pid, code))
            fatal = None
            if not started and not w.why_killed:
                self._start_failures += 1
                fatal = self._startup_verdict(code, failure)
            if self._by_pid.get(w.pid) is w:
                del self._by_pid[w.pid]
            with contextlib.suppress(OSError):
                w.channel.close()
            replace = fatal is None and not self.closed and not exiting and self.fatal is None
            if replace:
                self.restarts += 1
                self._spawn(w.slot, replacement=True)
            else:
                self._workers[w.slot] = w  # stays, dead: the slot has no worker now
                self._snapshot_pids()
                if not self.closed and self.fatal is None:  # a dead slot: its queued jobs go elsewhere
                    for other in self._workers:
                        if other is not None and other.code is None:
                            self._flush_pending(other)
        self._settle_unsent()
        for job, lost in settle:
            job.settle(lost=lost)
        with self._lock:
            self._idle.notify_all()
        if fatal is not None:
            self._break(fatal)
        elif self.closed and self._all_gone():
            self._wake()

    def _startup_verdict(self, code: int | None, failure: Exception | None) -> Exception | None:
        """After a worker died before it finished starting: the error that ends the pool,
        or ``None`` to start another (the lock held)."""
        if code == _mainguard.EXIT_CODE:
            return _mainguard.error(code)
        if self._start_failures < MAX_START_FAILURES:
            return None
        codes = [c for _, c in list(self.deaths)[-MAX_START_FAILURES:]]
        signals = [c for c in codes if c is not None and c < 0]
        if failure is not None:
            why = f"the pool could not start a worker process ({type(failure).__name__}: {failure})"
        elif signals and len(signals) == len(codes):
            names = sorted({describe_exit(c) for c in signals})
            why = (
                f"the pool's workers were killed by a signal before they finished starting, "
                f"{MAX_START_FAILURES} times in a row (exit codes {names}). aioloader did not send it: "
                "it came from outside the pool (another process, a supervisor, or the kernel's "
                "out-of-memory killer for SIGKILL)"
            )
        else:
            why = (
                f"the pool's workers keep dying before they finish starting ({MAX_START_FAILURES} in a row; "
                f"exit codes {sorted(describe_exit(c) for c in codes)}). A worker that cannot import the main "
                "module or the dataset's module, or that crashes while unpickling the dataset, does this: "
                "run from a file rather than stdin, guard the entry point with `if __name__ == '__main__':`, "
                "and check that the dataset unpickles in a fresh interpreter"
            )
        err = PoolBrokenError(why, exitcode=codes[-1] if codes else None)
        if failure is not None:
            err.__cause__ = failure
        return err

    def _break(self, fatal: Exception) -> None:
        """No worker can run anything: every job gets ``fatal``; the workers are stopped."""
        with self._lock:
            if self.fatal is None:
                self.fatal = fatal
            jobs = list(self._pending) + [j for w in self._workers if w is not None for j in w.sent]
            self._pending.clear()
            for w in self._workers:
                if w is not None:
                    w.sent.clear()
        for job in jobs:
            job.settle(lost=Lost(fatal=self.fatal))
        self._kill_all("the pool broke")

    def drain(self) -> None:
        """Wait until every job sent or queued is answered (the Executor's shutdown)."""
        with self._idle:
            while (self._pending or any(w is not None and w.sent for w in self._workers)) and (
                self.fatal is None and not self.closed and self._thread.is_alive()
            ):
                self._idle.wait(1.0)

    def drop_pending(self) -> None:
        """Cancel the jobs no worker has taken yet (``shutdown(cancel_futures=True)``)."""
        with self._lock:
            jobs = list(self._pending)
            self._pending.clear()
            self._idle.notify_all()
        for job in jobs:
            job.settle(lost=Lost())

    # ------------------------------------------------------------ stopping workers
    def _due(self, w: _Worker, job: Job) -> int | None:
        """``monotonic_ns`` since when ``job``, the oldest unanswered job of ``w``, could
        have been started by it; ``None`` while ``w`` is still starting (the lock held)."""
        if w.last_ns:
            return max(job.sent_ns, w.last_ns)
        if not w.pid:
            return None
        pid, phase, _, _, ready = self.slots.row(w.slot)
        if pid != w.pid or phase == Slots.STARTING or not ready:
            return None
        return max(job.sent_ns, ready)

    def due_at(self, job: Job) -> int | None:
        """``monotonic_ns`` since when ``job``'s worker could start it, or ``None``: not
        sent, behind another job, answered, or its worker still starting."""
        with self._lock:
            w = job.worker
            if not isinstance(w, _Worker) or job.done or w.code is not None or not w.sent or w.sent[0] is not job:
                return None
            return self._due(w, job)

    def _expire_overdue(self, now: int) -> None:
        """Stop each oldest job that has been due longer than its own timeout (the I/O
        thread, every tick). The tick stops once no timed job is out."""
        with self._lock:
            timed = False
            for w in self._workers:
                if w is None or w.code is not None or not w.sent:
                    continue
                timed = timed or any(j.timeout_ns for j in w.sent)  # a killed worker's go back to the queue
                if w.why_killed:
                    continue
                job = w.sent[0]
                if not job.timeout_ns or job.done:
                    continue
                due = self._due(w, job)
                if due is not None and now - due > job.timeout_ns:
                    self._stop(w, job)
            if not timed and not any(j.timeout_ns for j in self._pending):
                self._tick_ns = None

    def _stop(self, w: _Worker, job: Job) -> str:
        """Kill ``w`` for ``job``, its oldest job, which overran its timeout; returns what
        hung (the lock held). The job ends lost, uncharged; the rest go to other workers."""
        account, setup = self._account(w, job)
        if setup:
            token = getattr(job.args[0], "token", None) if job.args else None
            if isinstance(token, str):
                self._lazy.add(token)  # its replacement starts without it
        job.stopped = True
        job.why_stopped = account
        self._kill(w, "a task overran its timeout")
        return account

    def _account(self, w: _Worker, job: Job) -> tuple[str, bool]:
        """What ``w`` was doing with ``job`` (from its row), and whether it was loading
        the job's loader (unpickling its payload or running its ``worker_init_fn``)."""
        pid, phase, seq, _, _ = self.slots.row(w.slot)
        what = "had not taken it up"
        if pid == w.pid and seq == job.seq:
            what = _DOING.get(phase, what)
        if _stopped(w.pid):
            what += " (the process was stopped: SIGSTOP, or a debugger)"
        setup = pid == w.pid and seq == job.seq and phase in (Slots.LOADING, Slots.INITIALIZING)
        return f"worker pid {w.pid} {what}; it was killed and replaced", setup

    def stop(self, job: Job) -> str | None:
        """Kill the worker holding ``job`` as its oldest job (a timeout the caller keeps);
        its job then ends lost, uncharged, and the worker is replaced. Says what hung, or
        ``None`` if the job is no longer there."""
        with self._lock:
            w = job.worker
            if not isinstance(w, _Worker) or job.done or w.code is not None or w.why_killed:
                return None
            if not w.sent or w.sent[0] is not job:
                return None
            return self._stop(w, job)

    def kill_stuck_start(self, limit_ns: int) -> tuple[int, list[Job], str] | None:
        """Kill a worker still starting ``limit_ns`` after it was started (its
        ``worker_init_fn``, the unpickling of a dataset or an import hangs). Returns its
        pid, the jobs sent to it, which end lost, and what hung; ``None`` if none is
        stuck. A loader whose payload hung reaches later workers lazily."""
        now = time.monotonic_ns()
        with self._lock:
            for w in self._workers:
                if w is None or w.code is not None or w.ready or w.why_killed or now - w.born_ns <= limit_ns:
                    continue
                pid, phase, k, step, _ = self.slots.row(w.slot)
                if w.pid and pid == w.pid and phase != Slots.STARTING:
                    continue
                what = "an import, or the start itself, did not finish"
                if w.pid and pid == w.pid and 0 <= k < len(w.tokens) and step in _STARTING:
                    what = _STARTING[step]
                    self._lazy.add(w.tokens[k])  # its replacement starts without it
                jobs = list(w.sent)
                for job in jobs:
                    job.stopped = True
                self._kill(w, "it did not finish starting")
                return w.pid, jobs, what
        return None

    def _kill(self, w: _Worker, why: str) -> None:
        with self._lock:
            if w.code is not None:
                return
            w.why_killed = why
            if w.process is not None:
                with contextlib.suppress(ValueError, OSError):
                    w.process.kill()
            elif w.pid:
                _kill(w.pid)
            else:
                w.kill_asked = True

    def _kill_all(self, why: str) -> None:
        with self._lock:
            for w in self._workers:
                if w is not None and w.code is None:
                    self._kill(w, why)

    def close(self, grace: float) -> None:
        """Stop the workers: each finishes what it holds within ``grace`` seconds, then
        is killed. Jobs not answered end lost. Idempotent; never hangs."""
        with self._lock:
            first = not self.closed
            self.closed = True
            jobs = list(self._pending)
            self._pending.clear()
            if first:
                for w in self._workers:
                    if w is not None and w.code is None:
                        self._put(w, memoryview(HEAD.pack(0)))  # after what it holds
            never_ran = self._thread.ident is None  # start() starts it under this lock
        for job in jobs:
            job.settle(lost=Lost())
        if never_ran:
            self._release(grace)
            return
        if threading.current_thread() is self._thread:
            return
        # The I/O thread ends once every worker is gone (it is woken by the last death,
        # and once here, for workers that were all gone already).
        self._wake()
        self._ended.wait(grace)
        self._kill_all("the pool was closed")
        self._wake()
        self._ended.wait(5.0)
        self._release(0.0)

    def _release(self, grace: float) -> None:
        """Once the I/O thread is done (or never ran): reap, fail what is left, free."""
        for starter in list(self._starters):  # each kills the process it started, if it was asked to
            starter.join(10.0)
        with self._lock:
            workers = [w for w in self._workers if w is not None]
        for w in workers:
            if w.code is None:
                if w.process is not None:
                    w.process.join(grace)
                    if w.process.exitcode is None:
                        with contextlib.suppress(ValueError, OSError):
                            w.process.kill()
                        w.process.join(5.0)
                elif w.pid:
                    _kill(w.pid)
            for job in list(w.sent):
                job.settle(lost=Lost())
            w.sent.clear()
            with contextlib.suppress(OSError):
                w.channel.close()
            if w.process is not None:
                with contextlib.suppress(ValueError):
                    w.process.close()
        with self._lock:
            if self._wake_r < 0:
                return
            self._sel.close()
            if self._zygote is not None:
                self._zygote.close()  # the server forgets this pool; its workers' exits are not reported
            for fd in (self._wake_r, self._wake_w, self._table_fd):
                if fd >= 0:
                    os.close(fd)
            self._wake_r = self._wake_w = self._table_fd = -1
            self._pids = []
        _live.discard(self)

    def abandon(self) -> None:
        """A forked child's copy: forget the parent's workers without touching them."""
        self.closed = True
        _live.discard(self)


def _waits(w: _Worker) -> bool:
    """Is ``w`` a replacement that is not up yet?"""
    return w.replacement and not w.ready


def _dead(w: _Worker) -> bool:
    return w.code is not None


_STARTING = {
    Slots.LOADING: "the unpickling of a loader's payload (its dataset) did not return",
    Slots.INITIALIZING: "a loader's worker_init_fn did not return",
}
_DOING = {
    Slots.ACCEPTED: "had taken it and not begun it",
    Slots.LOADING: "was unpickling the loader's payload (its dataset)",
    Slots.INITIALIZING: "was running the loader's worker_init_fn",
    Slots.RUNNING: "was building it",
    Slots.HOLDING: "had built it, and its reply did not arrive",
}


def _stopped(pid: int) -> bool:
    """Is process ``pid`` stopped (``T``) or traced (``t``)? Linux's /proc; else no."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] in (b"T", b"t")
    except (OSError, IndexError):
        return False


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGKILL)


def close_all(grace: float) -> None:
    """Stop every live pool's workers (interpreter exit)."""
    global exiting
    exiting = True
    for procs in list(_live):
        with contextlib.suppress(Exception):
            procs.close(grace)


def _after_fork_in_child() -> None:
    global exiting
    exiting = False
    for procs in list(_live):
        procs.abandon()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _hand(job: Job | None, data: memoryview) -> None:
    """Give the running task's message to its job (in the I/O thread, from the buffer,
    before the buffer is read into again). One that cannot be unpickled here is handed
    as the exception that says so."""
    on_part = job.on_part if job is not None else None
    if job is None or on_part is None:
        return
    message: Any
    try:
        message = pickle.loads(data)
    except Exception as exc:
        message = exc
    try:
        on_part(job, message)
    except Exception:  # the receiver's own failure must not stop the I/O thread
        traceback.print_exc()

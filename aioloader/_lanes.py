"""Lanes: each worker of an owned process pool reads its tasks from a pipe of its own and
writes its replies to another, and one thread of the consumer serves all of them.

Why: a ``ProcessPoolExecutor`` costs the consumer a great deal per task (a work item
under a lock, the manager thread, the feeder thread's pickle, one result pipe for all
workers read through a new selector each time): on batches that cost a worker little,
that machinery bounded the loader, at 250-300 µs of the consumer's CPU per task here.

So the executor only *hosts* the workers (it starts them, notices a death, shuts them
down). Each worker serves its lane from the end of the pool initializer, for the life of
its generation (a task sent before its worker is up waits in the pipe); the tasks
travel through the lanes:

* a task goes to the lane with the fewest unanswered tasks, at most two while tasks are
  short (one running, one waiting in its pipe: no wait between two tasks) and one once
  they take a worker :data:`LONG_NS` or more (none waits behind a long one while another
  worker frees first); beyond that it waits here and goes out the moment a lane
  replies, from the lanes' thread, with no trip through the event loop;
* a lane runs its tasks in the order sent, so a reply needs no id: it answers the oldest
  unanswered task of its lane;
* a message is an 8-byte length and a pickle (``ForkingPickler``, as the executor's); a
  length of zero asks the worker to stop; a task larger than a pipe holds is *carried* in
  a memfd that the message names (see :mod:`aioloader._lane_wire`). Replies are
  :class:`aioloader._reply.Entry` replies (small: larger outcomes are spilled beside the pipe);
* a worker that dies breaks the executor, which fails its pending futures, among them
  a task that no worker runs while it serves (:meth:`Lanes.watch`): every unanswered
  task then fails with ``BrokenProcessPool`` too, and the pool works out who died holding
  what from the slot table. A worker killed half-way through a reply leaves half a
  message in its own lane only, which dies with the generation.

Only the consumer's thread and the lanes' thread touch a lane, under one lock; the pipes
are named FIFOs that the consumer opens first, read-write (neither side's ``open`` waits
for the other, the consumer never sees them end); each worker removes their names.

``AIOLOADER_LANES=0`` turns lanes off (tasks take the executor's ``submit``); the wire
format and the worker's side are in :mod:`aioloader._lane_wire`.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import contextlib
import os
import pickle
import secrets
import selectors
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from . import _lane_wire as wire
from ._lane_wire import HEAD, PREFIX, READ, sweep

__all__ = ["DEPTH", "ENV", "LONG_NS", "Lanes", "enabled"]

ENV = "AIOLOADER_LANES"
DEPTH = 2  # unanswered tasks a lane holds at most: one running, one waiting in its pipe
LONG_NS = 3_000_000  # tasks this long (on average) go one to a lane at a time (grouped batches aim at 2 ms)
_ALPHA = 0.25  # weight of the newest task in the average
_swept = False  # this process has swept the temporary directory once
_carrying = True  # large tasks go in memfds (until a worker could not take one)
# A task pipe's capacity once a task over Linux's default 64 KiB goes through it (fewer
# wakes of the lanes' thread); only then, as the user's pipe quota is charged for it.
_PIPE_SIZE = wire.CARRY_MIN  # a larger task is carried in a memfd instead
try:
    import fcntl

    _SETPIPE_SZ: int | None = getattr(fcntl, "F_SETPIPE_SZ", None)
except ImportError:  # not POSIX: no lanes either (no mkfifo)
    _SETPIPE_SZ = None


def enabled() -> bool:
    return os.environ.get(ENV, "1").strip() != "0" and hasattr(os, "mkfifo")


class _Lane:
    __slots__ = ("big", "inbuf", "last_ns", "out", "paths", "reply_fd", "sent", "task_fd", "watched")

    def __init__(self, paths: tuple[str, str]) -> None:
        self.paths = paths
        flags = os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC
        self.task_fd = self.reply_fd = -1
        self.task_fd = os.open(paths[0], flags)
        self.reply_fd = os.open(paths[1], flags)
        self.big = _SETPIPE_SZ is None  # the task pipe was enlarged (or cannot be)
        # the unanswered tasks' futures, when each was sent, and its memfd if carried (else -1)
        self.sent: collections.deque[tuple[cf.Future[Any], int, int]] = collections.deque()
        self.last_ns = 0  # when the lane last answered
        self.out: collections.deque[memoryview] = collections.deque()  # what the pipe could not take yet
        self.inbuf = bytearray()
        self.watched = False  # the lanes' thread waits for the task pipe to take more


class Lanes:
    """The lanes of one generation of ``n`` workers: :meth:`paths` go to the workers,
    :meth:`submit` sends a task, :meth:`watch` ties them to the executor's verdict,
    :meth:`stop` and :meth:`join` end them."""

    def __init__(self, n: int) -> None:
        self._lock = threading.Lock()
        # tasks waiting for a lane, not pickled yet (a pickle would sit beside the payloads it copies)
        self._pending: collections.deque[tuple[cf.Future[Any], Callable[..., Any], tuple[Any, ...]]] = (
            collections.deque()
        )
        self._broken: str | None = None
        self._closed = False  # stopped: no new task
        self._finished = False  # joined: the lanes' thread reads what is left and ends
        self._lanes: list[_Lane] = []
        self._turn = 0  # where the next search for the least busy lane begins
        self.depth = DEPTH  # unanswered tasks a lane may hold now
        self.task_ns: float | None = None  # average time a task kept its worker
        self.sent = 0  # tasks sent on a lane as they were submitted
        self.held = 0  # tasks that waited here for a lane to reply first
        self.carried = 0  # tasks sent in a memfd (see _lane_wire)
        self._spares: list[int] = []  # memfds of answered tasks, to carry others
        self.servers: list[cf.Future[Any]] = []  # executor tasks that end only when the lanes do
        stem = os.path.join(tempfile.gettempdir(), f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}")
        try:
            for k in range(n):
                paths = (f"{stem}-{k}.task", f"{stem}-{k}.reply")
                for p in paths:
                    os.mkfifo(p, 0o600)
                self._lanes.append(_Lane(paths))
        except BaseException:
            self._release()
            raise
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        for lane in self._lanes:
            self._sel.register(lane.reply_fd, selectors.EVENT_READ, lane)
        # Started by :meth:`start`, off the path to the first task: a thread start can wait
        # out the interpreter's switch interval (5 ms) for the GIL.
        self._thread = threading.Thread(target=self._serve, name="aioloader-lanes", daemon=True)

    def start(self) -> None:
        """Start the lanes' thread (before any reply can come: the workers' start)."""
        self._thread.start()

    @classmethod
    def open(cls, n: int) -> Lanes | None:
        """Lanes for ``n`` workers, or ``None`` where they are turned off or no FIFO can
        be made (a read-only temporary directory): tasks then go through the executor."""
        if not enabled():
            return None
        global _swept
        if not _swept:
            _swept = True
            with contextlib.suppress(Exception):  # housekeeping: never in the way of a pool
                sweep(tempfile.gettempdir())
        try:
            return cls(n)
        except OSError:
            return None

    def paths(self) -> tuple[tuple[str, str], ...]:
        """Each lane's (task, reply) FIFO paths, in worker order, for the workers."""
        return tuple(lane.paths for lane in self._lanes)

    def watch(self, fut: cf.Future[Any]) -> None:
        """``fut`` is an executor task that no worker runs while the lanes are open: if
        it ends first, a worker died (the executor broke) or left its lane."""
        self.servers.append(fut)
        fut.add_done_callback(self._server_done)

    # ------------------------------------------------------------ consumer's side
    def submit(self, fn: Callable[..., Any], *args: Any) -> cf.Future[Any]:
        """``executor.submit(fn, *args)`` through the lanes (raises what the executor's
        would: ``BrokenProcessPool`` once a worker died, ``RuntimeError`` once closed)."""
        fut: cf.Future[Any] = cf.Future()
        error = None
        with self._lock:
            if self._broken is not None:
                raise BrokenProcessPool(self._broken)
            if self._closed:
                raise RuntimeError("cannot schedule new futures after shutdown")
            lane = self._least_busy()
            if self._pending or len(lane.sent) >= self.depth:
                self._pending.append((fut, fn, args))
                self.held += 1
            else:
                error = self._send(lane, fut, fn, args)
                self.sent += error is None
        if error is not None:
            fut.set_exception(error)
        return fut

    def _least_busy(self) -> _Lane:
        """The lane with the fewest unanswered tasks; ties go round the lanes in turn."""
        lanes, n = self._lanes, len(self._lanes)
        best = lanes[self._turn % n]
        for k in range(1, n):
            lane = lanes[(self._turn + k) % n]
            if len(lane.sent) < len(best.sent):
                best = lane
        self._turn += 1
        return best

    def unanswered(self, slot: int) -> list[cf.Future[Any]]:
        """The futures of the tasks sent on lane ``slot`` and not answered yet."""
        with self._lock:
            return [f for f, *_ in self._lanes[slot].sent] if 0 <= slot < len(self._lanes) else []

    def loads(self) -> list[int]:
        """Unanswered tasks on each lane (tests, diagnostics)."""
        with self._lock:
            return [len(lane.sent) for lane in self._lanes]

    def _send(
        self, lane: _Lane, fut: cf.Future[Any], fn: Callable[..., Any], args: tuple[Any, ...]
    ) -> BaseException | None:
        """Pickle one task and send it on ``lane`` (the lock held). A task that cannot be
        pickled is not sent: its error comes back, for the caller to set on ``fut`` once
        the lock is released (a done callback may submit again)."""
        if not fut.set_running_or_notify_cancel():
            return None
        try:
            fd, data = wire.pack((fn, args), self._spares if _carrying else None)
        except BaseException as exc:  # this task alone fails (its future must not stay running)
            traceback.clear_frames(exc.__traceback__)  # the half-made pickle and the payloads
            return exc
        self.carried += fd >= 0
        lane.sent.append((fut, time.monotonic_ns(), fd))
        self._put(lane, data)
        return None

    def _put(self, lane: _Lane, data: memoryview) -> None:
        """Write a frame into ``lane``'s pipe, or what it cannot take for the lanes' thread."""
        if not lane.big and len(data) > 1 << 16 and _SETPIPE_SZ is not None:
            lane.big = True
            with contextlib.suppress(OSError):  # the system's or the user's limit: keep the default
                fcntl.fcntl(lane.task_fd, _SETPIPE_SZ, _PIPE_SIZE)
        n = 0
        if not lane.out:
            with contextlib.suppress(BlockingIOError):  # the pipe is full
                n = os.write(lane.task_fd, data)
            if n == len(data):
                return
        lane.out.append(data[n:])  # what the pipe did not take, kept as it is
        if not lane.watched:
            self._wake()  # the lanes' thread writes the rest when the worker has read

    def _observe(self, ns: int) -> None:
        """A task kept its worker about ``ns`` (from when it was sent, or when the task
        before it was answered): update the average and the depth (the lock held)."""
        t = self.task_ns
        t = self.task_ns = ns if t is None else (1 - _ALPHA) * t + _ALPHA * ns
        self.depth = 1 if t >= LONG_NS else DEPTH

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"\0")

    # --------------------------------------------------------------- lanes' thread
    def _serve(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # a bug here must not leave a task waiting for ever
            self.fail(f"the pool's lanes failed: {type(exc).__name__}: {exc}")

    def _loop(self) -> None:
        while True:
            for key, events in self._sel.select():
                lane = key.data
                if lane is None:
                    with contextlib.suppress(BlockingIOError):
                        os.read(self._wake_r, 4096)
                    if self._finished:
                        for lane in self._lanes:
                            self._read(lane)
                        return
                    self._watch()
                    continue
                if events & selectors.EVENT_WRITE:
                    self._flush(lane)
                if events & selectors.EVENT_READ:
                    self._read(lane)

    def _watch(self) -> None:
        """Wait for room in the task pipes that hold unsent bytes."""
        with self._lock:
            for lane in self._lanes:
                if lane.out and not lane.watched:
                    self._sel.register(lane.task_fd, selectors.EVENT_WRITE, lane)
                    lane.watched = True

    def _flush(self, lane: _Lane) -> None:
        with self._lock:
            out = lane.out
            with contextlib.suppress(BlockingIOError):
                while out:
                    n = os.write(lane.task_fd, out[0])
                    if n < len(out[0]):
                        out[0] = out[0][n:]
                        break
                    out.popleft()
            if not out:
                self._sel.unregister(lane.task_fd)
                lane.watched = False

    def _read(self, lane: _Lane) -> None:
        while True:
            try:
                chunk = os.read(lane.reply_fd, READ)
            except BlockingIOError:
                break
            lane.inbuf += chunk
            if len(chunk) < READ:
                break
        buf, pos, replies = lane.inbuf, 0, []
        with memoryview(buf) as view:  # one copy of each reply, not a slice and its copy
            while len(buf) - pos >= HEAD.size:
                (size,) = HEAD.unpack_from(buf, pos)
                end = pos + HEAD.size + size
                if len(buf) < end:
                    break
                replies.append(bytes(view[pos + HEAD.size : end]))
                pos = end
        del buf[:pos]
        if not replies:
            return
        futs: list[tuple[cf.Future[Any] | None, int]] = []
        unsent: list[tuple[cf.Future[Any], BaseException]] = []
        now = time.monotonic_ns()
        with self._lock:
            for _ in replies:
                if lane.sent:
                    head, sent_ns, fd = lane.sent.popleft()
                    self._observe(now - max(sent_ns, lane.last_ns))
                    futs.append((head, fd))
                else:
                    futs.append((None, -1))
                lane.last_ns = now
                while (
                    self._pending and len(lane.sent) < self.depth and not self._closed
                ):  # keep it busy first
                    task, fn, args = self._pending.popleft()
                    error = self._send(lane, task, fn, args)
                    if error is not None:
                        unsent.append((task, error))
        for task, error in unsent:
            task.set_exception(error)
        for (fut, fd), data in zip(futs, replies, strict=True):
            value, error = None, None
            try:  # even with nobody waiting: arrival frees what the reply holds
                value = pickle.loads(data)
            except BaseException as exc:  # arrival never raises (see _reply): the task's error
                error = exc
            if isinstance(value, wire.Uncarried) and fut is not None and fd >= 0:
                self._resend(lane, fut, fd)  # the reply to its copy settles it
                fut = None
            if fd >= 0:  # first: a settled task holds no memfd (nor broken lanes a spare)
                with self._lock:
                    wire.recycle(fd, self._spares, keep=self._broken is None)
            if fut is not None and error is not None:
                fut.set_exception(error)
            elif fut is not None:
                fut.set_result(value)

    def _resend(self, lane: _Lane, fut: cf.Future[Any], fd: int) -> None:
        """A worker could not take a carried task: resend it by pipe, and carry no more."""
        global _carrying
        _carrying = False
        with self._lock:
            if self._broken is None and not self._closed:  # stopped: it would follow the stop
                lane.sent.append((fut, time.monotonic_ns(), -1))
                self._put(lane, wire.uncarry(fd))
                return
        fut.set_exception(BrokenProcessPool(self._broken or "the pool's lanes were stopped"))

    # ------------------------------------------------------------------- ending
    def _server_done(self, fut: cf.Future[Any]) -> None:
        """A watched task ended: while the lanes are open, a worker died (the executor
        broke) or left its lane (its lane failed, and it went on to run that task);
        every unanswered task fails as the executor fails its pending ones, and the
        pool retires the generation."""
        if self._closed:
            return
        why = "the pool's lanes stopped"
        if not fut.cancelled() and fut.exception() is not None:
            why = f"{why}: {fut.exception()}"
        self.fail(why)

    def fail(self, why: str) -> None:
        """Fail every unanswered task and refuse new ones (``BrokenProcessPool``)."""
        with self._lock:
            if self._broken is None:
                self._broken = why
            futs = [f for lane in self._lanes for f, *_ in lane.sent] + [p[0] for p in self._pending]
            for fd in [fd for lane in self._lanes for *_, fd in lane.sent] + self._spares:
                wire.release(fd)
            for lane in self._lanes:
                lane.sent.clear()
            self._spares.clear()
            self._pending.clear()
        for f in futs:
            if not f.done():
                f.set_exception(BrokenProcessPool(why))

    def stop(self) -> None:
        """Ask every worker to stop serving once it has answered what it holds (it then
        takes the executor's shutdown); new tasks are refused. Never waits."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for lane in self._lanes:
                if not lane.out:
                    with contextlib.suppress(BlockingIOError):
                        os.write(lane.task_fd, HEAD.pack(0))  # 8 bytes: all or nothing
                        continue
                lane.out.append(memoryview(HEAD.pack(0)))  # after what the pipe has not taken yet
                self._wake()

    def join(self) -> None:
        """Once the workers are gone: read what they wrote last (unpickling a reply
        frees what it holds, its shared-memory name or its ring space), end the lanes'
        thread, fail what is still unanswered and free the pipes. Idempotent."""
        self.stop()
        self._finished = True
        self._wake()
        if self._thread.ident is not None and self._thread is not threading.current_thread():
            self._thread.join(5.0)
        self.fail("the pool was shut down")
        with self._lock:
            if self._wake_r < 0:
                return
            self._sel.close()
            for fd in (self._wake_r, self._wake_w):
                os.close(fd)
            self._wake_r = self._wake_w = -1
        self._release()

    def _release(self) -> None:
        for lane in self._lanes:
            for fd in (lane.task_fd, lane.reply_fd):
                with contextlib.suppress(OSError):  # -1 where it never opened: EBADF
                    os.close(fd)
            for p in lane.paths:
                with contextlib.suppress(OSError):
                    os.unlink(p)

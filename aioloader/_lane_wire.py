"""The lanes' wire (see :mod:`aioloader._lanes`) and a worker's side of its lane.

A lane's FIFOs are named ``PREFIX`` + the consumer's pid + a token + the worker's number;
:func:`sweep` removes those a killed consumer left. A message is an 8-byte little-endian length and a pickle (``ForkingPickler``, as the
executor's); a length of zero asks the worker to stop. A worker runs the tasks of its
lane in the order they come and writes each reply back in the same form.

A large task (a batch of fetched payloads: megabytes) is *carried*: it is pickled into
a ``memfd`` of the consumer (:func:`pack`), and the pipe takes only a :data:`CARRIED` length and the
:data:`CARRY` record (the consumer's pid, its descriptor, the pickle's size and a random
token, which also leads the memfd). The worker opens ``/proc/<pid>/fd/<fd>``, checks the
token and unpickles from a read-only mapping: one copy instead of the pipe's pieces, each
waiting for the consumer's thread, then a copy into a fresh buffer. A worker that cannot
open or recognise it (``/proc`` refused, the descriptor closed) answers :class:`Uncarried`,
and the consumer sends that task again through the pipe.

Worker-side: this module never imports asyncio.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import pickle
import stat
import struct
import time
from multiprocessing.reduction import ForkingPickler
from typing import Any

from . import _reply
from ._shm._names import _pid_alive

__all__ = [
    "CARRIED", "CARRY", "CARRY_MIN", "HEAD", "PREFIX", "READ", "SPARES", "SPARE_MAX", "TOKEN", "Uncarried",
    "frame", "pack", "read_exact", "recycle", "release", "serve", "sweep", "uncarry",
]  # fmt: skip

HEAD = struct.Struct("<Q")
CARRIED = 1 << 63  # in a head: the task is in a memfd of the consumer, named by the CARRY record that follows
CARRY = struct.Struct("<IIQQ")  # the consumer's pid, its descriptor, the pickle's size, the token
TOKEN = struct.Struct("<Q")  # the first bytes of a carried task's memfd, then its pickle
CARRY_MIN = 1 << 18  # frames larger than this (a task pipe's capacity) are carried
SPARES = 4  # memfds of answered tasks a generation's lanes keep to refill
SPARE_MAX = 16 << 20  # and only those of at most this size
_carries: set[int] = set()  # this process's memfds of carried tasks not answered yet
READ = 1 << 18  # most bytes one read takes from a pipe
PREFIX = "aioloader-lane-"  # then the consumer's pid, a token, the worker's number, .task or .reply
_STALE_S = 600  # a FIFO younger than this is never swept (a pid of another namespace may look dead)

_NO_HEAD = bytes(HEAD.size)


def frame(obj: Any) -> memoryview:
    """``obj`` pickled behind its length, in one buffer (a reply, or a task that is not
    carried): :func:`pack` with nothing to carry in."""
    return pack(obj, None)[1]


def pack(obj: Any, spares: list[int] | None) -> tuple[int, memoryview]:
    """Consumer side: ``obj`` pickled for a lane, as ``(fd, message)``: a :func:`frame`
    (``fd`` -1), or, once the pickle outgrows :data:`CARRY_MIN`, the message naming
    memfd ``fd`` that holds it (a spare one refilled, or a new one; ``spares`` is
    ``None`` when tasks are not carried). The pickler writes as it goes: what follows
    the first :data:`CARRY_MIN` bytes goes straight into the memfd, a large ``bytes``
    from its own memory, so no buffer of the whole pickle is made in this process."""
    sink = _Sink(spares)
    try:
        ForkingPickler(sink).dump(obj)
        if sink.fd >= 0 and os.fstat(sink.fd).st_size > sink.pos:  # a spare that held a larger task
            os.ftruncate(sink.fd, sink.pos)
    except BaseException:
        sink.drop()  # the task's own error (it cannot be pickled)
        raise
    if sink.fd < 0:
        view = memoryview(sink.buf)
        HEAD.pack_into(view, 0, len(view) - HEAD.size)
        return -1, view
    record = CARRY.pack(os.getpid(), sink.fd, sink.pos - TOKEN.size, sink.token)
    return sink.fd, memoryview(HEAD.pack(CARRIED | CARRY.size) + record)


class _Sink:
    """The pickler's file: a frame in memory up to :data:`CARRY_MIN` bytes, then a memfd
    (the token, the bytes so far, then each write at once). A memfd that cannot be had,
    or refuses a write (out of memory), leaves the whole pickle in memory."""

    __slots__ = ("buf", "fd", "pos", "spares", "token")

    def __init__(self, spares: list[int] | None) -> None:
        self.buf, self.fd, self.pos, self.spares, self.token = bytearray(_NO_HEAD), -1, 0, spares, 0

    def write(self, data: Any) -> int:
        with memoryview(data) as view, view.cast("B") as b:
            size = len(b)
            if self.fd < 0 and (self.spares is None or len(self.buf) + size <= CARRY_MIN):
                self.buf += b
                return size
            if self.fd < 0:
                self._spill()
            if self.fd < 0 or not self._put(b):
                self.buf += b
        return size

    def _spill(self) -> None:
        """Move what the buffer holds, behind a new token, into a memfd."""
        fd = _memfd(self.spares)
        if fd < 0:
            self.spares = None  # none to be had: the pickle stays in memory
            return
        self.fd, self.token = fd, int.from_bytes(os.urandom(TOKEN.size), "little")
        if self._put(TOKEN.pack(self.token) + self.buf[HEAD.size :]):
            del self.buf[HEAD.size :]

    def _put(self, b: Any) -> bool:
        """Write ``b`` at the memfd's end; where it fails, free the memfd and go on in memory."""
        done = 0
        try:
            while done < len(b):
                done += os.pwrite(self.fd, b[done:], self.pos + done)
        except OSError:
            self._back_to_memory()
            return False
        self.pos += done
        return True

    def _back_to_memory(self) -> None:
        fd, self.fd, self.spares = self.fd, -1, None
        try:
            if self.pos:  # what went into the memfd comes back behind the head
                self.buf = _read_back(fd, self.pos - TOKEN.size)
        finally:
            release(fd)

    def drop(self) -> None:
        """The pickling failed: the memfd goes back to the spares."""
        if self.fd >= 0 and self.spares is not None:
            recycle(self.fd, self.spares)


def _memfd(spares: list[int] | None) -> int:
    """A spare memfd, or a new one; -1 when tasks are not carried or none can be made."""
    if spares is None:
        return -1
    if spares:
        return spares.pop()
    try:
        fd = os.memfd_create("aioloader-task", os.MFD_CLOEXEC)
    except (AttributeError, OSError):  # not Linux, or out of memory or descriptors
        return -1
    _carries.add(fd)
    return fd


def recycle(fd: int, spares: list[int], *, keep: bool = True) -> None:
    """Consumer side: a carried task was answered: keep its memfd to carry a later task
    (a new one's pages are allocated and zeroed by the kernel each time), up to
    :data:`SPARES` of them and :data:`SPARE_MAX` bytes each, unless not ``keep``
    (the lanes are broken); free it otherwise."""
    if keep and len(spares) < SPARES and os.fstat(fd).st_size <= SPARE_MAX:
        spares.append(fd)
    else:
        release(fd)


def uncarry(fd: int) -> memoryview:
    """Consumer side: the frame of carried task ``fd`` read back, to go through the pipe."""
    return memoryview(_read_back(fd, os.fstat(fd).st_size - TOKEN.size))


def _read_back(fd: int, size: int) -> bytearray:
    """The frame of the ``size``-byte pickle that follows the token in memfd ``fd``."""
    buf = bytearray(HEAD.size + size)
    HEAD.pack_into(buf, 0, size)
    got = 0
    with memoryview(buf) as view:  # released: the buffer may grow afterwards
        while got < size:  # one read stops short of 2 GiB
            got += os.preadv(fd, [view[HEAD.size + got :]], TOKEN.size + got) or size
    return buf


def release(fd: int) -> None:
    """Consumer side: a carried task was answered or failed: free its memfd."""
    if fd in _carries:
        _carries.discard(fd)
        os.close(fd)


def _forget_carries() -> None:  # a forked child must not keep its parent's tasks' memory
    for fd in _carries:
        with contextlib.suppress(OSError):
            os.close(fd)
    _carries.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_carries)


class Uncarried:
    """A worker's reply to a carried task it could not take: send it through the pipe."""


def take_carried(record: bytes | bytearray) -> Any:
    """The task whose :data:`CARRY` record is ``record``, unpickled from the consumer's
    memfd; ``None`` where it cannot be opened or is not the one the record names."""
    pid, fd, size, token = CARRY.unpack(record)
    try:  # a stale record may name a pipe or a terminal by now: never wait, never adopt it
        f = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError:
        return None
    try:
        st = os.fstat(f)
        if not stat.S_ISREG(st.st_mode) or st.st_size != TOKEN.size + size:
            return None
        if os.pread(f, TOKEN.size, 0) != TOKEN.pack(token):  # another task's, or none
            return None
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)  # one fault-in, not one per page
        mm = mmap.mmap(f, TOKEN.size + size, flags=flags, prot=mmap.PROT_READ)
    except (OSError, ValueError):
        return None
    finally:
        os.close(f)
    view = memoryview(mm)
    try:
        body = view[TOKEN.size :]
        try:
            return pickle.loads(body)  # a task that cannot be unpickled raises, as from the pipe
        finally:
            body.release()
    finally:
        view.release()
        mm.close()


def serve(task_path: str, reply_path: str, origin: _reply.Origin) -> None:
    """A worker's work for the life of its generation (called at the end of the pool
    initializer): run every task its lane sends, in order, and write each reply back,
    until asked to stop or the consumer is gone."""
    rfd = os.open(task_path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        wfd = os.open(reply_path, os.O_WRONLY | os.O_CLOEXEC)
    except BaseException:
        os.close(rfd)
        raise
    for p in (task_path, reply_path):
        with contextlib.suppress(OSError):
            os.unlink(p)
    try:
        while True:
            head = read_exact(rfd, HEAD.size)
            size = HEAD.unpack(head)[0] if head is not None else 0
            if not size:
                return
            body = read_exact(rfd, size & ~CARRIED)
            if body is None:
                return
            task = None
            try:
                task = take_carried(body) if size & CARRIED else pickle.loads(body)
                fn, args = (Uncarried, ()) if task is None else task
            except BaseException as exc:  # a task that cannot be unpickled here fails alone
                fn, args = _reply.Entry(_raise, origin), (exc,)
            del body, task  # a batch's fetched payloads, pickled: not kept while the task runs,
            view = frame(fn(*args))
            del fn, args  # nor the payloads themselves while the next task is awaited
            while view:
                view = view[os.write(wfd, view) :]
    finally:
        os.close(rfd)
        os.close(wfd)


def read_exact(fd: int, n: int) -> bytes | bytearray | None:
    """``n`` bytes from ``fd``, or ``None`` at its end. A large task is read into one
    buffer of its size rather than joined from the pipe's pieces."""
    first = os.read(fd, min(n, READ))
    if len(first) == n or not first:
        return first or None
    buf = bytearray(n)
    buf[: len(first)] = first
    view, got = memoryview(buf), len(first)
    while got < n:
        k = os.readv(fd, [view[got:]])
        if not k:
            return None
        got += k
    return buf


def _raise(exc: BaseException) -> None:
    raise exc


def sweep(folder: str) -> int:
    """Remove the lane FIFOs in ``folder`` of consumers that are gone (killed before their
    workers opened, and so removed, them): this user's FIFOs, named for a pid that does not
    exist, older than ten minutes. Returns how many were removed."""
    removed, now = 0, time.time()
    try:
        names = os.listdir(folder)
    except OSError:
        return 0
    for name in names:
        pid = name[len(PREFIX) :].partition("-")[0]
        if not name.startswith(PREFIX) or not pid.isdigit() or _pid_alive(int(pid)):
            continue
        path = os.path.join(folder, name)
        with contextlib.suppress(OSError):
            st = os.lstat(path)
            if stat.S_ISFIFO(st.st_mode) and st.st_uid == os.getuid() and now - st.st_mtime > _STALE_S:
                os.unlink(path)
                removed += 1
    return removed

"""The lanes' wire (see :mod:`aioloader._lanes`) and a worker's side of its lane.

A lane's FIFOs are named ``PREFIX`` + the consumer's pid + a token + the worker's number;
:func:`sweep` removes those a killed consumer left. A message is an 8-byte little-endian length and a pickle (``ForkingPickler``, as the
executor's); a length of zero asks the worker to stop. A worker runs the tasks of its
lane in the order they come and writes each reply back in the same form.

Worker-side: this module never imports asyncio.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import stat
import struct
import time
from multiprocessing.reduction import ForkingPickler
from typing import Any

from . import _reply
from ._shm._names import _pid_alive

__all__ = ["HEAD", "PREFIX", "READ", "frame", "read_exact", "serve", "sweep"]

HEAD = struct.Struct("<Q")
READ = 1 << 18  # most bytes one read takes from a pipe
PREFIX = "aioloader-lane-"  # then the consumer's pid, a token, the worker's number, .task or .reply
_STALE_S = 600  # a FIFO younger than this is never swept (a pid of another namespace may look dead)

_NO_HEAD = bytes(HEAD.size)


def frame(obj: Any) -> memoryview:
    """``obj`` pickled behind its length, in one buffer, copied nowhere: a batch of
    fetched payloads (megabytes) costs one pickle, not a pickle and two copies that the
    allocator then keeps (measured 0.26 against 8-9 ms for 64 payloads of 60 KB)."""
    buf = io.BytesIO()
    buf.write(_NO_HEAD)
    ForkingPickler(buf).dump(obj)
    view = buf.getbuffer()
    HEAD.pack_into(view, 0, len(view) - HEAD.size)
    return view


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
            body = read_exact(rfd, size)
            if body is None:
                return
            try:
                fn, args = pickle.loads(body)
            except BaseException as exc:  # a task that cannot be unpickled here fails alone
                fn, args = _reply.Entry(_raise, origin), (exc,)
            del body  # a batch's fetched payloads, pickled: not kept while the task runs,
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


"""The lanes' wire (see :mod:`aioloader._lanes`) and a worker's side of its lane.

A message is an 8-byte little-endian length and a pickle (``ForkingPickler``, as the
executor's); a length of zero asks the worker to stop. A worker runs the tasks of its
lane in the order they come and writes each reply back in the same form.

Worker-side: this module never imports asyncio.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import struct
from multiprocessing.reduction import ForkingPickler
from typing import Any

from . import _reply

__all__ = ["HEAD", "READ", "frame", "read_exact", "serve"]

HEAD = struct.Struct("<Q")
READ = 1 << 18  # most bytes one read takes from a pipe

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
            if head is None or not HEAD.unpack(head)[0]:
                return
            body = read_exact(rfd, HEAD.unpack(head)[0])
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

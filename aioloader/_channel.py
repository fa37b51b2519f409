"""A worker's channel: the one duplex socket between an owned worker and its pool.

The pool (:mod:`aioloader._pool.procs`) writes tasks into it and reads the replies;
the worker runs the tasks in the order they come and answers each in turn, so a
reply needs no id. A message is a frame: an 8-byte little-endian length and a pickle.
A task is ``(fn, args)``; a reply is ``(ok, value)`` (see :func:`reply`); a length of
zero asks the worker to stop, and so does the end of the socket (the consumer is
gone).

Worker side: this module never imports asyncio.
"""

from __future__ import annotations

import os
import pickle
import struct
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler
from typing import Any

__all__ = ["HEAD", "JOIN_MAX", "READ", "frame", "frame_parts", "pickled", "read_exact", "serve"]

HEAD = struct.Struct("<Q")
READ = 1 << 18  # most bytes one read takes from the socket
JOIN_MAX = 1 << 16  # a pickle up to this size is copied behind its head, into one buffer


def pickled(obj: Any) -> bytes:
    """``obj`` pickled for a channel (raises what pickling raises). multiprocessing's
    pickler (which knows its connections and sockets) only where the plain one fails:
    it copies a table of reducers each time it is made."""
    try:
        return pickle.dumps(obj, pickle.HIGHEST_PROTOCOL)
    except Exception:
        return bytes(ForkingPickler.dumps(obj, pickle.HIGHEST_PROTOCOL))


def frame(obj: Any) -> memoryview:
    """``obj`` pickled behind its length, in one buffer."""
    return _join(pickled(obj))


def frame_parts(obj: Any) -> tuple[memoryview, ...]:
    """``obj``'s frame as buffers to write in order: one, or for a large pickle (a
    batch of fetched payloads) its head and the pickle as it is, not copied behind it."""
    data = pickled(obj)
    if len(data) <= JOIN_MAX:
        return (_join(data),)
    return memoryview(HEAD.pack(len(data))), memoryview(data)


def _join(data: bytes) -> memoryview:
    return memoryview(HEAD.pack(len(data)) + data)


def read_exact(fd: int, n: int) -> bytes | bytearray | None:
    """``n`` bytes from ``fd``, or ``None`` at its end. A large task is read into one
    buffer of its size rather than joined from the socket's pieces."""
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


def serve(fd: int, run: Callable[[Callable[..., Any], tuple[Any, ...]], memoryview]) -> bool:
    """A worker's loop: read a task, drop its pickle, ``run`` it into a reply frame,
    drop its arguments, write the reply. Returns ``True`` when asked to stop, ``False``
    when the consumer's end closed (it is gone)."""
    while True:
        try:
            head = read_exact(fd, HEAD.size)
        except ConnectionResetError:
            return False
        if head is None:
            return False
        size = HEAD.unpack(head)[0]
        if not size:
            return True
        body = read_exact(fd, size)
        if body is None:
            return False
        try:
            fn, args = pickle.loads(body)
        except BaseException as exc:  # a task that cannot be unpickled here fails alone
            fn, args = _raise, (exc,)
        del body  # a batch's fetched payloads, pickled: not kept while the task runs
        view = run(fn, args)
        del fn, args  # nor the payloads themselves while the next task is awaited
        while view:
            try:
                view = view[os.write(fd, view) :]
            except (BrokenPipeError, ConnectionResetError):
                return False


def _raise(exc: BaseException) -> None:
    raise exc

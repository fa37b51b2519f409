"""A worker's channel: the one duplex socket between an owned worker and its pool.

The pool (:mod:`aioloader._pool.procs`) writes tasks into it and reads the replies;
the worker runs the tasks in the order they come and answers each in turn, so a
reply needs no id. A message is a frame: an 8-byte little-endian length and a pickle.
A task is ``(fn, args)``; a reply is ``(ok, value)`` (see :func:`reply`); a length of
zero asks the worker to stop, and so does the end of the socket (the consumer is
gone).

A task's large ``bytes`` (a batch of fetched payloads, in :class:`Carried`) travel
*beside* its pickle, as pickle protocol 5's out-of-band buffers: the consumer writes
them from the objects it holds, uncopied, and its heap never holds a second copy of a
batch. Such a frame's length has :data:`BESIDE` set; its body is the buffers' count and
lengths, the pickle, then the buffers.

A task that lasts (an iterable dataset's shard) talks with the consumer while it runs,
through the worker's :class:`Link` (:func:`current_link`): messages out (a batch) and
in (a credit). Their frames have :data:`PART` set in their length. The pool hands a
message out to the job it belongs to, the oldest unanswered one of the channel, and
the task's reply still ends it. A message in that finds its task ended is dropped.

Worker side: this module never imports asyncio.
"""

from __future__ import annotations

import io
import os
import pickle
import struct
import threading
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler
from typing import Any

from . import tensors as _tensors

__all__ = [
    "BESIDE", "HEAD", "JOIN_MAX", "PART", "READ", "SIZE", "Carried", "Link", "current_link", "frame", "frame_parts",
    "pickled", "read_exact", "serve", "set_link",
]  # fmt: skip

HEAD = struct.Struct("<Q")
READ = 1 << 18  # most bytes one read takes from the socket
JOIN_MAX = 1 << 16  # a pickle up to this size is copied behind its head, into one buffer
BESIDE = 1 << 63  # in a frame's length: buffers travel beside the pickle
PART = 1 << 62  # in a frame's length: a message of the running task (see Link)
SIZE = PART - 1  # a frame's length: its bits that count bytes
BESIDE_MIN = 1 << 14  # a bytes object this large goes beside the pickle
_COUNT = struct.Struct("<I")


class Carried(tuple):  # type: ignore[type-arg]
    """Values a task carries to its worker (fetched samples), as a tuple.

    Pickled at protocol 5, each ``bytes`` of :data:`BESIDE_MIN` bytes or more is offered
    as an out-of-band buffer: a value, or a member of a value that is a tuple or a dict
    (``(data, label)``, ``{"jpg": data}``). A channel frame carries such a buffer beside
    the pickle, uncopied; any other pickler (a borrowed executor's) keeps it in the
    pickle. The worker gets ``bytes`` back either way. Only ``bytes`` go out of band:
    nobody can change them between the submission and the write."""

    __slots__ = ()

    def __reduce_ex__(self, protocol: Any) -> Any:
        if isinstance(protocol, int) and protocol >= 5:
            lifted = [_lift(v) for v in self]
            if any(a is not b for a, b in zip(lifted, self, strict=True)):
                return _rebuilt, (lifted,)
        return Carried, (tuple(self),)


def _lift(value: Any) -> Any:
    kind = type(value)
    if kind is bytes:
        return pickle.PickleBuffer(value) if len(value) >= BESIDE_MIN else value
    if kind is tuple and any(type(v) is bytes and len(v) >= BESIDE_MIN for v in value):
        return tuple(_lift(v) if type(v) is bytes else v for v in value)
    if kind is dict and any(type(v) is bytes and len(v) >= BESIDE_MIN for v in value.values()):
        return {k: _lift(v) if type(v) is bytes else v for k, v in value.items()}
    return value


def _bytes(value: Any) -> Any:
    return bytes(value) if type(value) is memoryview else value  # a buffer of the frame


def _rebuilt(values: list[Any]) -> Carried:
    for i, v in enumerate(values):
        kind = type(v)
        if kind is memoryview:
            values[i] = bytes(v)
        elif kind is tuple:
            values[i] = tuple(_bytes(x) for x in v)
        elif kind is dict:
            values[i] = {k: _bytes(x) for k, x in v.items()}
    return Carried(values)


def pickled(obj: Any, beside: list[memoryview] | None = None) -> bytes:
    """``obj`` pickled for a channel (raises what pickling raises). multiprocessing's
    pickler (which knows its connections and sockets) only where the plain one fails:
    it copies a table of reducers each time it is made.

    With ``beside``, the ``bytes`` that :class:`Carried` offers out of band are left
    out of the pickle and appended there; any other buffer stays in the pickle."""
    callback = None
    if beside is not None:

        def callback(buffer: pickle.PickleBuffer) -> bool:
            view = buffer.raw()
            if type(view.obj) is not bytes:
                return True  # in the pickle: a snapshot of a buffer that may change
            beside.append(view)
            return False

    try:
        table = _tensors.dispatch_table()
        if table is None:
            return pickle.dumps(obj, pickle.HIGHEST_PROTOCOL, buffer_callback=callback)
        out = io.BytesIO()
        pickler = pickle.Pickler(out, pickle.HIGHEST_PROTOCOL, buffer_callback=callback)
        pickler.dispatch_table = table  # tensors as numpy arrays (see aioloader._worker.tensors)
        pickler.dump(obj)
        return out.getvalue()
    except Exception:
        if beside is not None:
            beside.clear()  # all in the pickle: this pickler takes no buffer callback
        return bytes(ForkingPickler.dumps(obj, pickle.HIGHEST_PROTOCOL))


def frame(obj: Any) -> memoryview:
    """``obj`` pickled behind its length, in one buffer."""
    return _join(pickled(obj))


def frame_parts(obj: Any, flags: int = 0, beside: bool = True) -> tuple[memoryview, ...]:
    """``obj``'s frame as buffers to write in order: one; for a large pickle its head
    and the pickle as it is, not copied behind it; and, with ``beside``, the buffers
    that go beside the pickle (see :class:`Carried`), as the objects that hold them.
    ``flags`` (:data:`PART`) are set in the frame's length."""
    views: list[memoryview] = []
    data = pickled(obj, views if beside else None)
    if views:
        meta = _COUNT.pack(len(views)) + b"".join(HEAD.pack(v.nbytes) for v in views)
        size = len(meta) + len(data) + sum(v.nbytes for v in views)
        head = HEAD.pack(flags | BESIDE | size) + meta
        if len(data) <= JOIN_MAX:
            return (memoryview(head + data), *views)
        return (memoryview(head), memoryview(data), *views)
    if len(data) <= JOIN_MAX:
        return (_join(data, flags),)
    return memoryview(HEAD.pack(flags | len(data))), memoryview(data)


def loads(body: bytes | bytearray, beside: bool) -> Any:
    """Unpickle a frame's body (see :func:`frame_parts`)."""
    if not beside:
        return pickle.loads(body)
    view = memoryview(body)
    (count,) = _COUNT.unpack_from(view)
    lengths = [HEAD.unpack_from(view, _COUNT.size + HEAD.size * i)[0] for i in range(count)]
    start = _COUNT.size + HEAD.size * count
    end = len(view) - sum(lengths)
    buffers = []
    at = end
    for n in lengths:
        buffers.append(view[at : at + n])
        at += n
    return pickle.loads(view[start:end], buffers=buffers)


def _join(data: bytes, flags: int = 0) -> memoryview:
    return memoryview(HEAD.pack(flags | len(data)) + data)


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


def _read(fd: int) -> tuple[int, bytes | bytearray] | None:
    """The next frame: its length word (flags included) and its body; ``None`` at the
    end of the socket (the consumer is gone)."""
    try:
        head = read_exact(fd, HEAD.size)
        if head is None:
            return None
        word = HEAD.unpack(head)[0]
        if not word & SIZE:
            return word, b""
        body = read_exact(fd, word & SIZE)
    except ConnectionResetError:
        return None
    return None if body is None else (word, body)


class Link:
    """The running task's way to its consumer over the worker's channel: :meth:`send`
    a message out (the pool hands it to the task's job), :meth:`recv` one in (what the
    pool was told for the job). Messages are any picklable objects."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._held: tuple[int, bytes | bytearray] | None = None  # a frame that is not the task's
        self._gone = False

    def send(self, obj: Any) -> None:
        """Raises what pickling raises, or ``BrokenPipeError`` when the consumer is gone."""
        for view in frame_parts(obj, PART, beside=False):  # the pool reads it in place
            while view:
                view = view[os.write(self.fd, view) :]

    def recv(self) -> Any:
        """The consumer's next message to the running task (blocking); ``None`` when no
        more will come: the consumer is gone, or asks this worker to stop."""
        if self._held is not None or self._gone:
            return None
        got = _read(self.fd)
        if got is None:
            self._gone = True
            return None
        word, body = got
        if word & PART:
            return loads(body, bool(word & BESIDE))
        self._held = got  # a stop (or a task): the serve loop's, once the task returns
        return None

    def take(self) -> tuple[int, bytes | bytearray] | None:
        """The next frame for the serve loop."""
        held, self._held = self._held, None
        if held is not None:
            return held
        return None if self._gone else _read(self.fd)


_current = threading.local()


def current_link() -> Any:
    """The running task's link to its consumer (a :class:`Link`, or the loader thread's
    own kind), or ``None`` where the task has none (a borrowed executor)."""
    return getattr(_current, "link", None)


def set_link(link: Any) -> None:
    _current.link = link


def serve(fd: int, run: Callable[[Callable[..., Any], tuple[Any, ...]], memoryview]) -> bool:
    """A worker's loop: read a task, drop its pickle, ``run`` it into a reply frame,
    drop its arguments, write the reply. Returns ``True`` when asked to stop, ``False``
    when the consumer's end closed (it is gone)."""
    link = Link(fd)
    set_link(link)
    try:
        try:  # an empty message: "up" (the pool gives work to a started worker first)
            os.write(fd, HEAD.pack(PART))
        except (BrokenPipeError, ConnectionResetError):
            return False
        while True:
            got = link.take()
            if got is None:
                return False
            word, body = got
            if word & PART:
                continue  # a message for a task that has ended
            if not word & SIZE:
                return True
            try:
                fn, args = loads(body, bool(word & BESIDE))
            except BaseException as exc:  # a task that cannot be unpickled here fails alone
                fn, args = _raise, (exc,)
            del body, got  # a batch's fetched payloads, pickled: not kept while the task runs
            view = run(fn, args)
            del fn, args  # nor the payloads themselves while the next task is awaited
            while view:
                try:
                    view = view[os.write(fd, view) :]
                except (BrokenPipeError, ConnectionResetError):
                    return False
    finally:
        set_link(None)


def _raise(exc: BaseException) -> None:
    raise exc

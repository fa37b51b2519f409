"""How a task's outcome travels back: small messages in the pipe, large ones beside it.

Why: a ``ProcessPoolExecutor`` reads every result from one pipe shared by all workers.
A worker killed half-way through writing a large result leaves half a message there;
the executor's manager thread then waits for the rest forever, sees no worker death
and no timeout, and blocks interpreter exit too. Linux writes of at most ``PIPE_BUF``
(4,096) bytes to a pipe are atomic, so a channel whose messages are all smaller than
that cannot be left half-written by a dying worker.

So the pool runs every task through :class:`Entry`, which never raises and returns
a reply small enough for one atomic write:

* **in the consumer's own process** (threads): the :class:`Outcome` itself, nothing
  pickled;
* **up to** :data:`INLINE_MAX` **bytes pickled**: the pickle, inline;
* **larger**, from a worker of a process pool on the consumer's host (same
  :func:`~aioloader._shm.host_key`, another pid): the pickle is *spilled* beside the
  pipe, into the worker's ring (up to 256 KiB, :mod:`aioloader._spill`) or else a file,
  and the reply names where. Out-of-band pickle buffers (numpy arrays)
  are written straight from the arrays, and arrive as views of one buffer;
* **larger, anywhere else** (a dask worker, or no room to spill): inline, as before.

Exceptions travel the same way (tracebacks can be large), ``BaseException`` included:
the reply carries the exception and its formatted traceback, rebuilt in the consumer
as the exception with a :class:`RemoteTraceback` as ``__cause__``. An exception that
does not survive pickling arrives as :class:`~aioloader.RemoteError`.

Spill files, and who frees them
-------------------------------
Named ``aioloader_<consumer pid>_<worker pid>_spill<nonce>_<seq>``, in ``/dev/shm``
when it has room for the file, else in the temporary directory, mode 0600, created
with ``O_EXCL``.

1. The consumer unlinks a spill file on arrival: the reply is unpickled by the
   executor's result thread as soon as it is read, whether or not anyone still
   awaits the task, and that unpickling reads the file and unlinks it.
2. A worker killed after it created a spill file but before its reply was written
   leaves the file behind: the pool removes every spill file of a dead worker once
   that worker's generation is retired (nothing can read its replies any more), and
   names of this consumer's dead workers older than a few seconds whenever it sweeps.
3. A consumer that is killed: its workers (owned pools watch their consumer) unlink
   the files they wrote last; names whose consumer and worker are both gone, owned
   by this user and over a minute old, are removed by the next pool that starts.

Arrival runs in the executor's result thread, where an exception would break the
whole pool: it never raises; a failure becomes the task's exception.

This module never imports asyncio.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import io
import itertools
import os
import pickle
import secrets
import struct
import tempfile
import threading
import traceback
from collections.abc import Callable, Iterable
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np

from . import _culprit, _orphan, _spill
from ._shm import PREFIX, SHM_DIR, host_key
from .errors import RemoteError, SharedMemoryError, add_note

__all__ = [
    "INLINE_MAX",
    "Entry",
    "Failed",
    "Origin",
    "Outcome",
    "RemoteTraceback",
    "origin",
    "process_label",
    "sweep_spills",
    "travelling",
]

#: Largest pickled outcome sent through the pipe from a worker that could spill: with
#: the executor's own wrapping the message stays well under PIPE_BUF.
INLINE_MAX = 3 * 1024
ROOM_CHECK = 1 << 20  # spills this large look for room first (a write to tmpfs is all-or-error)

# (consumer pid, consumer host key, directories a worker may spill into, in order).
Origin = tuple[int, tuple[str, int, int, int], tuple[str, ...]]


def spill_dirs() -> tuple[str, ...]:
    """Where this consumer's workers put spill files, in order of preference (tests
    replace this function)."""
    return (SHM_DIR, tempfile.gettempdir())


def origin(spill: bool) -> Origin:
    """What a task must know about the consumer to choose how to reply; ``spill``:
    its workers may spill (a process pool's result pipe, read as results arrive)."""
    return (os.getpid(), host_key(), spill_dirs() if spill else ())


class RemoteTraceback(Exception):
    """The ``__cause__`` of an exception raised in a worker: its traceback there."""

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return self.tb


class Outcome:
    """A task's outcome in the consumer: ``ok`` and its return value, or the exception
    it raised (``ok`` false)."""

    __slots__ = ("ok", "value")

    def __init__(self, ok: bool, value: Any) -> None:
        self.ok = ok
        self.value = value

    def unwrap(self) -> Any:
        """The value, or raise the exception (``SystemExit`` and other
        ``BaseException``s too: the engine carries those to the consumer as values, so
        that they cannot stop the event loop that runs the iteration)."""
        if self.ok:
            return self.value
        raise self.value


class Entry:
    """The callable the pool submits: runs ``fn(task)`` and replies (see module doc).

    Never raises. Pickles as ``fn`` and the consumer's :data:`Origin`, so a task still
    carries only what it did before."""

    __slots__ = ("fn", "origin")

    def __init__(self, fn: Callable[[Any], Any], origin: Origin) -> None:
        self.fn = fn
        self.origin = origin

    def __reduce__(self) -> tuple[Any, ...]:
        return (Entry, (self.fn, self.origin))

    def __call__(self, task: Any) -> Any:
        consumer, host, dirs = self.origin
        local = host == host_key()
        _running.consumer = consumer if local else 0
        try:
            value, ok = self.fn(task), True
        except BaseException as exc:  # SystemExit too: it must not end the worker
            value, ok = exc, False
        if local and consumer == os.getpid():
            return Outcome(ok, value)
        dirs = dirs if local else ()
        try:
            return _pack(ok, value, dirs, consumer)
        except BaseException as exc:
            # The failure path only: name the batch, the sample and the field that will not pickle.
            kept = _culprit.salvage(value if ok else None, task, exc, process_label())
            if kept is not None:  # a group, whose other batches still travel
                with contextlib.suppress(Exception):
                    return _pack(True, kept, dirs, consumer)
            return _pack(False, exc, dirs, consumer)


_note = add_note

# The consumer's pid for the task this thread runs (0 when it is on another host).
_running = threading.local()


def process_label() -> str:
    """The process running this thread's task, as error notes name it: a worker, or the
    consumer itself (``num_workers=0``, a borrowed thread executor)."""
    pid = os.getpid()
    if getattr(_running, "consumer", 0) == pid:
        return f"the main process (pid {pid})"
    return f"worker pid {pid}"


class Failed:
    """One part of a reply that failed while the rest succeeded (a batch of a group):
    its exception and traceback, ready to pickle; :meth:`exception` in the consumer
    rebuilds it as a task's own exception arrives (a :class:`RemoteTraceback` cause)."""

    __slots__ = ("exc", "tb")

    def __init__(self, exc: BaseException, tb: str) -> None:
        self.exc = exc
        self.tb = tb

    @classmethod
    def of(cls, exc: BaseException) -> Failed:
        return cls(*_portable(exc))

    def __reduce__(self) -> tuple[Any, ...]:
        return (Failed, (self.exc, self.tb))

    def exception(self) -> BaseException:
        exc = self.exc
        if exc.__cause__ is None:
            exc.__cause__ = RemoteTraceback(self.tb)
        return exc


def travelling(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling, else a :class:`~aioloader.RemoteError` standing
    for it (with its notes and traceback text)."""
    return _portable(exc)[0]


def _portable(exc: BaseException) -> tuple[BaseException, str]:
    """``exc`` (or a RemoteError standing for it) and its traceback, ready to pickle."""
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        why = "(the original exception could not be pickled; its traceback is in .remote_traceback)"
        exc = _remote(exc, tb, why)
    exc.__traceback__ = None  # frames hold the batch's objects; the text is enough
    return exc, '\n"""\n' + tb + '"""'


def _remote(exc: BaseException, tb: str, why: str) -> RemoteError:
    """A RemoteError standing for ``exc``, with its notes."""
    name = f"{type(exc).__module__}.{type(exc).__qualname__}"
    err = RemoteError(f"{name}: {exc} {why}", type_name=name, original_message=str(exc), remote_traceback=tb)
    for note in getattr(exc, "__notes__", ()):
        _note(err, note)
    return err


def _dumps(obj: Any, buffers: list[pickle.PickleBuffer] | None) -> bytes:
    """Pickle ``obj``; with ``buffers``, numpy buffers too large to be inline anyway go
    out of band into it (smaller ones stay in the stream, so a small batch is pickled
    once, and any out-of-band buffer means a spill)."""
    buf = io.BytesIO()
    callback = None if buffers is None else functools.partial(_out_of_band, buffers)
    ForkingPickler(buf, 5, True, callback).dump(obj)  # its __init__ takes positional arguments only
    return buf.getvalue()


def _out_of_band(buffers: list[pickle.PickleBuffer], b: pickle.PickleBuffer) -> bool:
    if b.raw().nbytes <= INLINE_MAX:
        return True  # in band
    buffers.append(b)
    return False


class _Inline:
    """A reply pickled in full; unpickles as its :class:`Outcome`."""

    __slots__ = ("data", "ok")

    def __init__(self, ok: bool, data: bytes) -> None:
        self.ok = ok
        self.data = data

    def __reduce__(self) -> tuple[Any, ...]:
        return (_unpack_inline, (self.ok, self.data))


class _Ringed:
    """A reply whose pickle lies in its worker's ring; unpickles (copying it out, which
    frees its space) as its :class:`Outcome`."""

    __slots__ = ("need", "ok", "path", "pid", "pos")

    def __init__(self, ok: bool, path: str, pos: int, need: int) -> None:
        self.ok, self.path, self.pos, self.need = ok, path, pos, need
        self.pid = os.getpid()

    def __reduce__(self) -> tuple[Any, ...]:
        return (_unpack_ringed, (self.ok, self.path, self.pos, self.need, self.pid))


class _Spilled:
    """A reply whose pickle lies in a file; unpickles (reading and unlinking the file)
    as its :class:`Outcome`."""

    __slots__ = ("ok", "path", "pid")

    def __init__(self, ok: bool, path: str) -> None:
        self.ok = ok
        self.path = path
        self.pid = os.getpid()

    def __reduce__(self) -> tuple[Any, ...]:
        return (_unpack_spilled, (self.ok, self.path, self.pid))


def _pack(ok: bool, value: Any, dirs: tuple[str, ...], consumer: int) -> _Inline | _Spilled | _Ringed:
    obj = value if ok else _portable(value)
    buffers: list[pickle.PickleBuffer] = []
    head = _dumps(obj, buffers)
    size = len(head) + sum(b.raw().nbytes for b in buffers)
    if size > INLINE_MAX and dirs:
        spilled = _spill_out(ok, head, buffers, dirs, consumer)
        if spilled is not None:
            return spilled
    # Out-of-band buffers come only with outcomes over INLINE_MAX: here they mean that no
    # spill directory had room, and the outcome goes through the pipe as before.
    return _Inline(ok, _dumps(obj, None) if buffers else head)


# ----------------------------------------------------------------------- worker: spilling
_prefixes: dict[tuple[int, int], str] = {}  # (consumer, worker pid) -> name prefix
_seq = itertools.count()
_written: collections.deque[str] = collections.deque(maxlen=8)  # removed if the consumer dies


def _spill_out(
    ok: bool, head: bytes, buffers: list[pickle.PickleBuffer], dirs: tuple[str, ...], consumer: int
) -> _Spilled | _Ringed | None:
    """Put the pickle and its buffers in this worker's ring (:mod:`aioloader._spill`)
    or else in a new file in the first of ``dirs`` with room for it; ``None`` if none has."""
    parts: list[Any] = [head, *(b.raw() for b in buffers)]
    sizes = [memoryview(p).nbytes for p in parts]
    table = struct.pack(f"<{len(parts) + 1}q", len(parts), *sizes)
    parts.insert(0, table)
    sizes.insert(0, len(table))
    need = sum(map(_spill.aligned, sizes))
    prefix = _name_prefix(consumer)
    ringed = _spill.put(dirs[0], prefix, parts, sizes, need)
    if ringed is not None:
        return _Ringed(ok, *ringed, need)
    name = f"{prefix}{next(_seq)}"
    for directory in dirs:
        if need >= ROOM_CHECK:  # a smaller write that finds no room fails with ENOSPC
            with contextlib.suppress(OSError):
                st = os.statvfs(directory)
                if st.f_bavail * st.f_frsize < need:
                    continue
        path = os.path.join(directory, name)
        try:
            _spill.write(path, parts)
        except OSError:
            continue
        _written.append(path)
        return _Spilled(ok, path)
    return None


def _name_prefix(consumer: int) -> str:
    """``<prefix><consumer>_<worker>_spill<nonce>_``: what this worker's spill files and
    ring are named after (made once per worker and consumer)."""
    key = (consumer, os.getpid())
    prefix = _prefixes.get(key)
    if prefix is None:
        if not _prefixes:
            _orphan.on_orphaned(_remove_written)
        nonce = secrets.token_hex(4)
        prefix = _prefixes[key] = f"{PREFIX}{consumer}_{os.getpid()}_{_spill.SPILL_TAG}{nonce}_"
    return prefix


def _remove_written() -> None:
    for path in list(_written):
        with contextlib.suppress(OSError):
            os.unlink(path)


# ---------------------------------------------------------------------- consumer: arrival
def _outcome(ok: bool, obj: Any) -> Outcome:
    if ok:
        return Outcome(True, obj)
    exc, tb = obj
    exc.__cause__ = RemoteTraceback(tb)
    return Outcome(False, exc)


def _unpack_inline(ok: bool, data: bytes) -> Outcome:
    try:
        return _outcome(ok, pickle.loads(data))
    except BaseException as exc:
        return _unreadable(exc, "")


def _unreadable(exc: BaseException, where: str) -> Outcome:
    _note(exc, f"aioloader: raised while unpickling a task's result{where} in the consumer")
    return Outcome(False, exc)


def _unpack_spilled(ok: bool, path: str, pid: int) -> Outcome:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        return Outcome(False, SharedMemoryError(f"the result worker pid {pid} left in {path} is gone: {exc}"))
    try:
        os.unlink(path)
        data = np.empty(os.fstat(fd).st_size, dtype=np.uint8)
        view = data.data
        done = 0
        while done < view.nbytes:
            n = os.readv(fd, [view[done:]])
            if n == 0:
                raise EOFError(f"{path} ends after {done} of {view.nbytes} bytes")
            done += n
    except BaseException as exc:
        return Outcome(
            False, SharedMemoryError(f"cannot read the result worker pid {pid} left in {path}: {exc}")
        )
    finally:
        os.close(fd)
    return _load(ok, view, pid)


def _unpack_ringed(ok: bool, path: str, pos: int, need: int, pid: int) -> Outcome:
    try:
        data = _spill.copy_out(path, pos, need, pid)
    except (OSError, ValueError) as exc:
        return Outcome(
            False, SharedMemoryError(f"cannot read the result worker pid {pid} left in {path}: {exc}")
        )
    return _load(ok, data.data, pid)


def _load(ok: bool, view: memoryview, pid: int) -> Outcome:
    """Unpickle a spilled reply: its table of part sizes, then its parts (64-byte aligned)."""
    try:
        (count,) = struct.unpack_from("<q", view)
        sizes = struct.unpack_from(f"<{count}q", view, 8)
        parts = []
        off = _spill.aligned(8 * (count + 1))
        for n in sizes:
            parts.append(view[off : off + n])
            off += _spill.aligned(n)
        return _outcome(ok, pickle.loads(parts[0], buffers=parts[1:]))
    except BaseException as exc:
        return _unreadable(exc, f" from worker pid {pid}")


def sweep_spills(dead: Iterable[int] = ()) -> int:
    """Remove spill files nobody will read (see :func:`aioloader._spill.sweep`); returns
    how many."""
    return _spill.sweep(spill_dirs(), dead)

"""What every RecordIO module shares: constants, errors, and the per-process file handle.

A :class:`FileHandle` is one read-only file opened lazily, once per process, with an
at-fork hook that makes a forked child drop the parent's descriptor (never closing the
parent's file) and renew its lock. A :class:`Window` serves byte ranges of such a file
from one buffer and never reads past the file's end, so a corrupt length field costs an
error, not an allocation.
"""

from __future__ import annotations

import os
import struct
import threading
import weakref
from types import TracebackType
from typing import Any, Protocol, TypeAlias, TypeVar

import numpy as np
import numpy.typing as npt

from ..errors import RecordIOError

MAGIC = 0xCED7230A
"""The word that starts every part header (bytes ``0a 23 d7 ce`` on disk)."""

MAX_RECORD_SIZE = (1 << 29) - 1
"""The largest payload, in bytes, a record can hold (lengths are stored in 29 bits)."""

StrPath: TypeAlias = "str | os.PathLike[str]"
Buffer: TypeAlias = "bytes | bytearray | memoryview | npt.NDArray[Any]"

MAGIC_BYTES = struct.pack("<I", MAGIC)
PART = struct.Struct("<II")
_O_FLAGS = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)


_C = TypeVar("_C", bound="Closing")


class Closing:
    """``with`` support for objects with a ``close()`` method: the block closes them."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self: _C) -> _C:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def fail(message: str, path: str | None, key: int | None, offset: int | None) -> RecordIOError:
    """The error for ``message``; its text and attributes name the file, key and offset."""
    where = path if path is not None else "<record>"
    parts = [where]
    if key is not None:
        parts.append(f"key {key}")
    if offset is not None:
        parts.append(f"byte offset {offset}")
    return RecordIOError(f"{', '.join(parts)}: {message}", path=path, key=key, offset=offset)


_live_handles: weakref.WeakSet[FileHandle] = weakref.WeakSet()


def _forget_parent_handles() -> None:
    # Runs in the child right after os.fork(), while it has a single thread: locks held by
    # other parent threads would never be released here, and the descriptors are the
    # parent's, so each handle starts over.
    for handle in list(_live_handles):
        handle._after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_parent_handles)


def _close_cell(cell: list[int | None]) -> None:
    """Close the descriptor in ``cell`` (``[fd, owner pid]``) if this process opened it."""
    fd, owner = cell
    cell[0] = cell[1] = None
    if fd is not None and owner == os.getpid():
        try:
            os.close(fd)
        except OSError:
            pass


class FileHandle:
    """One read-only file, opened lazily and once per process, closed when unused.

    ``acquire()``/``release()`` bracket every use of the descriptor so that ``close()``
    from another thread never closes it under a running ``pread`` (after which the number
    could be reused by an unrelated file).
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._cell: list[int | None] = [None, None]  # [fd, pid that opened it]
        self._users = 0
        self._closed = False
        self.size = 0
        weakref.finalize(self, _close_cell, self._cell)
        _live_handles.add(self)

    @property
    def closed(self) -> bool:
        return self._closed

    def acquire(self) -> int:
        pid = os.getpid()
        with self._lock:
            if self._closed:
                raise ValueError(f"read from a closed record file: {self.path}")
            fd, owner = self._cell
            if fd is None or owner != pid:
                # A descriptor from another process (a fork without at-fork hooks) is left
                # alone: it is not ours to close.
                fd = os.open(self.path, _O_FLAGS)
                self._cell[0], self._cell[1] = fd, pid
                self._users = 0
                self.size = os.fstat(fd).st_size
            self._users += 1
            return fd

    def release(self) -> None:
        with self._lock:
            self._users -= 1
            if self._closed and self._users <= 0:
                _close_cell(self._cell)

    def refresh_size(self, fd: int) -> int:
        self.size = os.fstat(fd).st_size
        return self.size

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._users <= 0:
                _close_cell(self._cell)

    def _after_fork_in_child(self) -> None:
        self._lock = threading.Lock()
        self._users = 0
        fd = self._cell[0]
        self._cell[0] = self._cell[1] = None
        if fd is not None:
            # The child's copy of the parent's descriptor: closing it here leaves the
            # parent's open file untouched.
            try:
                os.close(fd)
            except OSError:
                pass


def pread_full(fd: int, n: int, offset: int) -> bytes:
    data = os.pread(fd, n, offset)
    if len(data) == n or not data:
        return data
    pieces = [data]
    got = len(data)
    while got < n:
        more = os.pread(fd, n - got, offset + got)
        if not more:
            break
        pieces.append(more)
        got += len(more)
    return b"".join(pieces)


class ByteWindow(Protocol):
    """What the record decoder reads from: a file or an object of ``size`` bytes."""

    @property
    def size(self) -> int: ...

    def available(self, offset: int, n: int) -> bool: ...

    def get(self, offset: int, n: int) -> bytes: ...


class Window:
    """Bytes ``[start, start + len(data))`` of a file, refilled on demand.

    ``get`` never asks the OS for more than the file holds, so a corrupt length field
    costs an error, not a huge allocation.
    """

    __slots__ = ("chunk", "data", "fd", "handle", "start")

    def __init__(self, handle: FileHandle, fd: int, start: int, data: bytes, chunk: int) -> None:
        self.handle = handle
        self.fd = fd
        self.start = start
        self.data = data
        self.chunk = chunk

    @property
    def size(self) -> int:
        return self.handle.size

    def available(self, offset: int, n: int) -> bool:
        """True when ``[offset, offset + n)`` lies inside the file."""
        end = offset + n
        return end <= self.handle.size or end <= self.handle.refresh_size(self.fd)

    def get(self, offset: int, n: int) -> bytes:
        rel = offset - self.start
        if 0 <= rel and rel + n <= len(self.data):
            if rel == 0 and n == len(self.data):
                return self.data
            return self.data[rel : rel + n]
        if self.chunk > n:
            want = min(self.chunk, max(self.handle.size - offset, n))
            self.data = pread_full(self.fd, want, offset)
            self.start = offset
            return self.data[:n] if len(self.data) > n else self.data
        return pread_full(self.fd, n, offset)


def as_view(payload: Buffer) -> memoryview:
    """``payload`` as a flat memoryview of bytes (no copy)."""
    view = payload.data if isinstance(payload, np.ndarray) else memoryview(payload)
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B")
    return view


def default_idx_path(path: str) -> str:
    """MXNet's convention: the ``.idx`` sits beside the ``.rec``, same name."""
    return os.path.splitext(path)[0] + ".idx"

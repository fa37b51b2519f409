"""Sequential reading of a ``.rec`` file, and the record decoder both readers use."""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Iterator
from typing import Any

from .rio_files import (
    MAGIC,
    MAGIC_BYTES,
    MAX_RECORD_SIZE,
    PART,
    ByteWindow,
    Closing,
    FileHandle,
    StrPath,
    Window,
    fail,
)

__all__ = ["ReaderBase", "RecordReader", "read_record"]

_LENGTH_MASK = (1 << 29) - 1
# Sequential scans read ahead in chunks of this size.
_SCAN_CHUNK = 1 << 20


def read_record(
    window: ByteWindow,
    offset: int,
    *,
    path: str,
    key: int | None,
    from_index: bool,
) -> tuple[bytes, int]:
    """Decode the record whose first part header is at ``offset``.

    Returns the payload and the offset just past the record (padding included).
    """
    pieces: list[bytes] = []
    pos = offset
    first = True
    while True:
        if not window.available(pos, 8):
            if first and from_index:
                msg = f"offset is past the end of the file ({window.size} bytes)"
                if pos < window.size:
                    msg = (
                        f"only {window.size - pos} bytes left, too few for a record "
                        f"header; the offset does not point at a record"
                    )
                raise fail(msg, path, key, offset)
            raise fail(
                f"truncated record: the part header at byte {pos} is cut off by the end "
                f"of the file ({window.size} bytes)",
                path,
                key,
                offset,
            )
        magic, lrec = PART.unpack(window.get(pos, 8))
        if magic != MAGIC:
            if first:
                what = (
                    "the offset (from the .idx or the caller) does not point at a record header"
                    if from_index
                    else "no record header here"
                )
                raise fail(f"bad magic 0x{magic:08x} (expected 0x{MAGIC:08x}): {what}", path, key, offset)
            raise fail(
                f"bad magic 0x{magic:08x} in the continuation part at byte {pos} (expected 0x{MAGIC:08x})",
                path,
                key,
                offset,
            )
        cflag = lrec >> 29
        length = lrec & _LENGTH_MASK
        if first and cflag not in (0, 1):
            what = "a continuation part" if cflag in (2, 3) else "an invalid part"
            raise fail(
                f"cflag {cflag} where a record should start ({what}; expected 0 or 1)",
                path,
                key,
                offset,
            )
        if not first and cflag not in (2, 3):
            raise fail(
                f"the part at byte {pos} has cflag {cflag}, but the record's earlier part "
                f"announced a continuation (expected 2 or 3)",
                path,
                key,
                offset,
            )
        padded = (length + 3) & ~3
        if not window.available(pos + 8, padded):
            raise fail(
                f"truncated record: the part at byte {pos} needs {8 + padded} bytes, the "
                f"file ends at byte {window.size}",
                path,
                key,
                offset,
            )
        pieces.append(window.get(pos + 8, length) if length else b"")
        pos += 8 + padded
        if cflag == 0 or cflag == 3:
            break
        pieces.append(MAGIC_BYTES)
        first = False
    payload = pieces[0] if len(pieces) == 1 else b"".join(pieces)
    if len(payload) > MAX_RECORD_SIZE:
        raise fail(
            f"record of {len(payload)} bytes is longer than the format allows ({MAX_RECORD_SIZE} bytes)",
            path,
            key,
            offset,
        )
    return payload, pos


class ReaderBase(Closing):
    """What both readers share: the path, the per-process handle, close and pickling."""

    path: str
    _handle: FileHandle

    def _open_handle(self, path: StrPath) -> None:
        self.path = os.fsdecode(os.fspath(path))
        self._handle = FileHandle(self.path)
        # Fail now, in the caller's process, if the file cannot be opened at all.
        self._handle.acquire()
        self._handle.release()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._handle.closed

    def close(self) -> None:
        """Close this process's descriptor (once no thread is reading). Idempotent.

        Copies made by pickling and forked children have their own descriptors and are
        not affected; reads after ``close()`` raise :class:`ValueError`.
        """
        self._handle.close()


# A RecordReader's cursor lock must also be renewed in a forked child.
_live_cursors: weakref.WeakSet[RecordReader] = weakref.WeakSet()


def _renew_cursor_locks() -> None:
    for reader in list(_live_cursors):
        reader._cursor_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_renew_cursor_locks)


class RecordReader(ReaderBase):
    """Reads a ``.rec`` file from the start, record after record (no ``.idx`` needed).

    Iterating (``for payload in reader``) always starts at byte 0 and keeps its own
    position, so several iterations, in one or several threads, do not disturb each
    other. :meth:`read` is MXNet's style: one shared cursor (guarded by a lock), ``None``
    at the end. :meth:`read_at` reads the record at a known byte offset.

    Raises :class:`~aioloader.errors.RecordIOError` on malformed data (``key`` is then
    the record's ordinal number in the file), :class:`OSError` if the file cannot be
    opened. Pickles as its path and cursor.
    """

    def __init__(self, path: StrPath) -> None:
        self._open_handle(path)
        self._cursor = 0
        self._ordinal = 0
        self._cursor_lock = threading.Lock()
        _live_cursors.add(self)

    def __iter__(self) -> Iterator[bytes]:
        for _offset, payload in self.scan():
            yield payload

    def scan(self, start: int = 0) -> Iterator[tuple[int, bytes]]:
        """Yield ``(byte offset, payload)`` for every record from byte ``start`` to the end."""
        handle = self._handle
        pos = start
        ordinal = 0
        window: Window | None = None
        while True:
            fd = handle.acquire()
            try:
                if window is None:
                    window = Window(handle, fd, pos, b"", _SCAN_CHUNK)
                window.fd = fd  # the same unless this generator crossed a fork
                if pos >= handle.size and pos >= handle.refresh_size(fd):
                    return
                payload, end = read_record(window, pos, path=self.path, key=ordinal, from_index=False)
                # Records are handed out one at a time, so a thread that closes the reader
                # between two of them only waits for the current one.
            finally:
                handle.release()
            yield pos, payload
            pos = end
            ordinal += 1

    def read(self) -> bytes | None:
        """Return the record at the cursor and move past it; ``None`` at the end of file."""
        with self._cursor_lock:
            handle = self._handle
            fd = handle.acquire()
            try:
                pos = self._cursor
                if pos >= handle.size and pos >= handle.refresh_size(fd):
                    return None
                window = Window(handle, fd, pos, b"", 0)
                payload, end = read_record(window, pos, path=self.path, key=self._ordinal, from_index=False)
            finally:
                handle.release()
            self._cursor = end
            self._ordinal += 1
            return payload

    def read_at(self, offset: int) -> bytes:
        """Return the record whose first part header is at byte ``offset`` (cursor unchanged)."""
        handle = self._handle
        fd = handle.acquire()
        try:
            window = Window(handle, fd, offset, b"", 0)
            payload, _ = read_record(window, offset, path=self.path, key=None, from_index=True)
        finally:
            handle.release()
        return payload

    def tell(self) -> int:
        """The byte offset of the record :meth:`read` returns next."""
        return self._cursor

    def reset(self) -> None:
        """Move the :meth:`read` cursor back to the start of the file."""
        with self._cursor_lock:
            self._cursor = 0
            self._ordinal = 0

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "cursor": self._cursor, "ordinal": self._ordinal}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.path = state["path"]
        self._handle = FileHandle(self.path)
        self._cursor = state["cursor"]
        self._ordinal = state["ordinal"]
        self._cursor_lock = threading.Lock()
        _live_cursors.add(self)

    def __repr__(self) -> str:
        return f"RecordReader({self.path!r})"

"""Writing ``.rec`` files (and their ``.idx``), byte for byte as MXNet does."""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any

import numpy as np

from .rio_files import (
    MAGIC,
    MAGIC_BYTES,
    MAX_RECORD_SIZE,
    PART,
    Buffer,
    Closing,
    StrPath,
    as_view,
    default_idx_path,
)

__all__ = ["IndexedRecordWriter", "RecordWriter"]

# Writers hand bytes to the OS in chunks of about this size.
_WRITE_BUFFER = 1 << 20


class _Sink:
    """An unbuffered file plus our own buffer, so that a forked child that inherits a
    writer can never flush the parent's pending bytes a second time."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.file = open(path, "wb", buffering=0)  # closed by close()
        self.pid = os.getpid()
        self.buffer = bytearray()

    def write(self, data: bytes | memoryview) -> None:
        if len(data) >= _WRITE_BUFFER:
            self.flush()
            self._write_all(data)
            return
        self.buffer += data
        if len(self.buffer) >= _WRITE_BUFFER:
            self.flush()

    def _write_all(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data)
        while view.nbytes:
            n = self.file.write(view)
            if n is None:  # pragma: no cover - only non-blocking files return None
                continue
            view = view[n:]

    def flush(self) -> None:
        if self.buffer:
            self._write_all(self.buffer)
            self.buffer.clear()

    def close(self) -> None:
        if self.file.closed:
            return
        if os.getpid() != self.pid:
            # Not ours: drop the inherited copy without writing anything.
            self.buffer.clear()
            self.file.close()
            return
        try:
            self.flush()
        finally:
            self.file.close()


def _too_large(n: int, path: str) -> ValueError:
    return ValueError(
        f"{path}: a record of {n} bytes is too large for RecordIO, which stores lengths in "
        f"29 bits: records must be shorter than 2**29 ({1 << 29}) bytes"
    )


class RecordWriter(Closing):
    """Writes records to a new ``.rec`` file (an existing one is truncated), as MXNet does.

    The bytes are exactly those MXNet's writer produces for the same payloads. Payloads
    are bytes-like (``bytes``, ``bytearray``, ``memoryview``, contiguous numpy arrays).
    Threads may share a writer (each record is written whole). Not picklable, and a
    writer inherited by a forked child writes nothing there.
    Call :meth:`close` (or use ``with``) to flush; garbage collection also flushes, as a
    safety net.
    """

    def __init__(self, path: StrPath) -> None:
        self.path = os.fsdecode(os.fspath(path))
        self._sink = _Sink(self.path)
        self._finalizer = weakref.finalize(self, self._sink.close)
        self._pos = 0
        # One record's parts must not interleave with another thread's.
        self._lock = threading.Lock()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._sink.file.closed

    def tell(self) -> int:
        """The byte offset at which the next record will start."""
        return self._pos

    def _check_usable(self) -> None:
        if self._sink.file.closed:
            raise ValueError(f"write to a closed record writer: {self.path}")
        if os.getpid() != self._sink.pid:
            raise RuntimeError(f"{self.path}: a record writer cannot be used from a forked child process")

    def write(self, payload: Buffer) -> int:
        """Append one record; return the byte offset of its first header.

        Raises :class:`ValueError` for a payload of ``2**29`` bytes or more (nothing is
        written then) or on a closed writer.
        """
        view, n = self._checked_view(payload)
        with self._lock:
            return self._write_locked(payload, view, n)

    def _checked_view(self, payload: Buffer) -> tuple[memoryview, int]:
        # Everything that can refuse a record runs before a byte of it is written.
        self._check_usable()
        view = as_view(payload)
        n = view.nbytes
        if n > MAX_RECORD_SIZE:
            raise _too_large(n, self.path)
        return view, n

    def _write_locked(self, payload: Buffer, view: memoryview, n: int) -> int:
        # bytes.find does the scanning in C; other buffers are copied once to get it.
        data = payload if isinstance(payload, (bytes, bytearray)) else view.tobytes()
        start = self._pos
        sink = self._sink
        dptr = 0
        i = data.find(MAGIC_BYTES)
        while i >= 0:
            if i % 4 == 0:
                sink.write(PART.pack(MAGIC, (1 if dptr == 0 else 2) << 29 | (i - dptr)))
                if i > dptr:
                    sink.write(view[dptr:i])
                self._pos += 8 + (i - dptr)  # pieces cut at aligned offsets need no padding
                dptr = i + 4
                i = data.find(MAGIC_BYTES, dptr)
            else:
                i = data.find(MAGIC_BYTES, i + 1)
        rest = n - dptr
        sink.write(PART.pack(MAGIC, (3 if dptr else 0) << 29 | rest))
        if rest:
            sink.write(view[dptr:])
        pad = -rest % 4
        if pad:
            sink.write(b"\0" * pad)
        self._pos += 8 + rest + pad
        return start

    def flush(self) -> None:
        """Hand buffered bytes to the operating system."""
        self._check_usable()
        self._sink.flush()

    def close(self) -> None:
        """Flush and close. Idempotent."""
        self._finalizer()

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError(f"{type(self).__name__} cannot be pickled; pickle a reader instead")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.path!r})"


class IndexedRecordWriter(RecordWriter):
    """Writes a ``.rec`` and its ``.idx`` (``key<TAB>offset`` lines), as MXNet does.

    ``idx_path`` defaults to the ``.rec`` path with ``.idx`` as its extension. Keys are
    integers; writing the same key twice raises :class:`ValueError` (MXNet would accept
    it and silently hide the first record).
    """

    def __init__(self, path: StrPath, idx_path: StrPath | None = None) -> None:
        super().__init__(path)
        self.idx_path = default_idx_path(self.path) if idx_path is None else os.fsdecode(os.fspath(idx_path))
        try:
            self._idx_sink = _Sink(self.idx_path)
        except BaseException:
            self._finalizer()  # only the .rec is open so far
            raise
        self._idx_finalizer = weakref.finalize(self, self._idx_sink.close)
        self._keys: set[int] = set()

    def write(self, key: int, payload: Buffer) -> int:  # type: ignore[override]
        """Append ``payload`` under ``key``; return its byte offset.

        Raises :class:`TypeError` for a non-integer key, :class:`ValueError` for a
        repeated key, a payload of ``2**29`` bytes or more, or a closed writer.
        """
        if isinstance(key, bool) or not isinstance(key, (int, np.integer)):
            raise TypeError(f"record keys are integers, got {type(key).__name__}")
        k = int(key)
        view, n = self._checked_view(payload)
        with self._lock:
            if k in self._keys:
                raise ValueError(f"{self.idx_path}: key {k} was already written")
            offset = self._write_locked(payload, view, n)
            self._keys.add(k)
            self._idx_sink.write(f"{k}\t{offset}\n".encode("ascii"))
        return offset

    def write_idx(self, key: int, payload: Buffer) -> int:
        """Same as :meth:`write` (MXNet's ``MXIndexedRecordIO.write_idx`` name)."""
        return self.write(key, payload)

    def flush(self) -> None:
        super().flush()
        self._idx_sink.flush()

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._idx_finalizer()

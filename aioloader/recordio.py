"""Record files in Apache MXNet's RecordIO format (``.rec`` + ``.idx``), both directions.

The format, in short (the full description is in ``docs/recordio.md``):

* A record is stored as one or more *parts*. Each part is an 8-byte header, two
  little-endian ``uint32`` words: the magic ``0xCED7230A`` and ``lrec``, whose top three
  bits are the continuation flag (``cflag``) and whose low 29 bits are the part's length.
  The part's bytes follow, zero-padded to a multiple of four.
* A payload that contains the magic word at an offset divisible by four is cut there:
  the magic word is left out and the pieces become parts with ``cflag`` 1 (first),
  2 (middle) and 3 (last). A record that was not cut is a single part with ``cflag`` 0.
  Readers put the magic word back between the pieces. Occurrences at other offsets are
  stored as they are. This keeps every 4-aligned magic word in the file a part header,
  so a reader that lost its place can find the next record by scanning for it.
* A record must be shorter than ``2**29`` bytes.
* The ``.idx`` file is text, one ``key<TAB>offset`` line per record in the order they
  were written; the offset is that of the record's first part header in the ``.rec``.
* Image records (what ``im2rec`` writes) start with a 24-byte header, ``<IfQQ``:
  ``flag``, ``label``, ``id``, ``id2``; when ``flag > 0`` it counts the ``float32``
  labels that follow the header (and ``label`` is unused). See :func:`pack_header`.

Readers are safe to use from several threads and from several processes: every read is
an ``os.pread`` at an absolute offset, so no file position is shared; the file is opened
lazily and again whenever ``os.getpid()`` changes (after a fork the child gets its own
descriptor and never touches the parent's); a reader pickles as its paths, so sending
one to a spawned or forkserver worker costs a few hundred bytes and the parent's
descriptor stays open. A parsed index is kept (as numpy arrays) across those reopenings.

Every malformed input raises :class:`aioloader.errors.RecordIOError`, whose message
names the file, the key and the byte offset, also available as attributes.
"""

from __future__ import annotations

import io
import numbers
import os
import struct
import threading
import weakref
from collections.abc import Iterator
from types import TracebackType
from typing import Any, NamedTuple, TypeAlias, TypeVar

import numpy as np
import numpy.typing as npt

from .errors import RecordIOError

__all__ = [
    "MAGIC",
    "MAX_RECORD_SIZE",
    "IRHeader",
    "IndexedRecordReader",
    "IndexedRecordWriter",
    "RecordReader",
    "RecordWriter",
    "pack_header",
    "unpack_header",
]

MAGIC = 0xCED7230A
"""The word that starts every part header (bytes ``0a 23 d7 ce`` on disk)."""

MAX_RECORD_SIZE = (1 << 29) - 1
"""The largest payload, in bytes, a record can hold (lengths are stored in 29 bits)."""

StrPath: TypeAlias = "str | os.PathLike[str]"
Buffer: TypeAlias = "bytes | bytearray | memoryview | npt.NDArray[Any]"

_MAGIC_BYTES = struct.pack("<I", MAGIC)
_PART = struct.Struct("<II")
_IR = struct.Struct("<IfQQ")
_LENGTH_MASK = (1 << 29) - 1
_O_FLAGS = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)

# An indexed read fetches the whole span up to the next indexed offset in one pread when
# it is at most this long; longer spans are read header first, then exactly.
_PREFETCH_LIMIT = 4 << 20
# Sequential scans read ahead in chunks of this size.
_SCAN_CHUNK = 1 << 20
# Writers hand bytes to the OS in chunks of about this size.
_WRITE_BUFFER = 1 << 20
# Keys and offsets in an .idx line have at most this many digits (int64 holds 18 safely).
_MAX_DIGITS = 18


def _fail(
    message: str, path: str | None, key: int | None, offset: int | None
) -> RecordIOError:
    where = path if path is not None else "<record>"
    parts = [where]
    if key is not None:
        parts.append(f"key {key}")
    if offset is not None:
        parts.append(f"byte offset {offset}")
    return RecordIOError(f"{', '.join(parts)}: {message}", path=path, key=key, offset=offset)


# --------------------------------------------------------------------------- reading


_live_handles: weakref.WeakSet[_FileHandle] = weakref.WeakSet()


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


class _FileHandle:
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


def _pread_full(fd: int, n: int, offset: int) -> bytes:
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


class _Window:
    """Bytes ``[start, start + len(data))`` of a file, refilled on demand.

    ``get`` never asks the OS for more than the file holds, so a corrupt length field
    costs an error, not a huge allocation.
    """

    __slots__ = ("chunk", "data", "fd", "handle", "start")

    def __init__(self, handle: _FileHandle, fd: int, start: int, data: bytes, chunk: int) -> None:
        self.handle = handle
        self.fd = fd
        self.start = start
        self.data = data
        self.chunk = chunk

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
            self.data = _pread_full(self.fd, want, offset)
            self.start = offset
            return self.data[:n] if len(self.data) > n else self.data
        return _pread_full(self.fd, n, offset)


def _read_record(
    window: _Window,
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
                msg = f"offset is past the end of the file ({window.handle.size} bytes)"
                if pos < window.handle.size:
                    msg = (
                        f"only {window.handle.size - pos} bytes left, too few for a record "
                        f"header; the offset does not point at a record"
                    )
                raise _fail(msg, path, key, offset)
            raise _fail(
                f"truncated record: the part header at byte {pos} is cut off by the end "
                f"of the file ({window.handle.size} bytes)",
                path,
                key,
                offset,
            )
        magic, lrec = _PART.unpack(window.get(pos, 8))
        if magic != MAGIC:
            if first:
                what = (
                    "the offset (from the .idx or the caller) does not point at a record header"
                    if from_index
                    else "no record header here"
                )
                raise _fail(
                    f"bad magic 0x{magic:08x} (expected 0x{MAGIC:08x}): {what}", path, key, offset
                )
            raise _fail(
                f"bad magic 0x{magic:08x} in the continuation part at byte {pos} "
                f"(expected 0x{MAGIC:08x})",
                path,
                key,
                offset,
            )
        cflag = lrec >> 29
        length = lrec & _LENGTH_MASK
        if first and cflag not in (0, 1):
            what = "a continuation part" if cflag in (2, 3) else "an invalid part"
            raise _fail(
                f"cflag {cflag} where a record should start ({what}; expected 0 or 1)",
                path,
                key,
                offset,
            )
        if not first and cflag not in (2, 3):
            raise _fail(
                f"the part at byte {pos} has cflag {cflag}, but the record's earlier part "
                f"announced a continuation (expected 2 or 3)",
                path,
                key,
                offset,
            )
        padded = (length + 3) & ~3
        if not window.available(pos + 8, padded):
            raise _fail(
                f"truncated record: the part at byte {pos} needs {8 + padded} bytes, the "
                f"file ends at byte {window.handle.size}",
                path,
                key,
                offset,
            )
        pieces.append(window.get(pos + 8, length) if length else b"")
        pos += 8 + padded
        if cflag == 0 or cflag == 3:
            break
        pieces.append(_MAGIC_BYTES)
        first = False
    payload = pieces[0] if len(pieces) == 1 else b"".join(pieces)
    if len(payload) > MAX_RECORD_SIZE:
        raise _fail(
            f"record of {len(payload)} bytes is longer than the format allows "
            f"({MAX_RECORD_SIZE} bytes)",
            path,
            key,
            offset,
        )
    return payload, pos


_R = TypeVar("_R", bound="_ReaderBase")


class _ReaderBase:
    """What both readers share: the path, the per-process handle, close and pickling."""

    path: str
    _handle: _FileHandle

    def _open_handle(self, path: StrPath) -> None:
        self.path = os.fsdecode(os.fspath(path))
        self._handle = _FileHandle(self.path)
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

    def __enter__(self: _R) -> _R:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


# A RecordReader's cursor lock must also be renewed in a forked child.
_live_cursors: weakref.WeakSet[RecordReader] = weakref.WeakSet()


def _renew_cursor_locks() -> None:
    for reader in list(_live_cursors):
        reader._cursor_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_renew_cursor_locks)


class RecordReader(_ReaderBase):
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
        window: _Window | None = None
        while True:
            fd = handle.acquire()
            try:
                if window is None:
                    window = _Window(handle, fd, pos, b"", _SCAN_CHUNK)
                window.fd = fd  # the same unless this generator crossed a fork
                if pos >= handle.size and pos >= handle.refresh_size(fd):
                    return
                payload, end = _read_record(
                    window, pos, path=self.path, key=ordinal, from_index=False
                )
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
                window = _Window(handle, fd, pos, b"", 0)
                payload, end = _read_record(
                    window, pos, path=self.path, key=self._ordinal, from_index=False
                )
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
            window = _Window(handle, fd, offset, b"", 0)
            payload, _ = _read_record(window, offset, path=self.path, key=None, from_index=True)
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
        self._handle = _FileHandle(self.path)
        self._cursor = state["cursor"]
        self._ordinal = state["ordinal"]
        self._cursor_lock = threading.Lock()
        _live_cursors.add(self)

    def __repr__(self) -> str:
        return f"RecordReader({self.path!r})"


class _Index(NamedTuple):
    keys: npt.NDArray[np.int64]
    offsets: npt.NDArray[np.int64]
    ends: npt.NDArray[np.int64]  # where each record's prefetch span ends
    sorted_keys: npt.NDArray[np.int64]
    order: npt.NDArray[np.int64] | None  # positions in key order, None if keys ascend
    first_key: int | None  # set when the keys are first_key, first_key + 1, ... in order


def _idx_line_error(idx_path: str, data: bytes, line_no: int, starts: Any, why: str) -> Exception:
    start = int(starts[line_no])
    end = data.find(b"\n", start)
    text = data[start : end if end >= 0 else len(data)]
    shown = text[:60] + (b"..." if len(text) > 60 else b"")
    return _fail(
        f"malformed .idx line {line_no + 1} {shown!r}: {why} "
        "(expected '<integer key><TAB><byte offset>')",
        idx_path,
        None,
        start,
    )


def _parse_index(idx_path: str, data: bytes) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Parse ``key<TAB>offset`` lines strictly, with numpy doing the per-byte work.

    The layout is checked first (one tab per line, digits only, an optional ``-`` on the
    key, an optional ``\\r`` before the newline), so the number parsing that follows only
    ever sees well-formed input.
    """
    if not data:
        empty = np.zeros(0, np.int64)
        return empty, empty.copy()
    if not data.endswith(b"\n"):
        data += b"\n"
    arr = np.frombuffer(data, np.uint8)
    newlines = np.flatnonzero(arr == 0x0A)
    n = len(newlines)
    starts = np.empty(n, np.int64)
    starts[0] = 0
    starts[1:] = newlines[:-1] + 1

    bad = np.zeros(n, bool)
    tabs = np.flatnonzero(arr == 0x09)
    tab_line = np.searchsorted(newlines, tabs)
    tab_count = np.bincount(tab_line, minlength=n)
    bad |= tab_count != 1
    tab_pos = np.zeros(n, np.int64)
    tab_pos[tab_line] = tabs  # meaningful where tab_count == 1

    digit = (arr >= 0x30) & (arr <= 0x39)
    other = np.flatnonzero(~digit & (arr != 0x09) & (arr != 0x0A))
    other_line = np.searchsorted(newlines, other)
    sign_ok = (arr[other] == 0x2D) & (other == starts[other_line])
    cr_ok = (arr[other] == 0x0D) & (other == newlines[other_line] - 1)
    bad[other_line[~(sign_ok | cr_ok)]] = True

    has_sign = arr[starts] == 0x2D
    has_cr = arr[np.maximum(newlines - 1, 0)] == 0x0D
    key_len = tab_pos - starts - has_sign
    off_len = newlines - tab_pos - 1 - has_cr
    bad |= (key_len < 1) | (off_len < 1) | (key_len > _MAX_DIGITS) | (off_len > _MAX_DIGITS)

    if bad.any():
        line_no = int(np.argmax(bad))
        if tab_count[line_no] != 1:
            why = "blank line" if newlines[line_no] == starts[line_no] else (
                f"{int(tab_count[line_no])} tabs"
            )
        elif key_len[line_no] < 1 or off_len[line_no] < 1:
            why = "empty field"
        elif key_len[line_no] > _MAX_DIGITS or off_len[line_no] > _MAX_DIGITS:
            why = "number too large"
        else:
            why = "unexpected character"
        raise _idx_line_error(idx_path, data, line_no, starts, why)

    # Only well-formed "key<TAB>offset" lines are left: numpy's C text parser does the rest.
    if has_cr.any():
        data = data.replace(b"\r\n", b"\n")
    values = np.loadtxt(io.BytesIO(data), dtype=np.int64, delimiter="\t", ndmin=2, comments=None)
    if values.shape != (n, 2):  # pragma: no cover - excluded by the checks above
        raise _fail("could not parse the index", idx_path, None, None)
    return values[:, 0].copy(), values[:, 1].copy()


def _build_index(
    rec_path: str, idx_path: str, rec_size: int
) -> _Index:
    try:
        with open(idx_path, "rb") as f:
            data = f.read()
    except FileNotFoundError as err:
        raise FileNotFoundError(
            err.errno, f"index file of {rec_path} not found", idx_path
        ) from None
    keys, offsets = _parse_index(idx_path, data)
    beyond = offsets + 8 > rec_size
    if beyond.any():
        pos = int(np.argmax(beyond))
        raise _fail(
            f"the .idx offset is past the end of the record file ({rec_size} bytes)"
            f" (listed in {idx_path})",
            rec_path,
            int(keys[pos]),
            int(offsets[pos]),
        )
    if len(offsets):
        bounds = np.unique(offsets)
        nxt = np.searchsorted(bounds, offsets, side="right")
        ends = np.append(bounds, rec_size)[nxt]
    else:
        ends = offsets.copy()
    if len(keys) < 2 or bool(np.all(keys[1:] > keys[:-1])):
        sorted_keys, order = keys, None
    else:
        order = np.argsort(keys, kind="stable").astype(np.int64)
        sorted_keys = keys[order]
    first_key = None
    if order is None and len(keys) and int(keys[-1]) - int(keys[0]) == len(keys) - 1:
        first_key = int(keys[0])  # ascending, distinct and spanning n values: consecutive
    for a in (keys, offsets, ends, sorted_keys, order):
        if a is not None:
            a.setflags(write=False)
    return _Index(keys, offsets, ends, sorted_keys, order, first_key)


def _default_idx_path(path: str) -> str:
    return os.path.splitext(path)[0] + ".idx"


class IndexedRecordReader(_ReaderBase):
    """Random access to a ``.rec`` file through its ``.idx``: by key or by position.

    ``idx_path`` defaults to the ``.rec`` path with its extension replaced by ``.idx``
    (what MXNet's ``RecordFileDataset`` assumes). Keys are integers (MXNet's default
    ``key_type``). When a key appears twice in the ``.idx`` the later line wins for
    :meth:`read`, as in MXNet; :attr:`keys` and positions keep every line.

    The index is parsed once, at construction (errors surface here), and kept as
    read-only numpy arrays for the life of the object, including across the reopen that
    follows a fork. Pickling sends only the two paths; the copy parses the index again
    when it is unpickled and opens the file on first use.

    Raises :class:`~aioloader.errors.RecordIOError` for a malformed ``.idx`` line, an
    offset past the end of the ``.rec`` (at construction) and for any malformed record
    (when it is read); :class:`FileNotFoundError` when either file is missing.
    """

    def __init__(self, path: StrPath, idx_path: StrPath | None = None) -> None:
        self._open_handle(path)
        self.idx_path = (
            _default_idx_path(self.path) if idx_path is None else os.fsdecode(os.fspath(idx_path))
        )
        self._index = _build_index(self.path, self.idx_path, self._handle.size)

    # -- the index
    @property
    def keys(self) -> npt.NDArray[np.int64]:
        """Every key, in ``.idx`` order (a read-only ``int64`` array)."""
        return self._index.keys

    @property
    def offsets(self) -> npt.NDArray[np.int64]:
        """Byte offset of each record, in ``.idx`` order (a read-only ``int64`` array)."""
        return self._index.offsets

    def __len__(self) -> int:
        return len(self._index.keys)

    def __contains__(self, key: object) -> bool:
        try:
            self.position(key)  # type: ignore[arg-type]
        except (KeyError, TypeError):
            return False
        return True

    def position(self, key: int) -> int:
        """The position (``.idx`` line number, from 0) of ``key``; :class:`KeyError` if absent."""
        k = int(key) if isinstance(key, (int, np.integer)) else None
        if k is None or isinstance(key, bool):
            raise TypeError(f"record keys are integers, got {type(key).__name__}")
        index = self._index
        if index.first_key is not None:
            j = k - index.first_key
            if 0 <= j < len(index.keys):
                return j
            raise KeyError(key)
        j = int(np.searchsorted(index.sorted_keys, k, side="right")) - 1
        if j < 0 or int(index.sorted_keys[j]) != k:
            raise KeyError(key)
        return j if index.order is None else int(index.order[j])

    # -- reading
    def read(self, key: int) -> bytes:
        """The payload stored under ``key``. :class:`KeyError` if the ``.idx`` lacks it."""
        return self._read_position(self.position(key))

    def read_idx(self, key: int) -> bytes:
        """Same as :meth:`read` (MXNet's ``MXIndexedRecordIO.read_idx`` name)."""
        return self.read(key)

    def read_position(self, position: int) -> bytes:
        """The payload on line ``position`` of the ``.idx`` (negative counts from the end)."""
        n = len(self._index.keys)
        p = int(position)
        if p < 0:
            p += n
        if not 0 <= p < n:
            raise IndexError(f"record position {position} out of range for {n} records")
        return self._read_position(p)

    def _read_position(self, p: int) -> bytes:
        index = self._index
        offset = int(index.offsets[p])
        key = int(index.keys[p])
        handle = self._handle
        fd = handle.acquire()
        try:
            span = int(index.ends[p]) - offset
            if span <= 0:
                span = 8
            want = span if span <= _PREFETCH_LIMIT else 8
            want = max(0, min(want, handle.size - offset))
            head = _pread_full(fd, want, offset) if want else b""
            window = _Window(handle, fd, offset, head, 0)
            payload, _ = _read_record(window, offset, path=self.path, key=key, from_index=True)
        finally:
            handle.release()
        return payload

    def __iter__(self) -> Iterator[bytes]:
        """Payloads in ``.idx`` order."""
        for p in range(len(self)):
            yield self._read_position(p)

    # -- pickling: paths only
    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "idx_path": self.idx_path}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._open_handle(state["path"])
        self.idx_path = state["idx_path"]
        self._index = _build_index(self.path, self.idx_path, self._handle.size)

    def __repr__(self) -> str:
        return f"IndexedRecordReader({self.path!r}, idx_path={self.idx_path!r}, records={len(self)})"


# --------------------------------------------------------------------------- writing


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


def _as_view(payload: Buffer) -> memoryview:
    view = payload.data if isinstance(payload, np.ndarray) else memoryview(payload)
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B")
    return view


def _too_large(n: int, path: str) -> ValueError:
    return ValueError(
        f"{path}: a record of {n} bytes is too large for RecordIO, which stores lengths in "
        f"29 bits: records must be shorter than 2**29 ({1 << 29}) bytes"
    )


class RecordWriter:
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
            raise RuntimeError(
                f"{self.path}: a record writer cannot be used from a forked child process"
            )

    def write(self, payload: Buffer) -> int:
        """Append one record; return the byte offset of its first header.

        Raises :class:`ValueError` for a payload of ``2**29`` bytes or more (nothing is
        written then) or on a closed writer.
        """
        self._check_usable()
        view = _as_view(payload)
        n = view.nbytes
        if n > MAX_RECORD_SIZE:
            raise _too_large(n, self.path)
        with self._lock:
            return self._write_locked(payload, view, n)

    def _write_locked(self, payload: Buffer, view: memoryview, n: int) -> int:
        # bytes.find does the scanning in C; other buffers are copied once to get it.
        data = payload if isinstance(payload, (bytes, bytearray)) else view.tobytes()
        start = self._pos
        sink = self._sink
        dptr = 0
        i = data.find(_MAGIC_BYTES)
        while i >= 0:
            if i % 4 == 0:
                sink.write(_PART.pack(MAGIC, (1 if dptr == 0 else 2) << 29 | (i - dptr)))
                if i > dptr:
                    sink.write(view[dptr:i])
                self._pos += 8 + (i - dptr)  # pieces cut at aligned offsets need no padding
                dptr = i + 4
                i = data.find(_MAGIC_BYTES, dptr)
            else:
                i = data.find(_MAGIC_BYTES, i + 1)
        rest = n - dptr
        sink.write(_PART.pack(MAGIC, (3 if dptr else 0) << 29 | rest))
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

    def __enter__(self) -> RecordWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

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
        self.idx_path = (
            _default_idx_path(self.path) if idx_path is None else os.fsdecode(os.fspath(idx_path))
        )
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
        self._check_usable()
        view = _as_view(payload)
        n = view.nbytes
        if n > MAX_RECORD_SIZE:
            raise _too_large(n, self.path)
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


# --------------------------------------------------------------------------- image headers


class IRHeader(NamedTuple):
    """The header of an image record (MXNet's ``IRHeader``).

    ``flag``: 0 for a single label, otherwise the number of ``float32`` labels stored
    after the header. ``label``: the label as a float, or (when ``flag > 0``) a
    ``float32`` array of the labels. ``id``, ``id2``: two free unsigned 64-bit integers
    (``im2rec`` puts the image's index in ``id``).
    """

    flag: int
    label: float | npt.NDArray[np.float32]
    id: int
    id2: int


_HeaderLike: TypeAlias = "IRHeader | tuple[int, Any, int, int]"


def pack_header(header: _HeaderLike, payload: Buffer = b"") -> bytes:
    """Return the 24-byte image-record header, any extra labels, then ``payload``.

    As in MXNet's ``recordio.pack``: a numeric ``label`` is stored in the header and
    ``flag`` is written as 0 whatever it was; any other label (a sequence or an array,
    even of one element) is converted to ``float32``, ``flag`` becomes its length, the
    header's label is 0 and the values follow the header. Raises :class:`ValueError` for
    ``id``/``id2`` outside ``[0, 2**64)``.
    """
    flag, label, ident, ident2 = header
    if isinstance(label, numbers.Number) and not isinstance(label, (complex, np.complexfloating)):
        flag, head_label, extra = 0, float(label), b""  # type: ignore[arg-type]
    else:
        labels = np.asarray(label, dtype=np.float32).ravel()
        flag, head_label, extra = labels.size, 0.0, labels.astype("<f4").tobytes()
        if flag == 0:
            raise ValueError("a vector label needs at least one value")
    try:
        head = _IR.pack(flag, head_label, int(ident), int(ident2))
    except (struct.error, OverflowError) as err:
        raise ValueError(f"cannot pack image-record header {tuple(header)!r}: {err}") from None
    return head + extra + _as_view(payload).tobytes()


def unpack_header(
    record: Buffer, *, path: str | None = None, key: int | None = None
) -> tuple[IRHeader, bytes]:
    """Split an image record into its :class:`IRHeader` and the bytes after the labels.

    When ``flag > 0`` the header's ``label`` is a fresh ``float32`` array of ``flag``
    values read from after the header; otherwise it is the header's float. Raises
    :class:`~aioloader.errors.RecordIOError` (naming ``path`` and ``key`` when given)
    when the record is too short for its header or its labels.
    """
    view = _as_view(record)
    if view.nbytes < _IR.size:
        raise _fail(
            f"record of {view.nbytes} bytes is too short for an image-record header "
            f"({_IR.size} bytes)",
            path,
            key,
            None,
        )
    flag, label, ident, ident2 = _IR.unpack_from(view)
    body_start = _IR.size
    value: float | npt.NDArray[np.float32] = label
    if flag > 0:
        body_start += 4 * flag
        if view.nbytes < body_start:
            raise _fail(
                f"image-record header announces {flag} float32 labels, but the record has "
                f"only {view.nbytes - _IR.size} bytes after its header",
                path,
                key,
                None,
            )
        value = np.frombuffer(view, dtype="<f4", count=flag, offset=_IR.size).astype(np.float32)
    return IRHeader(flag, value, ident, ident2), view[body_start:].tobytes()

"""Random access through the ``.idx``: strict, vectorised index parsing and the indexed reader."""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from .rio_files import StrPath, Window, default_idx_path, fail, pread_full
from .rio_read import ReaderBase, read_record

__all__ = ["IndexedAccess", "IndexedRecordReader", "index_from_arrays", "index_from_bytes"]

# An indexed read fetches the whole span up to the next indexed offset in one pread when
# it is at most this long; longer spans are read header first, then exactly.
_PREFETCH_LIMIT = 4 << 20
# Keys and offsets in an .idx line have at most this many digits (int64 holds 18 safely).
_MAX_DIGITS = 18


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
    return fail(
        f"malformed .idx line {line_no + 1} {shown!r}: {why} (expected '<integer key><TAB><byte offset>')",
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
            why = (
                "blank line" if newlines[line_no] == starts[line_no] else (f"{int(tab_count[line_no])} tabs")
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
        raise fail("could not parse the index", idx_path, None, None)
    return values[:, 0].copy(), values[:, 1].copy()


def _build_index(rec_path: str, idx_path: str, rec_size: int) -> _Index:
    try:
        with open(idx_path, "rb") as f:
            data = f.read()
    except FileNotFoundError as err:
        raise FileNotFoundError(err.errno, f"index file of {rec_path} not found", idx_path) from None
    return index_from_bytes(rec_path, idx_path, data, rec_size)


def index_from_bytes(rec_path: str, idx_path: str, data: bytes, rec_size: int) -> _Index:
    """Parse and check the ``.idx`` text ``data`` of a record file of ``rec_size`` bytes."""
    keys, offsets = _parse_index(idx_path, data)
    return index_from_arrays(rec_path, idx_path, keys, offsets, rec_size)


def index_from_arrays(
    rec_path: str,
    idx_path: str,
    keys: npt.NDArray[np.int64],
    offsets: npt.NDArray[np.int64],
    rec_size: int,
) -> _Index:
    """The index of parsed ``keys`` and ``offsets``; checks that every offset is in the file."""
    beyond = offsets + 8 > rec_size
    if beyond.any():
        pos = int(np.argmax(beyond))
        raise fail(
            f"the .idx offset is past the end of the record file ({rec_size} bytes) (listed in {idx_path})",
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


class IndexedAccess:
    """Lookups by key and by position over a parsed ``.idx``; what the reader adds is ``_read_position``."""

    _index: _Index

    def _read_position(self, p: int) -> bytes:
        raise NotImplementedError

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

    def __iter__(self) -> Iterator[bytes]:
        """Payloads in ``.idx`` order."""
        for p in range(len(self)):
            yield self._read_position(p)


class IndexedRecordReader(ReaderBase, IndexedAccess):
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
        self.idx_path = default_idx_path(self.path) if idx_path is None else os.fsdecode(os.fspath(idx_path))
        self._index = _build_index(self.path, self.idx_path, self._handle.size)

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
            head = pread_full(fd, want, offset) if want else b""
            window = Window(handle, fd, offset, head, 0)
            payload, _ = read_record(window, offset, path=self.path, key=key, from_index=True)
        finally:
            handle.release()
        return payload

    # -- pickling: paths only
    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "idx_path": self.idx_path}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._open_handle(state["path"])
        self.idx_path = state["idx_path"]
        self._index = _build_index(self.path, self.idx_path, self._handle.size)

    def __repr__(self) -> str:
        return f"IndexedRecordReader({self.path!r}, idx_path={self.idx_path!r}, records={len(self)})"

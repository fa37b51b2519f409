"""Indexed record files in an object store: the ``.idx`` read once, every record a range read.

A record is fetched as the bytes from its offset to the next indexed offset (at most
:data:`SPAN_LIMIT`), which holds the whole record unless the ``.idx`` skips records or
the record is very long; then its part headers say what is still missing and that is
read too. The same plan serves the blocking reads a worker makes (``dataset[i]``) and
the coroutine the fetch stage runs on the event loop; decoding is the local reader's
:func:`read_record`, so a damaged record fails with the same message, naming the URL.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, NamedTuple, overload

import numpy as np
import numpy.typing as npt

from .objstore import ObjectStore, is_url, split_url
from .rio_files import MAGIC, PART, Closing, fail
from .rio_index import IndexedAccess, _Index, _parse_index, index_from_arrays
from .rio_read import read_record

__all__ = ["RecordDecoder", "RecordSpan", "RecordSpans", "RemoteRecordFile", "SpanFetcher"]

SPAN_LIMIT = 16 << 20
"""The most bytes one record read asks for before it has seen the record's header."""

_LENGTH_MASK = (1 << 29) - 1


class RecordSpan(NamedTuple):
    """Where record ``position`` (key ``key``) lies: the bytes ``[offset, end)`` are read first."""

    position: int
    key: int
    offset: int
    end: int


def missing_range(data: bytes, offset: int, size: int) -> tuple[int, int] | None:
    """The next bytes the record at ``offset`` needs beyond ``data`` (its first bytes), or ``None``.

    Walks the part headers as :func:`read_record` will; stops (``None``) once the record
    is complete, at a header the decoder will reject, or at the end of the object, so
    damage is reported by the decoder, never by a read of a huge bogus length.
    """
    pos = 0
    first = True
    extra = 0
    while True:
        need = pos + 8
        if need <= len(data):
            magic, lrec = PART.unpack_from(data, pos)
            cflag = lrec >> 29
            if magic != MAGIC or cflag not in ((0, 1) if first else (2, 3)):
                return None
            need = pos + 8 + (((lrec & _LENGTH_MASK) + 3) & ~3)
            # A part that continues: fetch the next part's header with this one.
            extra = 8 if cflag in (1, 2) else 0
            if need <= len(data):
                if cflag in (0, 3):
                    return None
                pos, first = need, False
                continue
        if offset + need > size:
            return None  # cut off by the end of the object: the decoder says so
        have, want = offset + len(data), min(offset + need + extra, size)
        return (have, want) if want > have else None


class _Bytes:
    """The fetched bytes ``[start, start + len(data))`` of an object of ``size`` bytes."""

    __slots__ = ("data", "key", "path", "size", "start")

    def __init__(self, data: bytes, start: int, size: int, path: str, key: int) -> None:
        self.data, self.start, self.size, self.path, self.key = data, start, size, path, key

    def available(self, offset: int, n: int) -> bool:
        return offset + n <= self.size

    def get(self, offset: int, n: int) -> bytes:
        rel = offset - self.start
        if rel < 0 or rel + n > len(self.data):
            raise fail(
                f"the object ended at byte {self.start + len(self.data)}, before the {self.size} "
                "bytes it had when the dataset was made (was it replaced?)",
                self.path,
                self.key,
                self.start,
            )
        return self.data[rel : rel + n]


class RecordDecoder:
    """``(span, bytes)`` as a :class:`SpanFetcher` returns it -> the record's payload.

    Small and picklable: what a worker needs to decode, without the index.
    """

    def __init__(self, path: str, size: int) -> None:
        self.path = path
        self.size = size

    def __call__(self, raw: tuple[RecordSpan, bytes]) -> bytes:
        span, data = raw
        window = _Bytes(data, span.offset, self.size, self.path, span.key)
        payload, _ = read_record(window, span.offset, path=self.path, key=span.key, from_index=True)
        return payload


class SpanFetcher:
    """The fetch stage's coroutine: ``await fetcher(span)`` -> ``(span, bytes)`` (range reads)."""

    def __init__(self, store: ObjectStore, key: str, size: int) -> None:
        self.store, self.key, self.size = store, key, size

    async def __call__(self, span: RecordSpan) -> tuple[RecordSpan, bytes]:
        data = await self.store.get_range(self.key, span.offset, span.end)
        while (more := missing_range(data, span.offset, self.size)) is not None:
            piece = await self.store.get_range(self.key, *more)
            if not piece:
                break
            data += piece
        return span, data

    def fetch_sync(self, span: RecordSpan) -> tuple[RecordSpan, bytes]:
        """The same, blocking (a worker reading ``dataset[i]`` without a fetch stage)."""
        data = self.store.get_range_sync(self.key, span.offset, span.end)
        while (more := missing_range(data, span.offset, self.size)) is not None:
            piece = self.store.get_range_sync(self.key, *more)
            if not piece:
                break
            data += piece
        return span, data


class RecordSpans(Sequence[RecordSpan]):
    """Every record's :class:`RecordSpan`, by ``.idx`` position: the fetch stage's items."""

    def __init__(self, index: _Index, size: int) -> None:
        self._offsets = index.offsets
        self._keys = index.keys
        self._ends = index.ends
        self._size = size

    def __len__(self) -> int:
        return len(self._offsets)

    @overload
    def __getitem__(self, index: int) -> RecordSpan: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[RecordSpan]: ...
    def __getitem__(self, index: int | slice) -> RecordSpan | Sequence[RecordSpan]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        n = len(self)
        p = int(index)
        if p < 0:
            p += n
        if not 0 <= p < n:
            raise IndexError(f"index {index} out of range for a dataset of {n} samples")
        offset = int(self._offsets[p])
        end = min(max(int(self._ends[p]), offset + 8), offset + SPAN_LIMIT, self._size)
        return RecordSpan(p, int(self._keys[p]), offset, end)


def _read_idx(url: str, idx_path: str, store: ObjectStore, store_options: dict[str, Any]) -> bytes:
    try:
        if not is_url(idx_path):
            with open(idx_path, "rb") as f:
                return f.read()
        base, name = split_url(idx_path)
        src = store if base == store.url else ObjectStore(base, **store_options)
        return src.get_sync(name)
    except FileNotFoundError as err:
        raise FileNotFoundError(err.errno, f"index file of {url} not found", idx_path) from err


class RemoteRecordFile(IndexedAccess, Closing):
    """An indexed record file at an object-store URL (the remote twin of ``IndexedRecordReader``).

    ``idx_path`` defaults to the URL with ``.rec`` replaced by ``.idx``; it may be
    another URL or a local path. ``store_options`` go to :class:`ObjectStore`. The
    object's size (one HEAD request) and the ``.idx`` (one GET) are read here, in the
    caller's process; pickling sends the store's URL and options, the size and the index
    arrays, so workers never read the ``.idx`` again.
    """

    def __init__(
        self,
        url: str,
        idx_path: str | os.PathLike[str] | None = None,
        store_options: dict[str, Any] | None = None,
    ) -> None:
        options = dict(store_options or {})
        base, self.key = split_url(url)
        self.path = url
        self.store = ObjectStore(base, **options)
        self.size = self.store.size_sync(self.key)
        if idx_path is None:
            self.idx_path = f"{base}/{os.path.splitext(self.key)[0]}.idx"
        else:
            self.idx_path = idx_path if isinstance(idx_path, str) else os.fsdecode(os.fspath(idx_path))
        data = _read_idx(url, self.idx_path, self.store, options)
        keys, offsets = _parse_index(self.idx_path, data)
        self._set_index(keys, offsets)
        self._closed = False

    def _set_index(self, keys: npt.NDArray[np.int64], offsets: npt.NDArray[np.int64]) -> None:
        self._index = index_from_arrays(self.path, self.idx_path, keys, offsets, self.size)
        self.spans = RecordSpans(self._index, self.size)
        self.fetcher = SpanFetcher(self.store, self.key, self.size)
        self.decoder = RecordDecoder(self.path, self.size)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def close(self) -> None:
        """Refuse further reads through this object (copies made by pickling are unaffected)."""
        self._closed = True

    def _read_position(self, p: int) -> bytes:
        if self._closed:
            raise ValueError(f"read from a closed record file: {self.path}")
        return self.decoder(self.fetcher.fetch_sync(self.spans[p]))

    def __getstate__(self) -> dict[str, Any]:
        index = self._index
        return {
            "path": self.path,
            "idx_path": self.idx_path,
            "key": self.key,
            "store": self.store,
            "size": self.size,
            "keys": index.keys,
            "offsets": index.offsets,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.path, self.idx_path, self.key = state["path"], state["idx_path"], state["key"]
        self.store, self.size = state["store"], state["size"]
        self._set_index(state["keys"], state["offsets"])
        self._closed = False

    def __repr__(self) -> str:
        return f"RemoteRecordFile({self.path!r}, idx_path={self.idx_path!r}, records={len(self)})"

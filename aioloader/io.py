"""Ready-made fetchers for remote and local bytes: object stores and local files.

* :class:`ObjectStore` — the objects under one URL (``s3://bucket/prefix``, ``gs://``,
  ``az://``, ``http(s)://``, ``file://``), read with ``await store.get(key)`` and
  ``await store.get_range(key, start, end)`` on the event loop, or with the blocking
  ``get_sync``/``get_range_sync`` inside a worker. Built on obstore
  (https://developmentseed.org/obstore/, Rust's ``object_store``: many
  requests in flight from one thread, the GIL released while bytes move), an optional
  dependency: ``pip install "aioloader[remote]"``. obstore is imported only when the
  first store is made.
* :func:`read_file` — a local file, or a byte range of it, without blocking the loop.

Errors name the key and the URL. A missing object raises :class:`FileNotFoundError`;
a missing bucket :class:`BucketNotFoundError`, a FileNotFoundError that names the
bucket. Setup mistakes raise :class:`StoreSetupError` with what to change: no
credentials (:class:`NoCredentialsError`, listing where obstore looked), or a plain
``http://`` endpoint without ``allow_http=True``. A failure that may pass when the
request is tried again (no connection, a dropped one, a timeout, HTTP 5xx or 429) raises :class:`TransientStoreError`, a
:class:`ConnectionError` whose ``transient`` attribute is ``True``
(:class:`StoreTimeoutError`, also a :class:`TimeoutError`, for timeouts); every other
failure raises :class:`ObjectStoreError` (``transient = False``). All of them carry
``key``, ``url`` and ``status`` (the HTTP status or ``None``), and obstore's own
exception as ``__cause__``. obstore retries failed requests itself before it gives up
(its ``retry_config`` option sets how long), so a transient error here means the store
stayed unavailable for that long.

The record datasets of :mod:`aioloader.datasets` take object URLs as well
(``ImageRecordDataset("s3://bucket/train.rec", store_options={...})``); see
``docs/remote.md``.
"""

from __future__ import annotations

import os

import aiofiles.os

from ._formats import publish
from ._formats.objstore import BucketNotFoundError as BucketNotFoundError
from ._formats.objstore import NoCredentialsError as NoCredentialsError
from ._formats.objstore import ObjectStore as ObjectStore
from ._formats.objstore import ObjectStoreError as ObjectStoreError
from ._formats.objstore import StoreSetupError as StoreSetupError
from ._formats.objstore import StoreTimeoutError as StoreTimeoutError
from ._formats.objstore import TransientStoreError as TransientStoreError

__all__ = [
    "BucketNotFoundError",
    "NoCredentialsError",
    "ObjectStore",
    "ObjectStoreError",
    "StoreSetupError",
    "StoreTimeoutError",
    "TransientStoreError",
    "read_file",
]

StrPath = str | os.PathLike[str]


def _read_span(path: StrPath, start: int, end: int | None) -> bytes:
    # Opened, read and closed in one call on one thread: a caller cancelled half-way
    # leaves nothing open behind it (the thread finishes the read and closes the file).
    with open(path, "rb") as f:
        if start:
            f.seek(start)
        return f.read() if end is None else f.read(max(0, end - start))


async def read_file(path: StrPath, start: int = 0, end: int | None = None) -> bytes:
    """The bytes of the local file ``path``, or its bytes ``[start, end)`` (``end`` exclusive).

    Reads in a thread (aiofiles'), so the event loop keeps running. A range that runs
    past the end of the file gives the bytes up to the end, as a range read of an object
    does. Raises :class:`ValueError` for a negative or reversed range and the usual
    :class:`OSError` (:class:`FileNotFoundError` naming the path) when the file cannot
    be read.
    """
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise ValueError(f"read_file: start must be an integer >= 0, got {start!r}")
    if end is not None and (isinstance(end, bool) or not isinstance(end, int) or end < start):
        raise ValueError(f"read_file: end must be an integer >= start ({start}) or None, got {end!r}")
    data: bytes = await aiofiles.os.wrap(_read_span)(path, start, end)
    return data


publish(globals(), __all__)

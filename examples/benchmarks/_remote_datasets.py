"""Fetchers, transforms and datasets of ``bench_remote.py``.

They live in an importable module (not in the script) because worker processes started
with ``forkserver`` or ``spawn`` find them by name when they unpickle them.
"""

from __future__ import annotations

import asyncio
import http.client
import os
import weakref
from pathlib import Path
from typing import Any

__all__ = [
    "HttpFetch",
    "MemoryFetch",
    "RawHttpFetch",
    "S3Fetch",
    "TorchHttpJpegs",
    "TorchS3Jpegs",
    "decode_train",
    "jpeg_items",
]

_TRANSFORM: Any = None


def jpeg_items(root: str) -> list[tuple[str, int]]:
    """``(url path, label)`` of every JPEG of the ``ImageFolder`` at ``root``, in its order."""
    from aioloader.datasets import ImageFolder

    ds = ImageFolder(root)
    base = Path(ds.root)
    return [("/" + Path(ds.path(i)).relative_to(base).as_posix(), int(ds.labels[i])) for i in range(len(ds))]


def decode_train(raw: tuple[bytes, int]) -> tuple[Any, int]:
    """What ``ImageFolder(root, transform=train_transform())`` does to a file, from bytes:
    decode to RGB, RandomResizedCrop(224), random flip, to a uint8 array."""
    global _TRANSFORM
    from aioloader._formats.datasets import _decode_rgb
    from aioloader._formats.synthetic import train_transform

    if _TRANSFORM is None:
        _TRANSFORM = train_transform()
    data, label = raw
    return _TRANSFORM(_decode_rgb(data, path="<http>", key=None)), label


class HttpFetch:
    """``await fetch((path, label))`` -> ``(bytes, label)``: an aiohttp GET on the loop.

    One ``ClientSession`` per event loop, made by the first fetch there and closed by
    ``aclose()`` (the loader awaits it on each loop it fetched on). ``limit=0`` lifts
    aiohttp's own cap of 100 connections, so the loader's ``io_concurrency`` is the bound.
    """

    def __init__(self, base: str, latency_ms: float) -> None:
        self.base = base
        self.query = f"?latency_ms={latency_ms:g}"
        self.sessions: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Any] = weakref.WeakKeyDictionary()

    async def __call__(self, item: tuple[str, int]) -> tuple[bytes, int]:
        path, label = item
        loop = asyncio.get_running_loop()
        if loop not in self.sessions:
            import aiohttp

            self.sessions[loop] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        async with self.sessions[loop].get(self.base + path + self.query) as resp:
            resp.raise_for_status()
            return await resp.read(), label

    async def aclose(self) -> None:
        session = self.sessions.pop(asyncio.get_running_loop(), None)
        if session is not None:
            await session.close()


class RawHttpFetch:
    """The same GET as :class:`HttpFetch` on a minimal HTTP/1.1 client (asyncio streams):
    a pool of idle keep-alive connections per event loop, ``Content-Length`` bodies only.

    Not a client to ship; it tells how much of the main process's CPU time per image is
    aiohttp's machinery rather than the loader's or the socket's.
    """

    def __init__(self, base: str, latency_ms: float) -> None:
        host, _, port = base.removeprefix("http://").partition(":")
        self.host, self.port = host, int(port or 80)
        self.query = f"?latency_ms={latency_ms:g}"
        self.pools: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, list[Any]] = (
            weakref.WeakKeyDictionary()
        )

    async def __call__(self, item: tuple[str, int]) -> tuple[bytes, int]:
        path, label = item
        pool = self.pools.setdefault(asyncio.get_running_loop(), [])
        reader, writer = pool.pop() if pool else await asyncio.open_connection(self.host, self.port)
        try:
            writer.write(f"GET {path}{self.query} HTTP/1.1\r\nHost: {self.host}\r\n\r\n".encode())
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head.split(b" ", 2)[1])
            length = next(
                int(line.split(b":", 1)[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            )
            body = await reader.readexactly(length)
        except BaseException:
            writer.close()
            raise
        pool.append((reader, writer))
        if status != 200:
            raise OSError(f"GET {path}: HTTP {status}")
        return body, label

    async def aclose(self) -> None:
        for _reader, writer in self.pools.pop(asyncio.get_running_loop(), []):
            writer.close()


class MemoryFetch:
    """``await fetch((path, label))`` -> ``(bytes, label)`` with no network at all: the
    JPEGs are read into the main process once, and each fetch waits ``latency_ms`` on the
    loop before it hands over its bytes.

    Not a way to load data; it measures what the loader's own fetch path (the fetch stage,
    the window, carrying the bytes to a worker) costs on top of local files, without an
    HTTP client or server on the same cores.
    """

    def __init__(self, root: str, latency_ms: float) -> None:
        self.root = Path(root)
        self.delay = latency_ms / 1000
        self.blobs: dict[str, bytes] = {}

    async def __call__(self, item: tuple[str, int]) -> tuple[bytes, int]:
        path, label = item
        if not self.blobs:
            self.blobs = {p: (self.root / p.lstrip("/")).read_bytes() for p, _ in jpeg_items(str(self.root))}
        if self.delay:
            await asyncio.sleep(self.delay)
        return self.blobs[path], label


class TorchHttpJpegs:
    """Map-style, for torch's DataLoader: a blocking GET per sample, then ``decode_train``.

    Each worker process opens one keep-alive ``http.client`` connection on first use
    (the process id tells a forked copy from its parent) and reopens it if it breaks.
    """

    def __init__(self, host: str, port: int, items: list[tuple[str, int]], latency_ms: float) -> None:
        self.host = host
        self.port = port
        self.items = items
        self.query = f"?latency_ms={latency_ms:g}"
        self._conn: http.client.HTTPConnection | None = None
        self._pid = -1

    def __len__(self) -> int:
        return len(self.items)

    def _get(self, path: str) -> bytes:
        if self._conn is None or self._pid != os.getpid():
            self._conn = http.client.HTTPConnection(self.host, self.port, timeout=60)
            self._pid = os.getpid()
        try:
            self._conn.request("GET", path + self.query)
            resp = self._conn.getresponse()
            data = resp.read()
        except (ConnectionError, http.client.HTTPException):
            self._conn.close()
            self._conn = None
            raise
        if resp.status != 200:
            raise OSError(f"GET {path}: HTTP {resp.status}")
        return data

    def __getitem__(self, index: int) -> tuple[Any, int]:
        path, label = self.items[index]
        return decode_train((self._get(path), label))

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_conn": None, "_pid": -1}


def _key(path: str) -> str:
    return path.lstrip("/")


class S3Fetch:
    """``await fetch((path, label))`` -> ``(bytes, label)`` from an S3 bucket, through
    :class:`aioloader.io.ObjectStore` (obstore) on the loader's event loop."""

    def __init__(self, url: str, options: dict[str, Any]) -> None:
        from aioloader.io import ObjectStore

        self.store = ObjectStore(url, **options)

    async def __call__(self, item: tuple[str, int]) -> tuple[bytes, int]:
        path, label = item
        return await self.store.get(_key(path)), label


class TorchS3Jpegs:
    """Map-style, for torch's DataLoader: a blocking S3 GET per sample (obstore's sync
    call, in the worker), then ``decode_train``."""

    def __init__(self, url: str, options: dict[str, Any], items: list[tuple[str, int]]) -> None:
        from aioloader.io import ObjectStore

        self.store = ObjectStore(url, **options)
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        path, label = self.items[index]
        return decode_train((self.store.get_sync(_key(path)), label))

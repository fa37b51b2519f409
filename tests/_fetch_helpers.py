"""What the fetch tests share with worker processes (importable by them): the HTTP
fetcher, the worker-side transforms, the local-file reference dataset, and the
server's process and control calls."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import urllib.request
import weakref
from pathlib import Path
from typing import Any

import numpy as np

N_FILES = 40
FILE_SIZE = 256
MISSING = "missing.bin"


def make_files(root: Path, n: int = N_FILES) -> list[tuple[str, int]]:
    """``n`` small files; the items ``(name, label)`` with ``label == index``."""
    items = []
    for i in range(n):
        name = f"f{i:03d}.bin"
        (root / name).write_bytes(bytes((i * 7 + j) % 256 for j in range(FILE_SIZE)))
        items.append((name, i))
    return items


class HttpFetch:
    """``await fetch((name, label))`` -> ``(bytes, label)`` over HTTP, with one aiohttp
    session per event loop (created on the first fetch there, closed by ``aclose()``,
    which the loader awaits on that loop when its runs there end)."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.sessions: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Any] = weakref.WeakKeyDictionary()
        self.closed = 0

    def _session(self) -> Any:
        import aiohttp

        loop = asyncio.get_running_loop()
        session = self.sessions.get(loop)
        if session is None:
            session = self.sessions[loop] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        return session

    async def __call__(self, item: tuple[str, int]) -> tuple[bytes, int]:
        name, label = item
        async with self._session().get(f"{self.base}/files/{name}") as resp:
            resp.raise_for_status()
            return await resp.read(), label

    async def aclose(self) -> None:
        session = self.sessions.pop(asyncio.get_running_loop(), None)
        if session is not None:
            self.closed += 1
            await session.close()


class LockedKeys(list):  # type: ignore[type-arg]
    """A key list that cannot pickle (it holds a lock): with ``fetch=`` it never has to."""

    def __init__(self, items: list[tuple[str, int]]) -> None:
        super().__init__(items)
        self.lock = threading.Lock()


class LocalFiles:
    """The reference: the same files read by the worker itself, ``(bytes, label)``."""

    def __init__(self, root: Path, items: list[tuple[str, int]]) -> None:
        self.root = root
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[bytes, int]:
        name, label = self.items[i]
        return (self.root / name).read_bytes(), label


def decode(raw: tuple[bytes, int]) -> tuple[np.ndarray, int]:
    """Bytes to floats, plus randomness from the global generator (which the loader seeds)."""
    data, label = raw
    arr = np.frombuffer(data, dtype=np.uint8).astype(np.float32)
    arr[0] += np.random.rand()
    return arr, label


def decode_plain(raw: tuple[bytes, int]) -> tuple[np.ndarray, int]:
    data, label = raw
    return np.frombuffer(data, dtype=np.uint8).astype(np.float32), label


def add_one(sample: tuple[np.ndarray, int]) -> tuple[np.ndarray, int]:
    return sample[0] + 1, sample[1]


class CrashOnce:
    """``decode``, except that the worker dies (``os._exit``) at sample ``label`` the
    first time (the marker file remembers across processes)."""

    def __init__(self, marker: Path, label: int) -> None:
        self.marker = marker
        self.label = label

    def __call__(self, raw: tuple[bytes, int]) -> tuple[np.ndarray, int]:
        if raw[1] == self.label and not self.marker.exists():
            self.marker.touch()
            os._exit(3)
        return decode(raw)


class RemoteFiles:
    """A dataset that knows how to fetch itself (the ``__aioloader_remote__`` hook)."""

    def __init__(self, base: str, items: list[tuple[str, int]]) -> None:
        self.base = base
        self.items = items
        self.calls = 0

    def __aioloader_remote__(self) -> tuple[Any, Any, Any]:
        self.calls += 1
        return self.items, HttpFetch(self.base), decode


class Server:
    """The HTTP server of :mod:`tests._http_server`, in a process of its own."""

    def __init__(self, root: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests._http_server", str(root)],
            stdout=subprocess.PIPE,
            cwd=Path(__file__).resolve().parents[1],
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # the port, once the socket listens
        if not line.strip():
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError("the test HTTP server did not start")
        self.base = f"http://127.0.0.1:{int(line)}"

    def _call(self, path: str, body: dict[str, Any] | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        with urllib.request.urlopen(urllib.request.Request(self.base + path, data=data), timeout=30) as resp:
            return json.loads(resp.read())

    def stats(self) -> dict[str, Any]:
        return self._call("/stats")  # type: ignore[no-any-return]

    def config(self, **body: Any) -> None:
        self._call("/config", body)

    def reset(self) -> None:
        self._call("/reset", {})

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)
        assert self.proc.stdout is not None
        self.proc.stdout.close()


def batches_key(batches: list[Any]) -> list[tuple[bytes, tuple[int, ...]]]:
    """Batches as comparable values (data bytes, labels), in the order given."""
    out = []
    for data, labels in batches:
        out.append((np.asarray(data).tobytes(), tuple(int(x) for x in np.asarray(labels))))
    return out


class Blob:
    """A fetched value whose copies in the main process can be watched (weakly)."""

    __slots__ = ("__weakref__", "data")

    def __init__(self, data: bytes) -> None:
        self.data = data

    def __reduce__(self) -> tuple[Any, ...]:
        return (Blob, (self.data,))


LIVE_BLOBS: weakref.WeakSet[Blob] = weakref.WeakSet()  # the Blobs fetch_blob made, while alive


async def fetch_blob(key: int) -> Blob:
    blob = Blob(bytes([key % 256]) * 64)
    LIVE_BLOBS.add(blob)
    return blob


def blob_key(blob: Blob) -> int:
    """The worker-side transform: the key the Blob was fetched for."""
    return blob.data[0]


def big_value(key: int) -> tuple[bytes, int]:
    """A fetched sample as HTTP and S3 bodies come: ``(bytes, label)``, large enough to
    travel beside a task's pickle (64 KiB and more), different for each key."""
    return bytes((key * 31 + j) % 251 for j in range(256)) * (256 + key), key


async def fetch_big(key: int) -> tuple[bytes, int]:
    return big_value(key)


def describe_value(raw: tuple[bytes, int]) -> tuple[str, int, int, int]:
    """The worker-side transform: what the worker got (its type, size, checksum, label)."""
    import zlib

    data, key = raw
    return type(data).__name__, len(data), zlib.crc32(data), key

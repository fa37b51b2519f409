"""The HTTP server of ``bench_remote.py``: a folder's files, from memory, with latency.

``python _bench_http.py ROOT [--kind raw|aiohttp]`` reads every file under ``ROOT`` into
memory, listens on 127.0.0.1 (a port the OS picks) and prints that port as its first line
of stdout once the socket listens (the benchmark reads it: synchronisation by pipe). It
serves until terminated or until its stdin ends (the benchmark's end of that pipe closes
when the benchmark exits, however it exits).
``GET /REL/PATH?latency_ms=N`` answers the bytes of ``ROOT/REL/PATH`` after N ms; an
unknown path is a 404. Connections are HTTP/1.1 keep-alive.

Two implementations, so that the server's own cost can be told apart from the loaders':

* ``raw`` (the default): a minimal HTTP/1.1 responder on an ``asyncio.Protocol``; the
  latency is a ``loop.call_later`` per request, so a waiting request costs no task.
* ``aiohttp``: an ``aiohttp.web`` application doing the same, as the fetch tests' server
  does (a task per request, aiohttp's parser and response machinery).

The server shares the machine's cores with the loaders it serves: on 2 cores, its CPU
time is time the loaders' workers do not get. The benchmark reports it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit


def load_files(root: Path) -> dict[str, bytes]:
    """Every regular file under ``root`` by its URL path (``/rel/path``), read once."""
    files: dict[str, bytes] = {}
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            if name.startswith("."):
                continue
            path = Path(dirpath) / name
            files["/" + path.relative_to(root).as_posix()] = path.read_bytes()
    return files


def _target(raw_target: str) -> tuple[str, float]:
    """``/a/b.jpg?latency_ms=10`` -> (``/a/b.jpg``, 0.010)."""
    parts = urlsplit(raw_target)
    latency = parse_qs(parts.query).get("latency_ms", ["0"])[0]
    return unquote(parts.path), float(latency) / 1000.0


_NOT_FOUND = b"HTTP/1.1 404 Not Found\r\nContent-Length: 9\r\nContent-Type: text/plain\r\n\r\nnot found"


class RawHttp(asyncio.Protocol):
    """One connection: requests parsed from the byte stream, answered in order.

    Clients here send one request at a time per connection (no pipelining), but a
    pipelined burst is still answered in order: the replies of one connection are
    scheduled with the same latency, and ``call_later`` keeps equal deadlines in order.
    """

    def __init__(self, files: dict[str, bytes]) -> None:
        self.files = files
        self.buf = b""
        self.transport: Any = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head, self.buf = self.buf[:end], self.buf[end + 4 :]
            # GET requests carry no body; anything else is answered 404 the same way.
            line = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ")
            path, latency = _target(line[1]) if len(line) >= 2 else ("", 0.0)
            body = self.files.get(path)
            reply = (
                [
                    b"HTTP/1.1 200 OK\r\nContent-Type: image/jpeg\r\nContent-Length: %d\r\n\r\n" % len(body),
                    body,
                ]
                if body is not None
                else [_NOT_FOUND]
            )
            if latency > 0:
                asyncio.get_running_loop().call_later(latency, self._send, reply)
            else:
                self._send(reply)

    def _send(self, reply: list[bytes]) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.writelines(reply)


def _parent_gone() -> asyncio.Future[None]:
    """Done when stdin ends: the benchmark holds the other end of that pipe, so a server
    whose benchmark was killed stops instead of serving on as an orphan."""
    loop = asyncio.get_running_loop()
    gone: asyncio.Future[None] = loop.create_future()
    fd = sys.stdin.fileno()

    def readable() -> None:
        if not os.read(fd, 4096):
            loop.remove_reader(fd)
            if not gone.done():
                gone.set_result(None)

    loop.add_reader(fd, readable)
    return gone


async def _serve_raw(files: dict[str, bytes]) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: RawHttp(files), "127.0.0.1", 0, backlog=1024)
    print(server.sockets[0].getsockname()[1], flush=True)
    async with server:
        await _parent_gone()


async def _serve_aiohttp(files: dict[str, bytes]) -> None:
    from aiohttp import web

    async def get(request: web.Request) -> web.Response:
        latency = float(request.query.get("latency_ms", "0")) / 1000.0
        if latency > 0:
            await asyncio.sleep(latency)
        body = files.get(request.path)
        if body is None:
            return web.Response(status=404, text="not found")
        return web.Response(body=body, content_type="image/jpeg")

    app = web.Application()
    app.router.add_get("/{tail:.*}", get)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, backlog=1024)
    await site.start()
    server: Any = site._server
    print(server.sockets[0].getsockname()[1], flush=True)
    try:
        await _parent_gone()  # or until terminated
    finally:
        await runner.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description="serve a folder from memory, with per-request latency")
    parser.add_argument("root", type=Path)
    parser.add_argument("--kind", choices=("raw", "aiohttp"), default="raw")
    args = parser.parse_args()
    files = load_files(args.root)
    asyncio.run(_serve_raw(files) if args.kind == "raw" else _serve_aiohttp(files))


if __name__ == "__main__":
    main()

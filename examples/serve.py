"""An image-inference HTTP service on the standard library, preprocessing through a
:class:`aioloader.StreamLoader`.

    python examples/serve.py --port 8080 --workers 2 --duration 60
    python examples/serve_load.py --port 8080 --requests 2000 --concurrency 32

``POST /predict`` with an encoded image (JPEG, PNG, ...) as the body answers
``{"id": ..., "mean_rgb": [r, g, b], "batch": n, "server_ms": ...}``: the stand-in model is
the mean of each channel of the image resized to 64x64. A body that does not decode
gets ``400`` with the decoder's message. ``GET /health`` answers ``{"ok": true}``.

How it fits together: each request puts ``(id, body)`` into an ``asyncio.Queue``; the
StreamLoader takes from that queue, groups requests into micro-batches (``--batch-size``
or ``--max-latency``, whichever comes first), and decodes and resizes them in worker
processes; one task runs the model on each batch and resolves each request's future.
The queue is bounded, so when workers fall behind, request handlers wait to enqueue
and the connections feel the backpressure.

The server stops by itself after ``--duration`` seconds or ``--max-requests`` answers
(or on SIGINT/SIGTERM): it stops accepting, finishes the requests in progress, closes
idle keep-alive connections, drains the stream and prints one JSON summary line.
HTTP support is deliberately minimal: HTTP/1.0 and 1.1, ``Content-Length`` bodies (no
chunked uploads), keep-alive.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import itertools
import json
import signal
import sys
import time
from typing import Any

import numpy as np
from PIL import Image

from aioloader.stream import END, StreamLoader

SIZE = 64
MAX_HEAD = 16 * 1024
MAX_BODY = 32 * 1024 * 1024
REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    411: "Length Required",
    413: "Payload Too Large",
    431: "Request Header Fields Too Large",
    503: "Service Unavailable",
}


# ------------------------------------------------------------ runs in the workers
def preprocess(item: tuple[int, bytes]) -> tuple[int, np.ndarray | None, str]:
    """Decode and resize one upload. Never raises: a bad image becomes an error string,
    so one broken upload answers 400 instead of failing its whole micro-batch."""
    req_id, body = item
    try:
        with Image.open(io.BytesIO(body)) as im:
            rgb = im.convert("RGB").resize((SIZE, SIZE), Image.Resampling.BILINEAR)
        return req_id, np.asarray(rgb, dtype=np.float32) / 255.0, ""
    except Exception as exc:  # any decoder failure is the client's problem
        return req_id, None, f"{type(exc).__name__}: {exc}"


def collate(samples: list[tuple[int, np.ndarray | None, str]]) -> dict[str, Any]:
    good = [(i, a) for i, a, _ in samples if a is not None]
    return {
        "ids": [i for i, _ in good],
        "pixels": np.stack([a for _, a in good]) if good else None,
        "errors": {i: e for i, a, e in samples if a is None},
    }


# --------------------------------------------------------------- in the server
def model(pixels: np.ndarray) -> np.ndarray:
    """The stand-in model: mean of each channel, shape (N, 3)."""
    return pixels.mean(axis=(1, 2))


class HttpError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


async def read_request(reader: asyncio.StreamReader) -> tuple[str, str, str, dict[str, str], bytes] | None:
    """One request, or ``None`` when the client closed the connection between requests."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise HttpError(400, "truncated request head") from None
    except asyncio.LimitOverrunError:
        raise HttpError(431, "request head too large") from None
    lines = head.decode("latin-1").split("\r\n")
    try:
        method, target, version = lines[0].split(" ", 2)
    except ValueError:
        raise HttpError(400, f"malformed request line {lines[0]!r}") from None
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if line:
            name, sep, value = line.partition(":")
            if not sep:
                raise HttpError(400, f"malformed header line {line!r}")
            headers[name.strip().lower()] = value.strip()
    if "chunked" in headers.get("transfer-encoding", "").lower():
        raise HttpError(411, "chunked bodies are not supported; send Content-Length")
    try:
        length = int(headers.get("content-length", "0"))
    except ValueError:
        raise HttpError(400, "bad Content-Length") from None
    if length < 0 or length > MAX_BODY:
        raise HttpError(413, f"body of {length} bytes is over the limit of {MAX_BODY}")
    body = await reader.readexactly(length) if length else b""
    return method, target, version, headers, body


def write_response(
    writer: asyncio.StreamWriter, status: int, payload: dict[str, Any], keep_alive: bool
) -> None:
    body = json.dumps(payload).encode()
    head = (
        f"HTTP/1.1 {status} {REASONS.get(status, 'Unknown')}\r\n"
        "Content-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n"
        f"Connection: {'keep-alive' if keep_alive else 'close'}\r\n\r\n"
    )
    writer.write(head.encode("latin-1") + body)


class Service:
    def __init__(self, max_requests: int | None, queue_size: int) -> None:
        self.queue: asyncio.Queue[Any] = asyncio.Queue(maxsize=queue_size)
        self.waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.ids = itertools.count()
        self.max_requests = max_requests
        self.answered = 0
        self.failed = 0
        self.batches: list[int] = []
        self.stop = asyncio.Event()
        self.stopping = False
        self.connections: set[asyncio.Task[Any]] = set()
        self.idle: set[asyncio.StreamWriter] = set()  # connections waiting for a request

    # -- inference
    async def infer(self, stream: StreamLoader) -> None:
        async for batch in stream:
            ids = batch["ids"]
            self.batches.append(len(ids) + len(batch["errors"]))
            if ids:
                for req_id, mean in zip(ids, model(batch["pixels"]), strict=True):
                    self._resolve(req_id, {"mean_rgb": [round(float(v), 6) for v in mean], "batch": len(ids)})
            for req_id, error in batch["errors"].items():
                self._resolve(req_id, {"error": error})

    def _resolve(self, req_id: int, result: dict[str, Any]) -> None:
        fut = self.waiting.pop(req_id, None)
        if fut is not None and not fut.done():
            fut.set_result(result)

    async def predict(self, body: bytes) -> tuple[int, dict[str, Any]]:
        t0 = time.perf_counter()
        req_id = next(self.ids)
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.waiting[req_id] = fut
        try:
            await self.queue.put((req_id, body))
            result = await fut
        finally:
            self.waiting.pop(req_id, None)
        result["id"] = req_id
        result["server_ms"] = round((time.perf_counter() - t0) * 1e3, 3)
        return (400 if "error" in result else 200), result

    # -- connections
    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.connections.add(task)
        try:
            while not self.stopping:
                self.idle.add(writer)
                try:
                    req = await read_request(reader)
                except HttpError as exc:
                    write_response(writer, exc.status, {"error": str(exc)}, keep_alive=False)
                    await writer.drain()
                    return
                finally:
                    self.idle.discard(writer)
                if req is None:
                    return
                method, target, version, headers, body = req
                conn = headers.get("connection", "").lower()
                keep = conn != "close" and (version == "HTTP/1.1" or conn == "keep-alive")
                if target == "/predict":
                    if method != "POST":
                        status, payload = 405, {"error": "use POST with the image as the body"}
                    else:
                        status, payload = await self.predict(body)
                        self._count(status)
                elif target == "/health" and method == "GET":
                    status, payload = 200, {"ok": True}
                else:
                    status, payload = 404, {"error": f"no route for {method} {target}"}
                keep = keep and not self.stopping
                write_response(writer, status, payload, keep)
                await writer.drain()
                if not keep:
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self.connections.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    def _count(self, status: int) -> None:
        self.answered += 1
        self.failed += status != 200
        if self.max_requests is not None and self.answered >= self.max_requests:
            self.stop.set()

    async def shutdown(self) -> None:
        """Finish requests in progress, close idle connections."""
        self.stopping = True
        for writer in list(self.idle):
            writer.close()  # its handler reads end-of-file and returns
        if self.connections:
            await asyncio.gather(*self.connections, return_exceptions=True)


async def warm_up(service: Service, n: int) -> None:
    """Start the workers before the first client waits for them."""
    buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, format="PNG")
    await asyncio.gather(*(service.predict(buf.getvalue()) for _ in range(n)))


async def serve(args: argparse.Namespace) -> dict[str, Any]:
    service = Service(args.max_requests, queue_size=4 * args.batch_size)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, service.stop.set)
    stream = StreamLoader(
        service.queue,
        preprocess,
        batch_size=args.batch_size,
        max_latency=args.max_latency,
        collate_fn=collate,
        num_workers=args.workers,
        ordered=False,  # a slow upload must not hold back the others
    )
    async with stream:
        infer = asyncio.create_task(service.infer(stream))
        await warm_up(service, 4 * args.batch_size)
        server = await asyncio.start_server(service.handle, args.host, args.port, limit=MAX_HEAD)
        host, port = server.sockets[0].getsockname()[:2]
        print(f"listening on http://{host}:{port}", flush=True)
        started = time.perf_counter()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(service.stop.wait(), args.duration)
        server.close()
        await service.shutdown()
        await server.wait_closed()
        await service.queue.put(END)  # the stream drains what is queued, then ends
        await infer
        elapsed = time.perf_counter() - started
    return {
        "answered": service.answered,
        "failed": service.failed,
        "seconds": round(elapsed, 3),
        "batches": len(service.batches),
        "mean_batch": round(float(np.mean(service.batches)), 2) if service.batches else 0.0,
        "restarts": stream.stats().restarts,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0, help="0 picks a free port (printed on start)")
    ap.add_argument("--workers", type=int, default=2, help="preprocessing processes (0: a thread)")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-latency", type=float, default=0.005, help="seconds a partial batch may wait")
    ap.add_argument("--duration", type=float, default=30.0, help="stop after this many seconds")
    ap.add_argument("--max-requests", type=int, default=None, help="stop after answering this many")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import uvloop

        summary = uvloop.run(serve(args))
    except ImportError:  # pragma: no cover
        summary = asyncio.run(serve(args))
    print(json.dumps({"server": summary}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

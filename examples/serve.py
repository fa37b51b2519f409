"""An image-inference HTTP service: aiohttp in front, :class:`aioloader.Batcher` behind.

    python examples/serve.py --port 8080 --workers 2 --duration 60
    python examples/serve_load.py --port 8080 --requests 2000 --concurrency 32

``POST /predict`` with an encoded image (JPEG, PNG, ...) as the body answers
``{"mean_rgb": [r, g, b], "server_ms": ...}``: the stand-in model is the mean of each
channel of the image resized to 64x64. ``GET /health`` answers ``{"ok": true}``,
``GET /stats`` the Batcher's statistics.

Every error answers ``{"error": "ClassName: first line of its message"}``, never a
traceback (see :func:`error_answer`):

* ``400``: the body does not decode (Pillow's ``OSError`` or ``ValueError``), for that
  request alone;
* ``503`` with ``Retry-After``: ``aioloader.Overloaded``. ``--max-pending`` requests
  already wait, or (with ``--deadline-ms``) the Batcher estimates it would answer too late;
* ``504``: ``aioloader.DeadlineExceeded`` (the deadline passed) or
  ``aioloader.LoaderTimeout`` (``fn`` overran the Batcher's ``timeout``);
* ``500``: any other aioloader error (``WorkerCrashedError``: the upload kept killing its
  worker) or any other exception; the server logs the latter with its traceback.

The whole of the batching is the handler's one line, ``await batcher.submit(body)``: the
Batcher groups concurrent uploads into micro-batches (``--batch-size``, or whatever has
arrived ``--max-latency`` seconds after the first), decodes and resizes them in worker
processes, and hands each request its own array. A client that hangs up withdraws its
upload: aiohttp cancels its handler (``handler_cancellation=True``, see ``make_runner``),
so an upload still queued never reaches a worker and one at a worker has its result
dropped. ``examples/serve_fastapi.py`` is the same service on FastAPI and uvicorn.

The server stops by itself after ``--duration`` seconds or ``--max-requests`` answers
(or on SIGINT/SIGTERM) and prints one JSON summary line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import io
import json
import logging
import math
import signal
import sys
import time
from typing import Any

import numpy as np
from aiohttp import web
from PIL import Image

import aioloader

SIZE = 64


# ------------------------------------------------------------ runs in the workers
def preprocess(body: bytes) -> np.ndarray:
    """Decode and resize one upload; raises (for this request only) if it is no image."""
    with Image.open(io.BytesIO(body)) as im:
        rgb = im.convert("RGB").resize((SIZE, SIZE), Image.Resampling.BILINEAR)
    return np.asarray(rgb, dtype=np.float32) / 255.0


# --------------------------------------------------------------- in the server
log = logging.getLogger("serve")


def error_answer(exc: Exception) -> tuple[int, dict[str, str], str]:
    """HTTP status, headers and message for an error of batcher.submit()."""
    message = one_line(exc)
    if isinstance(exc, aioloader.Overloaded):  # busy: try again later
        seconds = max(1, math.ceil(exc.retry_after))
        return 503, {"Retry-After": str(seconds)}, message
    if isinstance(exc, (aioloader.DeadlineExceeded, aioloader.LoaderTimeout)):
        return 504, {}, message
    if isinstance(exc, aioloader.AioLoaderError):  # WorkerCrashedError, ...
        return 500, {}, message
    if isinstance(exc, (OSError, ValueError)):  # preprocess() refused it
        return 400, {}, message
    log.error("request failed", exc_info=exc)  # the traceback stays here
    return 500, {}, message


def one_line(exc: BaseException, limit: int = 200) -> str:
    """``ClassName: first line of the message``, at most ``limit`` characters."""
    lines = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def model(pixels: np.ndarray) -> list[float]:
    """The stand-in model: the mean of each channel."""
    return [float(v) for v in pixels.mean(axis=(0, 1))]


class Service:
    def __init__(
        self, batcher: aioloader.Batcher[np.ndarray], max_requests: int | None, deadline: float | None = None
    ) -> None:
        self.batcher = batcher
        self.max_requests = max_requests
        self.deadline = deadline
        self.answered = 0
        self.failed = 0
        self.overloaded = 0
        self.late = 0
        self.errors = 0  # answered 500
        self.done = asyncio.Event()

    def _count(self) -> None:
        self.answered += 1
        if self.max_requests is not None and self.answered >= self.max_requests:
            self.done.set()

    async def predict(self, request: web.Request) -> web.Response:
        t0 = time.perf_counter()
        body = await request.read()
        try:
            pixels = await self.batcher.submit(body, deadline=self.deadline)
        except Exception as exc:
            status, headers, message = error_answer(exc)
            self._count_error(status)
            answer = {"error": message}
            return web.json_response(answer, status=status, headers=headers)
        self._count()
        ms = (time.perf_counter() - t0) * 1e3
        return web.json_response({"mean_rgb": model(pixels), "server_ms": ms})

    def _count_error(self, status: int) -> None:
        if status == 400:  # a verdict on the upload: answered
            self.failed += 1
            self._count()
        elif status == 503:
            self.overloaded += 1
        elif status == 504:
            self.late += 1
        else:
            self.errors += 1

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def stats(self, request: web.Request) -> web.Response:
        return web.json_response(_stats(self.batcher.stats()))


def make_runner(service: Service) -> web.AppRunner:
    """The aiohttp app of ``service``, ready to be set up and given a site."""
    app = web.Application(client_max_size=32 * 1024 * 1024)
    app.add_routes(
        [
            web.post("/predict", service.predict),
            web.get("/health", service.health),
            web.get("/stats", service.stats),
        ]
    )
    # handler_cancellation: aiohttp cancels the handler of a client that hung up, and
    # the cancelled `await batcher.submit()` withdraws its upload. By default aiohttp
    # lets the handler run on: the upload would stay queued or at a worker.
    return web.AppRunner(app, access_log=None, handle_signals=False, handler_cancellation=True)


def _stats(st: aioloader.BatcherStats) -> dict[str, Any]:
    return {
        "submitted": st.submitted,
        "completed": st.completed,
        "failed": st.failed,
        "rejected": st.rejected,
        "rejected_late": st.rejected_late,  # (of them, refused for their deadline)
        "expired": st.expired + st.expired_after_dispatch,
        "cancelled": st.cancelled_before_dispatch + st.cancelled_after_dispatch,
        "batch_sizes": {str(k): v for k, v in sorted(st.batch_sizes.items())},
        "queue_wait_p99_ms": None if st.queue_wait_s[1] is None else round(st.queue_wait_s[1] * 1e3, 3),
        "service_p99_ms": None if st.service_s[1] is None else round(st.service_s[1] * 1e3, 3),
        "restarts": st.restarts,
    }


async def serve(args: argparse.Namespace) -> dict[str, Any]:
    batcher: aioloader.Batcher[np.ndarray] = aioloader.Batcher(
        preprocess,
        batch_size=args.batch_size,
        max_latency=args.max_latency,
        num_workers=args.workers,
        max_pending=args.max_pending,
    )
    async with batcher:
        deadline = None if args.deadline_ms is None else args.deadline_ms / 1e3
        service = Service(batcher, args.max_requests, deadline)
        await batcher.submit_many([_warm_image()] * max(1, args.workers))  # start the workers now
        # Everything allocated so far (modules, the app, the pool) lives as long as the
        # service: out of the cyclic collector's reach, a full collection no longer walks
        # it, so the pauses it puts on every request in flight stay short.
        gc.collect()
        gc.freeze()
        runner = make_runner(service)
        await runner.setup()
        site = web.TCPSite(runner, args.host, args.port)
        await site.start()
        host, port = runner.addresses[0][:2]
        print(f"listening on http://{host}:{port}", flush=True)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, service.done.set)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(service.done.wait(), args.duration)
        await runner.cleanup()  # stops accepting, lets the handlers of clients still there finish
        summary = {
            "answered": service.answered,
            "failed": service.failed,
            "overloaded": service.overloaded,
            "late": service.late,
            "errors": service.errors,
            **_stats(batcher.stats()),
        }
    return summary


def _warm_image() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (SIZE, SIZE)).save(buf, format="PNG")
    return buf.getvalue()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="Image preprocessing service on aioloader.Batcher and aiohttp.")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0, help="0 picks a free port (printed on start)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-latency", type=float, default=0.005, help="seconds a micro-batch waits to fill")
    ap.add_argument("--max-pending", type=int, default=256, help="waiting uploads before answering 503")
    ap.add_argument(
        "--deadline-ms", type=float, default=None, help="answer each upload within this (503/504)"
    )
    ap.add_argument("--duration", type=float, default=60.0, help="stop after this many seconds")
    ap.add_argument("--max-requests", type=int, default=None, help="stop after this many answers")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on POSIX
        summary = asyncio.run(serve(args))
    else:
        summary = uvloop.run(serve(args))
    print(json.dumps({"server": summary}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

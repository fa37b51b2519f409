"""The image service of ``examples/serve.py``, on FastAPI and uvicorn.

    python examples/serve_fastapi.py --port 8080 --workers 2
    python examples/serve_load.py --port 8080 --requests 2000 --concurrency 32

The same endpoints and answers as ``serve.py``: ``POST /predict`` with an encoded image
answers ``{"mean_rgb": [r, g, b], "server_ms": ...}``; ``GET /health`` and ``GET /stats``
as there. Errors answer as there too (:func:`error_answer`), with
``{"error": "ClassName: first line"}`` and never a traceback: a body that does not decode
``400``, ``Overloaded`` ``503`` with ``Retry-After``, ``DeadlineExceeded`` and
``LoaderTimeout`` ``504``, any other error ``500``. The Batcher lives in the app's
lifespan: it starts before the first request and closes after the last.

One line is particular to ASGI: ``app.add_middleware(CancelOnDisconnect)``. uvicorn
never cancels a handler whose client hung up; without the middleware, its upload would
stay queued or at a worker, and a shutdown would wait for it. With it, the upload is
withdrawn (``stats().cancelled_before_dispatch`` or ``cancelled_after_dispatch``).

Stops on SIGINT or SIGTERM: uvicorn answers the clients still connected, the lifespan
closes the Batcher, and the server prints one JSON summary line.
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import logging
import math
import socket
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from PIL import Image

import aioloader
from aioloader.web import CancelOnDisconnect

SIZE = 64


# ------------------------------------------------------------ runs in the workers
def preprocess(body: bytes) -> np.ndarray:
    """Decode and resize one upload; raises (for this request only) if it is no image."""
    with Image.open(io.BytesIO(body)) as im:
        rgb = im.convert("RGB").resize((SIZE, SIZE), Image.Resampling.BILINEAR)
    return np.asarray(rgb, dtype=np.float32) / 255.0


# --------------------------------------------------------------- in the server
log = logging.getLogger("serve_fastapi")


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


COUNTED = {400: "failed", 503: "overloaded", 504: "late"}  # the summary's counts; 500: "errors"


def create_app(
    make_batcher: Callable[[], aioloader.Batcher[np.ndarray]] | None = None,
    deadline: float | None = None,
    warm_up: int = 1,
    freeze_gc: bool = True,
) -> FastAPI:
    """The service. ``make_batcher`` builds its Batcher when the app starts (by default
    two workers over :func:`preprocess`); ``warm_up`` images go through it before the
    first request, so that its workers are up. ``freeze_gc``: see ``serve.py`` (a
    test that runs the app in its own process leaves its heap alone)."""
    counts: Counter[str] = Counter()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        batcher = make_batcher() if make_batcher is not None else aioloader.Batcher(preprocess, num_workers=2)
        async with batcher:
            app.state.batcher = batcher
            if warm_up:
                await batcher.submit_many([_warm_image()] * warm_up)
            if freeze_gc:  # what lives as long as the service leaves the collector's reach
                gc.collect()
                gc.freeze()
            yield
        print(json.dumps({"server": {**counts, **_stats(batcher.stats())}}), flush=True)

    app = FastAPI(lifespan=lifespan)
    # The client that hangs up withdraws its upload: uvicorn alone would let it run on.
    app.add_middleware(CancelOnDisconnect)

    @app.post("/predict")
    async def predict(request: Request) -> JSONResponse:
        t0 = time.perf_counter()
        body = await request.body()
        batcher: aioloader.Batcher[np.ndarray] = request.app.state.batcher
        try:
            pixels = await batcher.submit(body, deadline=deadline)
        except Exception as exc:
            status, headers, message = error_answer(exc)
            counts[COUNTED.get(status, "errors")] += 1
            if status == 400:  # a verdict on the upload: answered
                counts["answered"] += 1
            return JSONResponse({"error": message}, status_code=status, headers=headers)
        counts["answered"] += 1
        return JSONResponse({"mean_rgb": model(pixels), "server_ms": (time.perf_counter() - t0) * 1e3})

    @app.get("/health")
    async def health() -> dict[str, bool]:
        return {"ok": True}

    @app.get("/stats")
    async def stats(request: Request) -> dict[str, Any]:
        return _stats(request.app.state.batcher.stats())

    return app


def _stats(st: aioloader.BatcherStats) -> dict[str, Any]:
    return {
        "submitted": st.submitted,
        "completed": st.completed,
        "failed_in_fn": st.failed,
        "rejected": st.rejected,
        "expired": st.expired + st.expired_after_dispatch,
        "cancelled_before_dispatch": st.cancelled_before_dispatch,
        "cancelled_after_dispatch": st.cancelled_after_dispatch,
        "waiting": st.waiting,
        "in_flight": st.in_flight,
        "batch_sizes": {str(k): v for k, v in sorted(st.batch_sizes.items())},
        "restarts": st.restarts,
    }


def _warm_image() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (SIZE, SIZE)).save(buf, format="PNG")
    return buf.getvalue()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="Image preprocessing service on aioloader.Batcher and FastAPI.")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0, help="0 picks a free port (printed on start)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--max-latency", type=float, default=0.005, help="seconds a micro-batch waits to fill")
    ap.add_argument("--max-pending", type=int, default=256, help="waiting uploads before answering 503")
    ap.add_argument(
        "--deadline-ms", type=float, default=None, help="answer each upload within this (503/504)"
    )
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def make_batcher() -> aioloader.Batcher[np.ndarray]:
        return aioloader.Batcher(
            preprocess,
            batch_size=args.batch_size,
            max_latency=args.max_latency,
            num_workers=args.workers,
            max_pending=args.max_pending,
        )

    deadline = None if args.deadline_ms is None else args.deadline_ms / 1e3
    run(create_app(make_batcher, deadline, warm_up=max(1, args.workers)), args.host, args.port)
    return 0


def run(app: FastAPI, host: str, port: int) -> None:
    """Serve ``app`` under uvicorn until SIGINT or SIGTERM."""
    # Bound and listening before uvicorn starts: the port is known (and printed) even
    # with --port 0, and a client that connects early waits in the backlog.
    sock = socket.create_server((host, port))
    host, port = sock.getsockname()[:2]
    print(f"listening on http://{host}:{port}", flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    try:
        server.run(sockets=[sock])  # (uvicorn picks uvloop when it is installed)
    except KeyboardInterrupt:  # uvicorn raises the signal again once it has shut down
        pass
    finally:
        sock.close()


if __name__ == "__main__":
    sys.exit(main())

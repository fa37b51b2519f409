"""A client that hangs up withdraws its request, under the servers users run: uvicorn
with FastAPI (:class:`aioloader.web.CancelOnDisconnect`) and aiohttp
(``handler_cancellation=True``, as ``examples/serve.py`` sets it).

The Batcher's ``fn`` blocks until the test lets it go (``tests/_serve_helpers.py``),
so every step waits on state the test can see: a call entered, a request queued, a
count in the stats. The clients speak HTTP/1.1 over raw sockets, to hang up exactly
when the test says."""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import io
import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import uvicorn
from aiohttp import web
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from PIL import Image
from starlette.background import BackgroundTask

import aioloader
from aioloader.web import CancelOnDisconnect

from . import _serve_helpers as H
from .conftest import wait_until, wait_until_async

ROOT = Path(__file__).resolve().parents[1]


def _example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{name}", ROOT / "examples" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


serve_aiohttp = _example("serve")
serve_fastapi = _example("serve_fastapi")


@pytest.fixture(autouse=True)
def _reset() -> Iterator[None]:
    H.reset()
    yield
    H.hold.set()  # never leave the Batcher's thread blocked


def _png(colour: tuple[int, int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), colour).save(buf, format="PNG")
    return buf.getvalue()


def _request(path: str, body: bytes) -> bytes:
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/octet-stream\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


class Client:
    """One HTTP/1.1 request on a connection of its own (asyncio streams)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def post(cls, port: int, path: str, body: bytes) -> Client:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(_request(path, body))
        await writer.drain()
        return cls(reader, writer)

    async def answer(self) -> tuple[int, Any]:
        data = await asyncio.wait_for(self.reader.read(), 30)  # the server closes after it
        await self.hang_up()
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 "), data[:200]
        return int(head.split()[1]), json.loads(body)

    async def hang_up(self) -> None:
        self.writer.close()
        await self.writer.wait_closed()


async def _entered() -> None:
    await asyncio.get_running_loop().run_in_executor(None, H.entered.wait, 20)
    assert H.entered.is_set()


def _held_batcher() -> aioloader.Batcher[Any]:
    # One request at a time at the only (thread) worker: a second one waits in the queue.
    return aioloader.Batcher(H.decode_held, batch_size=1, max_latency=0, prefetch=1)


@asynccontextmanager
async def _uvicorn(app: Any) -> AsyncIterator[int]:
    """``app`` under a real uvicorn on this loop; yields its port, stops it after."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on"))
    task = asyncio.ensure_future(server.serve())
    try:
        await wait_until_async(lambda: server.started or task.done(), 30, "uvicorn to start")
        assert server.started, task.result()
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 30)


async def _withdrawals(batcher: aioloader.Batcher[Any], port: int, path: str = "/predict") -> None:
    """One client hangs up while a worker runs its request, one while its request is
    queued: both are withdrawn; once the worker is let go nothing is left in flight,
    and a client that stays gets its answer."""
    running = await Client.post(port, path, b"hold")
    await _entered()
    queued = await Client.post(port, path, b"queued")
    await wait_until_async(lambda: batcher.stats().waiting == 1, 10, "the second request to be queued")
    await running.hang_up()
    await queued.hang_up()
    now = batcher.stats
    await wait_until_async(
        lambda: (now().cancelled_before_dispatch, now().cancelled_after_dispatch) == (1, 1),
        10,
        "both to be withdrawn",
    )
    H.hold.set()
    await wait_until_async(lambda: batcher.stats().in_flight == 0, 10, "the dropped result to come back")
    status, payload = await (await Client.post(port, path, _png((255, 0, 51)))).answer()
    assert status == 200 and np.allclose(payload["mean_rgb"], [1.0, 0.0, 0.2], atol=1e-3), payload
    st = batcher.stats()
    assert (st.waiting, st.in_flight, st.completed) == (0, 0, 1)
    assert H.calls == [b"hold", _png((255, 0, 51))]  # the queued upload never reached fn


@pytest.mark.asyncio
async def test_uvicorn_fastapi_client_that_hangs_up_withdraws_its_request() -> None:
    app = serve_fastapi.create_app(_held_batcher, warm_up=0, freeze_gc=False)
    async with _uvicorn(app) as port:
        await _withdrawals(app.state.batcher, port)


@pytest.mark.asyncio
async def test_aiohttp_with_handler_cancellation_withdraws_the_request() -> None:
    async with _held_batcher() as batcher:
        runner = serve_aiohttp.make_runner(serve_aiohttp.Service(batcher, None))
        await runner.setup()
        try:
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            await _withdrawals(batcher, runner.addresses[0][1])
        finally:
            await runner.cleanup()


@pytest.mark.asyncio
async def test_middleware_keeps_bodies_background_tasks_and_lifespan_whole() -> None:
    """A body in many chunks arrives whole; a disconnect after the response is complete
    cancels nothing (the background task runs on); the lifespan passes through."""
    go, ran = asyncio.Event(), asyncio.Event()
    started: list[str] = []

    async def after() -> None:
        await go.wait()
        ran.set()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        started.append("up")
        yield

    app = FastAPI(lifespan=lifespan)
    app.add_middleware(CancelOnDisconnect)

    @app.post("/echo")
    async def echo(request: Request) -> dict[str, Any]:
        body = await request.body()
        return {"n": len(body), "sha": hashlib.sha256(body).hexdigest()}

    @app.post("/later")
    async def later() -> JSONResponse:
        return JSONResponse({"ok": True}, background=BackgroundTask(after))

    big = os.urandom(3 * 1024 * 1024)  # uvicorn hands it over in many chunks
    async with _uvicorn(app) as port:
        assert started == ["up"]
        status, payload = await (await Client.post(port, "/echo", big)).answer()
        assert status == 200 and payload == {"n": len(big), "sha": hashlib.sha256(big).hexdigest()}
        status, payload = await (await Client.post(port, "/later", b"")).answer()  # and hangs up
        assert (status, payload) == (200, {"ok": True})
        go.set()
        await asyncio.wait_for(ran.wait(), 10)


@pytest.mark.asyncio
async def test_middleware_passes_errors_and_leaves_websocket_scopes_alone() -> None:
    async def failing(scope: Any, receive: Any, send: Any) -> None:
        raise KeyError("the app's own error")

    seen: list[str] = []

    async def plain(scope: Any, receive: Any, send: Any) -> None:
        seen.append(scope["type"])

    async def reader(scope: Any, receive: Any, send: Any) -> None:
        await receive()

    async def broken() -> Any:
        raise OSError("the server's receive failed")

    with pytest.raises(KeyError, match="the app's own error"):
        await CancelOnDisconnect(failing)({"type": "http"}, _never, _discard)
    with pytest.raises(OSError, match="the server's receive failed"):
        await CancelOnDisconnect(reader)({"type": "http"}, broken, _discard)
    await CancelOnDisconnect(plain)({"type": "websocket"}, _never, _discard)
    assert seen == ["websocket"]


@pytest.mark.asyncio
async def test_a_server_cancelling_the_request_cancels_the_app_and_is_not_swallowed() -> None:
    entered, finished = asyncio.Event(), asyncio.Event()

    async def waits(scope: Any, receive: Any, send: Any) -> None:
        entered.set()
        try:
            await asyncio.Event().wait()
        finally:
            finished.set()

    call = asyncio.ensure_future(CancelOnDisconnect(waits)({"type": "http"}, _never, _discard))
    await asyncio.wait_for(entered.wait(), 10)
    call.cancel()  # as uvicorn does past its timeout_graceful_shutdown
    with pytest.raises(asyncio.CancelledError):
        await call
    assert finished.is_set()


async def _never() -> Any:
    await asyncio.Event().wait()


async def _discard(message: Any) -> None:
    pass


def _get_json(port: int, path: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as resp:
        return dict(json.loads(resp.read()))


def _withdrawn(stats: dict[str, Any]) -> tuple[int, int]:
    return stats["cancelled_before_dispatch"], stats["cancelled_after_dispatch"]


def test_uvicorn_stops_at_sigint_without_waiting_for_abandoned_work(tmp_path: Path) -> None:
    """The example app under uvicorn in a process of its own: four clients hang up, two
    of them while their requests run at the workers (which stay blocked). SIGINT stops
    the server anyway, and its summary shows every request withdrawn."""
    gate = tmp_path / "gate"  # never created: the held calls never return by themselves
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    )
    # (uvicorn installs its own SIGINT handler, whatever disposition the server inherits)
    server = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "_asgi_server.py"), str(gate)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
    )  # fmt: skip
    clients: list[socket.socket] = []
    try:
        assert server.stdout is not None
        first = server.stdout.readline()
        assert first.startswith("listening on http://127.0.0.1:"), first
        port = int(first.strip().rsplit(":", 1)[1])
        for k in range(4):
            clients.append(socket.create_connection(("127.0.0.1", port), timeout=10))
            clients[-1].sendall(_request("/predict", b"hold %d" % k))
        wait_until(lambda: _get_json(port, "/stats")["submitted"] == 2 + 4, 30, "the requests to be admitted")
        st = _get_json(port, "/stats")
        assert (st["in_flight"], st["waiting"]) == (2, 2), st
        for c in clients:
            c.close()
        wait_until(
            lambda: _withdrawn(_get_json(port, "/stats")) == (2, 2), 10, "every request to be withdrawn"
        )
        server.send_signal(signal.SIGINT)
        out, err = server.communicate(timeout=60)  # (before: it waited for the held calls)
    finally:
        for c in clients:
            c.close()
        if server.poll() is None:
            server.kill()
            server.communicate()
    assert server.returncode == 0, err
    summary = json.loads(out.strip().splitlines()[-1])["server"]
    assert _withdrawn(summary) == (2, 2)
    assert (summary["waiting"], summary["in_flight"], summary["completed"]) == (0, 0, 2)  # the warm-up
    assert not gate.exists() and "Traceback" not in err, err

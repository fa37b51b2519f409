"""examples/serve.py and examples/serve_load.py, run for real over loopback for a few
seconds: every upload answered correctly, undecodable ones with 400, and the server
stops by itself (``--max-requests``) leaving no process behind.

The examples' handlers, under a real aiohttp and a real uvicorn on 127.0.0.1, with a
Batcher whose ``fn`` fails on purpose: every aioloader error gets its HTTP status
(``Overloaded`` 503 with ``Retry-After``, ``DeadlineExceeded`` and ``LoaderTimeout``
504, any other 500), the upload's own error 400, and no answer carries a traceback."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import aiohttp
import pytest
import uvicorn
from aiohttp import web

import aioloader

from . import _serve_helpers as H
from .conftest import wait_until_async

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def _example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


serve_aiohttp = _example("serve")
serve_fastapi = _example("serve_fastapi")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def _last_json(text: str, key: str) -> dict[str, object]:
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            doc = json.loads(line)
            if key in doc:
                return dict(doc[key])
    raise AssertionError(f"no {key!r} summary in output:\n{text}")


def _serve_under_load(
    script: str, server_args: list[str], load_args: list[str], *, interrupt: bool
) -> tuple[dict[str, object], dict[str, object]]:
    """Start ``examples/<script>`` on a free port, run serve_load.py against it, then
    SIGINT it (``interrupt``) or wait for it to stop by itself. The load's summary and
    the server's, once the server exited cleanly."""
    server = subprocess.Popen(
        [sys.executable, str(EXAMPLES / script), "--port", "0", *server_args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=ROOT,
    )  # fmt: skip
    try:
        assert server.stdout is not None
        first = server.stdout.readline()  # blocks until the server listens (test timeout bounds it)
        assert first.startswith("listening on http://127.0.0.1:"), first + (
            server.stderr.read() if server.stderr else ""
        )
        port = first.strip().rsplit(":", 1)[1]
        load = subprocess.run(
            [sys.executable, str(EXAMPLES / "serve_load.py"), "--port", port, *load_args, "--timeout", "30"],
            capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=90,
        )  # fmt: skip
        assert load.returncode == 0, load.stdout + load.stderr
        if interrupt:
            server.send_signal(2)  # SIGINT: the server stops cleanly and reports
        out, err = server.communicate(timeout=60)
    finally:
        if server.poll() is None:
            server.kill()
            server.communicate()
    assert server.returncode == 0, err
    assert "Traceback" not in err, err
    return _last_json(load.stdout, "load"), _last_json(out, "server")


def test_the_serving_page_shows_the_examples_code() -> None:
    """docs/serving.md shows the examples' error mapping and aiohttp handler: what it
    shows is what the examples run."""
    page = (ROOT / "docs" / "serving.md").read_text()
    blocks = re.findall(r"```\{\.python \.illustration\}\n(.*?)```", page, re.S)
    error_answer = [b for b in blocks if b.startswith("def error_answer(")]
    handler = [b for b in blocks if b.startswith("async def predict(self")]
    assert len(error_answer) == 1 and len(handler) == 1, blocks
    for name in ("serve.py", "serve_fastapi.py"):
        assert error_answer[0] in (EXAMPLES / name).read_text(), name
    assert textwrap.indent(handler[0], "    ") in (EXAMPLES / "serve.py").read_text()


def test_serve_and_load_over_loopback() -> None:
    requests, invalid = 300, 3
    summary, stats = _serve_under_load(
        "serve.py",
        ["--workers", "2", "--batch-size", "8", "--max-latency", "0.005", "--max-requests", str(requests),
         "--duration", "60"],
        ["--requests", str(requests), "--concurrency", "8", "--size", "96", "--invalid", str(invalid)],
        interrupt=False,  # it stops by itself after --max-requests
    )  # fmt: skip
    assert summary["requests"] == requests and summary["wrong"] == []
    assert float(summary["p50_ms"]) > 0 and float(summary["requests_per_s"]) > 0  # type: ignore[arg-type]
    assert stats["answered"] == requests and stats["failed"] == invalid
    assert stats["restarts"] == 0 and stats["overloaded"] == 0
    assert stats["completed"] == requests - invalid + 2  # the two warm-up images
    assert sum(int(k) * v for k, v in stats["batch_sizes"].items()) == requests + 2  # type: ignore[attr-defined]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("script", "stop_args"),
    [("serve.py", ["--max-requests", "1000000", "--duration", "60"]), ("serve_fastapi.py", [])],
)
def test_overload_answers_503_at_once_and_nothing_wrong(script: str, stop_args: list[str]) -> None:
    """Open-loop arrivals far above what one worker decodes, each with a deadline:
    admitted uploads are answered correctly, the rest get 503 with a Retry-After of
    whole seconds (or 504 if one still ran late), counted the same on both sides. The
    load generator counts an answer with a traceback, or a 503 without Retry-After, as
    wrong (and then exits 1)."""
    requests = 200
    summary, stats = _serve_under_load(
        script,
        ["--workers", "1", "--batch-size", "1", "--max-pending", "2", "--deadline-ms", "200", *stop_args],
        ["--requests", str(requests), "--rate", "2000", "--size", "512"],
        interrupt=True,
    )  # fmt: skip
    statuses = summary["statuses"]
    assert isinstance(statuses, dict)
    assert summary["wrong"] == []
    assert statuses.get("503", 0) > 0 and statuses.get("200", 0) > 0
    assert sum(statuses.values()) == requests
    assert stats["overloaded"] == statuses["503"] == stats["rejected"]
    assert stats["answered"] == statuses["200"]
    assert stats.get("late", 0) == statuses.get("504", 0) == stats["expired"]  # a deadline missed: 504
    retry_after = summary["retry_after"]
    assert isinstance(retry_after, dict) and sum(retry_after.values()) == statuses["503"]
    assert all(int(v) >= 1 for v in retry_after), retry_after


def test_fastapi_example_serves_the_load_and_stops_at_sigint() -> None:
    """examples/serve_fastapi.py (uvicorn) answers what serve.py answers, and SIGINT
    stops it cleanly with its summary."""
    requests, invalid = 200, 3
    summary, stats = _serve_under_load(
        "serve_fastapi.py",
        ["--workers", "2", "--batch-size", "8"],
        ["--requests", str(requests), "--concurrency", "8", "--size", "96", "--invalid", str(invalid)],
        interrupt=True,  # uvicorn shuts down, the lifespan closes the Batcher
    )
    assert summary["requests"] == requests and summary["wrong"] == []
    assert stats["answered"] == requests and stats["failed"] == invalid
    assert stats["completed"] == requests - invalid + 2  # the two warm-up images
    assert (stats["waiting"], stats["in_flight"], stats["restarts"]) == (0, 0, 0)


# ------------------------------------------------- the handlers' answers to each error
@asynccontextmanager
async def _example_server(
    kind: str, make: Callable[[], aioloader.Batcher[Any]], deadline: float | None
) -> AsyncIterator[int]:
    """The example app of ``kind`` ("aiohttp": examples/serve.py, "uvicorn":
    examples/serve_fastapi.py) with the Batcher ``make()`` builds, serving on a free port
    of 127.0.0.1 on this loop; yields the port."""
    if kind == "aiohttp":
        async with make() as batcher:
            runner = serve_aiohttp.make_runner(serve_aiohttp.Service(batcher, None, deadline))
            await runner.setup()
            try:
                await web.TCPSite(runner, "127.0.0.1", 0).start()
                yield runner.addresses[0][1]
            finally:
                await runner.cleanup()
        return
    app = serve_fastapi.create_app(make, deadline, warm_up=0, freeze_gc=False)
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    task = asyncio.ensure_future(server.serve())
    try:
        await wait_until_async(lambda: server.started or task.done(), 30, "uvicorn to start")
        assert server.started, task.result()
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 30)


async def _post(port: int, body: bytes) -> tuple[int, Any, str]:
    """POST /predict: the status, the headers and the body's text."""
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with session.post(f"http://127.0.0.1:{port}/predict", data=body) as resp:
            return resp.status, resp.headers, await resp.text()


def _error(answer: tuple[int, Any, str], status: int, starts: str) -> str:
    """The error message of an answer that must have ``status`` and a message starting
    with ``starts``: JSON with one key, one short line, no traceback."""
    got, _, text = answer
    assert got == status, answer
    assert "Traceback" not in text and "DataLoader worker" not in text, text
    message = json.loads(text)["error"]
    assert list(json.loads(text)) == ["error"], text
    assert message.startswith(starts) and "\n" not in message and len(message) <= 200, message
    return str(message)


def _png() -> bytes:
    return bytes(serve_fastapi._warm_image())  # a black 64x64 PNG


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["aiohttp", "uvicorn"])
@pytest.mark.asyncio
async def test_every_error_answers_its_status_and_no_traceback(kind: str, tmp_path: Path) -> None:
    gate = str(tmp_path / "gate")

    # In a worker process: the upload's own errors, a bug, errors that do not travel,
    # a request that kills its worker, one that overruns the Batcher's timeout.
    def with_worker() -> aioloader.Batcher[Any]:
        return aioloader.Batcher(
            H.Misbehaving(gate), batch_size=1, max_latency=0, num_workers=1, max_retries=0, timeout=2.0
        )

    async with _example_server(kind, with_worker, None) as port:
        status, _, text = await _post(port, _png())
        assert status == 200 and json.loads(text)["mean_rgb"] == [0.0, 0.0, 0.0], text
        _error(await _post(port, b"not an image"), 400, "UnidentifiedImageError: cannot identify image file")
        assert _error(await _post(port, b"value"), 400, "ValueError: ") == (
            "ValueError: this upload is not acceptable"  # its first line only
        )
        assert _error(await _post(port, b"bug"), 500, "KeyError: ") == "KeyError: 'a bug in the service'"
        _error(await _post(port, b"unpicklable"), 500, "RemoteError: ")
        crashed = _error(await _post(port, b"die"), 500, "WorkerCrashedError: micro-batch ")
        assert "was lost to a dying worker 1 times (exit code 3); max_retries=0" in crashed, crashed
        _error(await _post(port, b"hang"), 504, "LoaderTimeout: micro-batch ")
        status, _, text = await _post(port, _png())  # the service goes on
        assert status == 200, text

    # A full queue: one request at the (thread) worker, one waiting, max_pending=1.
    made: list[aioloader.Batcher[Any]] = []

    def full_after_one() -> aioloader.Batcher[Any]:
        made.append(
            aioloader.Batcher(H.Misbehaving(gate), batch_size=1, max_latency=0, prefetch=1, max_pending=1)
        )
        return made[-1]

    async with _example_server(kind, full_after_one, None) as port:
        held = asyncio.ensure_future(_post(port, b"hold"))
        await wait_until_async(lambda: bool(made) and made[0].stats().in_flight == 1, 20, "the held request")
        queued = asyncio.ensure_future(_post(port, _png()))
        await wait_until_async(lambda: made[0].stats().waiting == 1, 20, "a request to wait")
        refused = await _post(port, _png())
        _error(refused, 503, "Overloaded: the Batcher already holds max_pending=1")
        retry_after = refused[1].get("Retry-After")
        assert retry_after is not None and retry_after.isdigit() and int(retry_after) >= 1, refused
        open(gate, "w").close()  # let the held request go
        assert [(await held)[0], (await queued)[0]] == [200, 200]

    # A deadline that passes while a worker holds the request.
    os.remove(gate)

    def plain() -> aioloader.Batcher[Any]:
        return aioloader.Batcher(H.Misbehaving(gate), batch_size=1, max_latency=0)

    async with _example_server(kind, plain, 0.3) as port:
        _error(await _post(port, b"hold"), 504, "DeadlineExceeded: ")
        open(gate, "w").close()

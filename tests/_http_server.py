"""A real HTTP server for the fetch tests, run in its own process.

``python -m tests._http_server DIR`` serves the files of ``DIR`` at ``/files/NAME`` on
127.0.0.1, on a port the OS picks, and prints that port as its first line of stdout (the
test reads it: synchronisation by pipe). Behaviour is injected per request or per key:

* ``?latency_ms=N`` (or the header ``X-Latency-Ms``) delays the answer by N ms;
  ``POST /config {"latency_ms": N}`` sets a default for every request.
* ``POST /config {"fail": {"NAME": [500, 429, "reset"]}}``: the first requests for NAME
  answer with those statuses in turn (``"reset"`` aborts the connection instead).
* ``POST /config {"hold": N}``: a request waits until N requests have been in flight at
  once (the peak reached N) before it answers, at most 10 s. A client that keeps N in
  flight proceeds at once; one that cannot shows a lower peak.
* ``GET /stats``: ``{"current", "peak", "counts": {NAME: requests}}``; ``POST /reset``
  clears counters, failures and the configuration, and answers sleeping requests at once.
* A name that is not in DIR is a 404.
"""

from __future__ import annotations

import asyncio
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from aiohttp import web


class State:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.reset()

    def reset(self) -> None:
        old = getattr(self, "woken", None)
        if old is not None:
            old.set()
            self.peak_reached.set()
        self.generation = getattr(self, "generation", 0) + 1
        self.current = 0
        self.peak = 0
        self.counts: Counter[str] = Counter()
        self.fail: defaultdict[str, list[Any]] = defaultdict(list)
        self.latency_ms = 0.0
        self.hold = 0
        self.peak_reached = asyncio.Event()
        self.woken = asyncio.Event()  # set by a reset: sleeping requests answer at once


async def _wait(event: asyncio.Event, seconds: float) -> None:
    try:
        await asyncio.wait_for(event.wait(), seconds)
    except asyncio.TimeoutError:
        pass


def make_app(root: Path) -> web.Application:
    state = State(root)
    app = web.Application()

    async def get_file(request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        generation, woken = state.generation, state.woken
        state.counts[name] += 1
        state.current += 1
        state.peak = max(state.peak, state.current)
        if state.hold and state.peak >= state.hold:
            state.peak_reached.set()
        try:
            latency = float(
                request.query.get("latency_ms") or request.headers.get("X-Latency-Ms") or state.latency_ms
            )
            if state.hold and not state.peak_reached.is_set():
                await _wait(state.peak_reached, 10.0)
            if latency:
                await _wait(woken, latency / 1000)
            plan = state.fail.get(name)
            if plan:
                what = plan.pop(0)
                if what == "reset":
                    assert request.transport is not None
                    request.transport.abort()
                    return web.Response(status=500)  # never reaches the client
                return web.Response(status=int(what), text=f"injected {what}")
            path = state.root / name
            if not path.is_file():
                return web.Response(status=404, text=f"no file {name}")
            return web.Response(body=path.read_bytes())
        finally:
            if state.generation == generation:
                state.current -= 1

    async def stats(request: web.Request) -> web.Response:
        return web.json_response({"current": state.current, "peak": state.peak, "counts": dict(state.counts)})

    async def config(request: web.Request) -> web.Response:
        body = await request.json()
        for name, plan in body.get("fail", {}).items():
            state.fail[name].extend(plan)
        state.latency_ms = float(body.get("latency_ms", state.latency_ms))
        state.hold = int(body.get("hold", state.hold))
        return web.json_response({"ok": True})

    async def reset(request: web.Request) -> web.Response:
        state.reset()
        return web.json_response({"ok": True})

    app.router.add_get("/files/{name}", get_file)
    app.router.add_get("/stats", stats)
    app.router.add_post("/config", config)
    app.router.add_post("/reset", reset)
    return app


async def main(root: Path) -> None:
    runner = web.AppRunner(make_app(root), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, backlog=1024)
    await site.start()
    server: Any = site._server
    port = server.sockets[0].getsockname()[1]
    print(port, flush=True)
    try:
        await asyncio.Event().wait()  # until terminated
    finally:
        await runner.cleanup()


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1])))

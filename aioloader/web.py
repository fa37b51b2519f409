"""Web-server glue: a client that hangs up withdraws its request.

A :class:`~aioloader.Batcher` withdraws a request when the task awaiting ``submit()`` is
cancelled: queued, no worker ever sees it (``cancelled_before_dispatch``); at a worker,
its result is dropped (``cancelled_after_dispatch``). So a server must cancel the
handler of a client that went away. Not every server does:

* **aiohttp** does when asked: ``web.run_app(app, handler_cancellation=True)`` or
  ``web.AppRunner(app, handler_cancellation=True)``. Without the flag the handler runs on.
* **ASGI servers** (uvicorn, hypercorn) and the frameworks on them (Starlette, FastAPI)
  never do. They put an ``http.disconnect`` message on the request's ``receive``
  channel, which nobody reads while the handler awaits its result.
  :class:`CancelOnDisconnect` reads it and cancels the handler.

This module imports no web framework: the middleware speaks plain ASGI.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

__all__ = ["ASGIApp", "CancelOnDisconnect", "Message", "Receive", "Scope", "Send"]

Scope = MutableMapping[str, Any]
"""An ASGI connection scope."""
Message = MutableMapping[str, Any]
"""An ASGI event (received or sent)."""
Receive = Callable[[], Awaitable[Message]]
"""An ASGI ``receive`` callable."""
Send = Callable[[Message], Awaitable[None]]
"""An ASGI ``send`` callable."""
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
"""An ASGI 3 application."""


class CancelOnDisconnect:
    """ASGI middleware: cancels an HTTP request's handler when its client disconnects.

    What aiohttp's ``handler_cancellation=True`` does, for any ASGI server and framework.
    The handler sees :class:`asyncio.CancelledError` at its ``await``: an awaited
    ``batcher.submit()`` withdraws its request. A disconnect after the response is
    complete cancels nothing (Starlette's background tasks run on). Non-HTTP scopes
    (``lifespan``, ``websocket``) pass through untouched.

    With FastAPI or Starlette: ``app.add_middleware(CancelOnDisconnect)``. Around any
    ASGI app: ``app = CancelOnDisconnect(app)``.

    To see a disconnect, the middleware reads the request's ``receive`` channel itself
    and hands the app what it read, one body chunk at a time. While the app has not
    taken a chunk of a body sent in several, a disconnect is seen once it does.

    Args:
        app: the ASGI application to wrap.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await _Exchange(receive, send).run(self.app, scope)


class _Exchange:
    """One HTTP request: the app runs in a task of its own, which a watcher of the
    server's ``receive`` cancels when the client goes before the response is complete."""

    def __init__(self, receive: Receive, send: Send) -> None:
        self._receive = receive
        self._send = send
        self._inbox: asyncio.Queue[Message] = asyncio.Queue()
        self._taken = asyncio.Event()  # the app took the last chunk handed to it
        self._responded = False  # the app sent the last part of its response
        self._withdrawn = False  # the watcher cancelled the app
        self._error: Exception | None = None  # what the server's receive raised
        self._app_task: asyncio.Task[None] | None = None

    async def run(self, app: ASGIApp, scope: Scope) -> None:
        task = asyncio.ensure_future(app(scope, self.receive, self.send))
        self._app_task = task
        watcher = asyncio.ensure_future(self._watch())
        try:
            # asyncio.wait, not await: a cancellation of this task (the server giving up
            # on the request) is raised here, apart from the watcher's own.
            await asyncio.wait({task})
        except asyncio.CancelledError:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            raise
        finally:
            watcher.cancel()
            with contextlib.suppress(BaseException):
                await watcher
        if task.cancelled() and self._withdrawn:
            return  # the client is gone: there is nobody to answer
        task.result()  # the app's own outcome: its exception, or its cancellation

    async def _watch(self) -> None:
        while True:
            try:
                message = await self._receive()
            except Exception as exc:  # the server's receive failed: the app's does too
                self._error = exc
                self._inbox.put_nowait(_FAILED)
                return
            if message["type"] == "http.disconnect":
                if not self._responded and self._app_task is not None:
                    self._withdrawn = True
                    self._app_task.cancel(msg="the client disconnected")
                self._inbox.put_nowait(message)
                return
            self._taken.clear()
            self._inbox.put_nowait(message)
            if message.get("more_body", False):
                # Read no further ahead than the app: a large upload keeps the server's
                # flow control. After the last chunk the next message is the disconnect.
                await self._taken.wait()

    async def receive(self) -> Message:
        message = await self._inbox.get()
        if message is _FAILED or message["type"] == "http.disconnect":
            self._inbox.put_nowait(message)  # every later call sees it too, as from a server
            if self._error is not None:
                raise self._error
        else:
            self._taken.set()
        return message

    async def send(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.pathsend" or (kind in _BODIES and not message.get("more_body", False)):
            self._responded = True  # (before the send: a disconnect it causes is no withdrawal)
        await self._send(message)


_FAILED: Message = {"type": "aioloader.receive_failed"}
# The messages whose last one completes a response (the second an ASGI extension).
_BODIES = ("http.response.body", "http.response.zerocopysend")

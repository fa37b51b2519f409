"""What every loader facade (``DataLoader``, ``StreamLoader``) shares: the open/closed
state, argument checks, context managers, the private event-loop thread for ``for``,
closing a run that lives on some other loop, and pickling what the workers need."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import contextlib
import enum
import pickle
import threading
from collections.abc import Sequence
from typing import Any, Protocol, TypeVar

import numpy as np

from ._portal import Portal
from .errors import DatasetPickleError, LoaderClosedError

__all__ = [
    "ClosedFlag",
    "LifecycleMixin",
    "State",
    "check_int",
    "close_run_from_outside",
    "close_run_soon",
    "pickle_for_workers",
]


class ClosedFlag:
    """The one bit of a loader its runs need. Runs hold this, never the loader, so a
    loader dropped while work is pending on a loop is collected at once (and its
    finalizer shuts everything down)."""

    def __init__(self) -> None:
        self.closed = False

    def is_closed(self) -> bool:
        return self.closed


class State(enum.Enum):
    OPEN = "open"
    CLOSED = "closed"


def check_int(name: str, value: Any, minimum: int) -> int:
    """``value`` as an int >= ``minimum``, or a ValueError naming ``name`` and the value."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


class _Run(Protocol):
    @property
    def loop(self) -> asyncio.AbstractEventLoop: ...

    async def aclose(self) -> None: ...


def close_run_soon(run: _Run) -> None:
    """Ask ``run`` to close on its own loop without waiting (any thread)."""
    loop = run.loop
    if loop.is_closed():
        return
    try:
        if asyncio.get_running_loop() is loop:
            loop.create_task(run.aclose())
            return
    except RuntimeError:
        pass
    if loop.is_running():  # otherwise nobody can run it; the loop's own shutdown will
        with contextlib.suppress(RuntimeError):
            asyncio.run_coroutine_threadsafe(run.aclose(), loop)


def close_run_from_outside(run: _Run, timeout: float = 10.0) -> None:
    """Close ``run`` from plain code, whichever thread and loop it lives on; waits (up to
    ``timeout``) unless called on the run's own loop, which cannot wait for itself."""
    loop = run.loop
    if loop.is_closed():
        return
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        loop.create_task(run.aclose())
        return
    if not loop.is_running():
        return
    try:
        fut = asyncio.run_coroutine_threadsafe(run.aclose(), loop)
    except RuntimeError:
        return
    with contextlib.suppress(cf.TimeoutError, cf.CancelledError, RuntimeError):
        fut.result(timeout)


def pickle_for_workers(whole: object, parts: Sequence[tuple[str, object]], owner: str) -> bytes:
    """Pickle ``whole`` once for the workers; if that fails, find the culprit among
    ``parts`` and raise :class:`DatasetPickleError` naming it and the fix."""
    try:
        return pickle.dumps(whole, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        for name, obj in parts:
            try:
                pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as inner:
                raise DatasetPickleError(
                    f"the {owner}'s {name} ({type(obj).__name__}: {obj!r:.80}) cannot be pickled, so it "
                    f"cannot reach the worker processes: {type(inner).__name__}: {inner}. Define it at "
                    "module level (not a lambda, local function or class defined inside a function), "
                    "drop unpicklable members (open files, locks, sockets) or reopen them lazily, or "
                    "use num_workers=0."
                ) from inner
        raise DatasetPickleError(f"the {owner}'s worker context cannot be pickled: {exc}") from exc


L = TypeVar("L", bound="LifecycleMixin")


class LifecycleMixin:
    """Open/closed state, context managers and the ``for`` loop's private event loop.

    Subclasses set ``_state``, ``_lock`` and ``_portal_box`` in ``__init__`` and define
    ``close()`` and ``aclose()``.
    """

    _state: State
    _lock: threading.RLock
    _portal_box: list[Portal | None]
    _portal_name = "aioloader-portal"

    @property
    def closed(self) -> bool:
        return self._state is State.CLOSED

    def close(self) -> None:
        raise NotImplementedError

    async def aclose(self) -> None:
        raise NotImplementedError

    def _check_open(self) -> None:
        if self._state is State.CLOSED:
            raise LoaderClosedError(
                f"this {type(self).__name__} is closed; create a new one to iterate again"
            )

    def _portal(self) -> Portal:
        with self._lock:
            self._check_open()
            portal = self._portal_box[0]
            if portal is None:
                portal = Portal(name=self._portal_name)
                self._portal_box[0] = portal
            return portal

    def __enter__(self: L) -> L:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self: L) -> L:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

"""Worker side of :class:`~aioloader.Batcher`: one outcome per request.

A Batcher's micro-batch travels as a stream task whose items are ``(request id, item)``
pairs. These wrappers run the user's ``fn`` so that an exception fails only its own
request: it comes back as a :class:`Failed` value in that request's slot, with a note
naming the request, and the other requests of the micro-batch get their results.

This module never imports asyncio.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import add_note as _add_note
from .reply import travelling

__all__ = ["Failed", "PerBatch", "PerItem"]


class Failed:
    """The outcome of a request whose ``fn`` raised."""

    __slots__ = ("exc",)

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def __reduce__(self) -> tuple[Any, ...]:
        # Only pickled when it leaves the process: an exception that cannot travel is
        # then replaced by a RemoteError, exactly as for errors raised by a worker.
        return (Failed, (travelling(self.exc),))


class PerItem:
    """``fn(item)`` per request; an exception becomes that request's :class:`Failed`."""

    def __init__(self, fn: Callable[[Any], Any]) -> None:
        self.fn = fn

    def __call__(self, pair: tuple[int, Any]) -> Any:
        rid, item = pair
        try:
            return self.fn(item)
        except Exception as exc:
            _add_note(exc, f"aioloader: raised by fn(item) for request {rid} in worker pid {os.getpid()}")
            return Failed(exc)


class PerBatch:
    """``fn(items)`` once per micro-batch (``batched_fn=True``): it must return one result
    per item; if it raises, or returns the wrong number, every request of the
    micro-batch fails with that error."""

    def __init__(self, fn: Callable[[list[Any]], Sequence[Any]]) -> None:
        self.fn = fn

    def __call__(self, pairs: list[tuple[int, Any]]) -> list[Any]:
        ids = [rid for rid, _ in pairs]
        try:
            out = list(self.fn([item for _, item in pairs]))
            if len(out) != len(pairs):
                raise ValueError(f"batched fn returned {len(out)} results for {len(pairs)} items")
        except Exception as exc:
            _add_note(exc, f"aioloader: raised by fn(items) for requests {ids} in worker pid {os.getpid()}")
            return [Failed(exc)] * len(pairs)
        return out

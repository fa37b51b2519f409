"""The StreamLoader's unit source: micro-batches assembled from a feed under a deadline.

A micro-batch is handed to the pool when it holds ``batch_size`` items, when
``max_latency`` seconds have passed since its first item was taken into it, or when the
source ends. The batcher runs only while the run holds a window slot for the batch it
assembles, so time spent waiting for a free slot does not count against the deadline:
a slow consumer does not shrink batches.
"""

from __future__ import annotations

import asyncio
from typing import Any

from .. import _stream_worker
from ..errors import add_note as _add_note
from .epochs import WorkerSide
from .feeds import EXHAUSTED, TIMEOUT, Feed

__all__ = ["Batcher", "StreamUnit"]


class StreamUnit:
    """Micro-batch ``key`` of iteration ``group``: source items ``first..first+size-1``."""

    __slots__ = ("_side", "first", "group", "items", "key", "positions", "size")

    fn = staticmethod(_stream_worker.run_stream_batch)

    def __init__(self, side: WorkerSide, iteration: int, seq: int, first: int, items: list[Any]) -> None:
        self._side = side
        self.group = iteration
        self.key = seq
        self.first = first
        self.items = items
        self.size = len(items)
        self.positions: list[int] | None = None  # with fetch=: source positions of the items kept

    @property
    def label(self) -> str:
        return (
            f"micro-batch {self.key} of the stream (source items {self.first}..{self.first + self.size - 1})"
        )

    @property
    def indices(self) -> range:
        return range(self.first, self.first + self.size)

    def make_task(self, task_id: int, with_payload: bool) -> _stream_worker.StreamTask:
        side = self._side
        payload = side.inline if side.inline is not None else side.payload() if with_payload else None
        return _stream_worker.StreamTask(
            side.token, task_id, self.key, self.first, self.items, payload, self.positions
        )

    def fetch_input(self, k: int, position: int) -> Any:
        return self.items[k]

    def set_fetched(self, kept: list[int], values: list[Any]) -> None:
        """The items are fetched: ``kept`` source positions (those not skipped), their values."""
        self.items = values
        self.positions = kept

    def drop_fetched(self) -> None:
        """Called by the fetch stage once the unit's dispatch is over (built, or failed for
        good): no task of it is made again, so the fetched items are not needed."""
        self.items = []


class Batcher:
    """Groups a feed's items into :class:`StreamUnit` objects (see the module docstring)."""

    def __init__(
        self, side: WorkerSide, feed: Feed, iteration: int, batch_size: int, max_latency: float | None
    ) -> None:
        self.side = side
        self.feed = feed
        self.iteration = iteration
        self.batch_size = batch_size
        self.max_latency = max_latency
        self.pulled = 0  # items taken from the source so far
        self.submitted = 0  # micro-batches handed out so far
        self._error: BaseException | None = None  # raised after the batch it interrupted
        self._done = False

    def _source_error(self, exc: BaseException) -> BaseException:
        _add_note(exc, f"aioloader: raised by the stream's source while taking item {self.pulled}")
        return exc

    async def next_unit(self) -> StreamUnit | None:
        if self._error is not None:
            err, self._error = self._error, None
            raise err
        if self._done:
            return None
        feed = self.feed
        feed.open_batch(self.batch_size)
        try:
            first = await feed.get(None)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            raise self._source_error(exc)  # noqa: B904 (re-raises exc itself)
        if first is EXHAUSTED:
            return None
        start = self.pulled
        items = [first]
        self.pulled += 1
        latency = self.max_latency
        deadline = None if latency is None else asyncio.get_running_loop().time() + latency
        while len(items) < self.batch_size:
            try:
                item = await feed.get(deadline)
            except asyncio.CancelledError:
                raise
            except BaseException as exc:
                self._error = self._source_error(exc)
                break
            if item is TIMEOUT:
                break
            if item is EXHAUSTED:
                self._done = True
                break
            items.append(item)
            self.pulled += 1
        seq = self.submitted
        self.submitted += 1
        return StreamUnit(self.side, self.iteration, seq, start, items)

    async def aclose(self) -> None:
        await self.feed.aclose()

"""The StreamLoader's unit source: micro-batches assembled from a feed under a deadline.

A micro-batch is handed to the pool when it holds ``batch_size`` items, when
``max_latency`` seconds have passed since its first item was taken into it, or when the
source ends. The batcher runs only while the run holds a window slot for the batch it
assembles, so time spent waiting for a free slot does not count against the deadline:
a slow consumer does not shrink batches.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from .._worker import stream as _stream
from .._worker.channel import Carried
from ..errors import LoaderTimeout, WorkerCrashedError
from ..errors import add_note as _add_note
from .dispatch import Unsent
from .epochs import WorkerSide
from .feeds import EXHAUSTED, TIMEOUT, Feed
from .isolate import Joined, Rerun

__all__ = ["Batcher", "StreamUnit"]


class StreamUnit:
    """Micro-batch ``key`` of iteration ``group``: source items ``first..first+size-1``.

    Lost to a dying worker or overrunning ``timeout``, it runs again one item a task
    (:mod:`aioloader._engine.isolate`), then once more as one task without the items
    that failed alone (see :meth:`rejoin`)."""

    __slots__ = (
        "_label", "_side", "first", "group", "items", "key", "names_indices", "positions", "size", "skip",
    )  # fmt: skip

    fn = staticmethod(_stream.run_stream_batch)

    def __init__(
        self, side: WorkerSide, iteration: int, seq: int, first: int, items: Sequence[Any], skip: bool = False
    ) -> None:
        self._side = side
        self.group = iteration
        self.key = seq
        self.first = first
        self.items = items
        self.size = len(items)
        self.skip = skip  # on_error="skip": an item that fails alone is skipped, not raised
        self.positions: list[int] | None = None  # with fetch=: source positions of the items kept
        self._label: str | None = None  # a part of a lost micro-batch says what it is
        self.names_indices = False

    @property
    def label(self) -> str:
        if self._label is not None:
            return self._label
        return (
            f"micro-batch {self.key} of the stream (source items {self.first}..{self.first + self.size - 1})"
        )

    @property
    def indices(self) -> Sequence[int]:
        if self._label is not None and self.positions is not None:
            return self.positions
        return range(self.first, self.first + self.size)

    def make_task(self, task_id: int, with_payload: bool) -> _stream.StreamTask:
        side = self._side
        payload = side.inline if side.inline is not None else side.payload() if with_payload else None
        return _stream.StreamTask(
            side.token, task_id, self.key, self.first, self.items, payload, self.positions
        )

    def fetch_input(self, k: int, position: int) -> Any:
        return self.items[k]

    def set_fetched(self, kept: list[int], values: list[Any]) -> None:
        """The items are fetched: ``kept`` source positions (those not skipped), their values
        (their large ``bytes`` travel beside the task's pickle, uncopied)."""
        self.items = Carried(values)
        self.positions = kept

    def drop_fetched(self) -> None:
        """Called by the fetch stage once the unit's dispatch is over (built, or failed for
        good): no task of it is made again, so the fetched items are not needed."""
        self.items = []

    # ------------------------------------------------------------- isolation
    @property
    def divisible(self) -> bool:
        return len(self.items) > 1

    def _where(self) -> Sequence[int]:
        if self.positions is not None:
            return self.positions
        return range(self.first, self.first + len(self.items))

    def _part(self, positions: list[int], items: list[Any], label: str, names_indices: bool) -> StreamUnit:
        part = StreamUnit(self._side, self.group, self.key, positions[0], items, self.skip)
        part.positions, part._label, part.names_indices = positions, label, names_indices
        return part

    def divide(self, why: str) -> list[StreamUnit]:
        """One unit per item, named by its source position."""
        after = f"run alone after {self.label} {why}"
        return [
            self._part([pos], [item], f"stream item {pos} ({after})", True)
            for pos, item in zip(self._where(), self.items, strict=True)
        ]

    def rejoin(self, parts: Sequence[StreamUnit], outcomes: Sequence[Any]) -> Joined | Rerun:
        """The micro-batch is one collated batch, and an item run alone was collated
        alone: so the items that came through run again as one task. An item that
        failed alone raises its error (the first in source order); with
        ``on_error="skip"`` one that killed its worker, overran or did not pickle is
        skipped instead, as an item whose ``fn`` raised."""
        kept: list[tuple[int, Any]] = []
        skipped: list[tuple[int, str]] = []
        for part, out in zip(parts, outcomes, strict=True):
            pos = part.first
            if isinstance(out, Unsent):  # the item does not pickle
                if not self.skip:
                    raise out.exc
                skipped.append((pos, f"{type(out.exc).__name__}: {out.exc} (the item does not pickle)"))
            elif isinstance(out, BaseException):
                if not (self.skip and isinstance(out, (WorkerCrashedError, LoaderTimeout))):
                    raise out
                skipped.append((pos, f"{type(out).__name__}: {out}"))
            elif out.n_items:
                kept.append((pos, part.items[0]))
            else:  # its fn raised, skipped by the worker
                skipped.extend(out.skipped)
        if not kept:
            return Joined(None, tuple(skipped))
        label = self.label
        if skipped:
            label = f"{label} without source items {[p for p, _ in skipped]}"
        again = self._part([p for p, _ in kept], [v for _, v in kept], label, False)
        return Rerun(again, tuple(skipped))


class Batcher:
    """Groups a feed's items into :class:`StreamUnit` objects (see the module docstring)."""

    def __init__(
        self,
        side: WorkerSide,
        feed: Feed,
        iteration: int,
        batch_size: int,
        max_latency: float | None,
        skip: bool = False,
    ) -> None:
        self.side = side
        self.skip = skip  # on_error="skip", for the units' isolation
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
        return StreamUnit(self.side, self.iteration, seq, start, items, self.skip)

    async def aclose(self) -> None:
        await self.feed.aclose()

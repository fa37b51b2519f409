"""Isolation: a lost micro-batch runs again one item a task, a policy on the run.

A micro-batch of the Batcher or the StreamLoader holds independent items: requests, or
items of a stream. When one of them kills its worker (a segfault, ``os._exit``, the OOM
killer), hangs, or cannot be pickled, a plain retry runs it again with the same
companions, and once ``max_retries`` is spent they all fail together. So a micro-batch of more than one item
is never retried whole:

* its first loss (its own worker died holding it, it overran ``timeout``, or its task
  did not pickle) is charged to nobody; each item still wanted then runs alone, in a
  task of its own, all at once; an item that does not pickle alone fails alone, with a
  note naming it (a stream with ``on_error="skip"`` skips it);
* each of those tasks has the whole ``max_retries``: a one-off death of an innocent item
  is still retried, and only an item that keeps killing its worker fails, with
  :class:`~aioloader.WorkerCrashedError` naming it; one that overruns alone fails with
  :class:`~aioloader.LoaderTimeout` naming it;
* the unit then puts the outcomes back together (its ``rejoin``): a Batcher's micro-batch
  answers each request with its own outcome; a stream's must come out as one collated
  batch, so it runs the items that came through once more as one task (see
  :meth:`aioloader._engine.batcher.StreamUnit.rejoin`).

Singles, not halves: the innocent items are answered after one more round instead of
one per halving, and the culprit costs one death more than its retries, not one per
halving (each death is a worker to start again). The parts run inside the micro-batch's
one window slot, so the window still bounds micro-batches; the pool queues the extra
tasks. ``stats().isolated`` counts the micro-batches split this way.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

from .._stats import Recorder
from .dispatch import Dispatcher, Split, Unsent

__all__ = ["Divisible", "IsolateStage", "Joined", "Rerun"]


class Joined(NamedTuple):
    """A unit's outcome put back together from its items run alone."""

    data: Any
    skipped: tuple[tuple[int, str], ...]


class Rerun(NamedTuple):
    """Run ``unit`` (the items that came through) as one task; add ``skipped`` to its result."""

    unit: Any
    skipped: tuple[tuple[int, str], ...]


class Divisible(Protocol):
    """A unit whose items can run one a task (a Batcher's or a stream's micro-batch)."""

    @property
    def divisible(self) -> bool: ...  # more than one item goes to the worker

    def divide(self, why: str) -> Sequence[Any]:
        """One unit per item still wanted, each naming its item and ``why`` it runs alone."""
        ...

    def rejoin(self, parts: Sequence[Any], outcomes: Sequence[Any]) -> Joined | Rerun:
        """The unit's outcome from each part's: its result, or the exception it raised."""
        ...


class IsolateStage:
    """Runs units through the dispatcher, a lost micro-batch one item a task."""

    def __init__(self, dispatcher: Dispatcher, recorder: Recorder) -> None:
        self.dispatcher = dispatcher
        self.recorder = recorder

    async def run(self, unit: Any, make_task: Callable[[int, bool], Any]) -> Any:
        run = self.dispatcher.run
        if not unit.divisible:
            try:
                return await run(unit.fn, make_task, unit, unsent=True)
            except Unsent as unsent:  # one item that does not pickle: the unit says what then
                joined = unit.rejoin([unit], [unsent])
                assert isinstance(joined, Joined)
                return joined
        try:
            return await run(unit.fn, make_task, unit, split=True)
        except Split as split:
            why = split.why
        self.recorder.isolated += 1
        parts = unit.divide(why)
        outcomes = await asyncio.gather(*(self._alone(p) for p in parts))
        joined = unit.rejoin(parts, outcomes)
        if isinstance(joined, Joined):
            return joined
        again = joined.unit
        res = await run(again.fn, again.make_task, again)
        return res._replace(skipped=joined.skipped + tuple(res.skipped)) if joined.skipped else res

    async def _alone(self, part: Any) -> Any:
        """The part's result, or what it raised (the run closing still cancels it); an
        item that does not pickle gives :class:`~aioloader._engine.dispatch.Unsent`."""
        try:
            return await self.dispatcher.run(part.fn, part.make_task, part, unsent=True)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # SystemExit from user code too: the unit decides
            return exc

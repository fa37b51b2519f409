"""What runs inside a worker for a :class:`~aioloader.StreamLoader`: ``fn`` and collate.

The unit of work is one *micro-batch*: the event loop pulls items from the source,
groups them by the size/deadline rule, and sends each group as one
:class:`StreamTask`. The worker applies ``fn`` (item by item, or once on the list with
``batched_fn=True``) and then ``collate_fn``, and returns one :class:`StreamResult`.
Unlike a DataLoader task, a stream task carries its items: they exist only in the
consumer's process.

The stream's ``fn``, ``collate_fn`` and options reach a worker once, as the pickled
payload of a :class:`StreamContext` (the same protocol as a DataLoader's dataset:
installed as an owned worker starts, or sent on demand after
:data:`~aioloader._worker.tasks.NEED_PAYLOAD`). In thread mode the context object itself
rides along with every task, so nothing is pickled.

This module never imports asyncio.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from ..errors import CollateError, add_note
from . import reply as _reply
from . import tasks as _tasks
from . import unpicklable as _unpicklable

__all__ = ["Chain", "StreamContext", "StreamResult", "StreamTask", "run_stream_batch"]


@dataclass
class StreamContext(_tasks.WorkerContext):
    """A stream's worker-side configuration. ``dataset`` is unused (``None``)."""

    fn: Callable[[Any], Any] | None = None
    batched_fn: bool = False


class StreamTask(NamedTuple):
    """One micro-batch on its way to a worker."""

    token: str
    task_id: int
    batch: int  # sequence number of the micro-batch within its iteration
    first: int  # source position of items[0] (items are consecutive in the source)
    items: Sequence[Any]
    payload: bytes | StreamContext | None = None
    positions: Sequence[int] | None = None  # source positions of the items, when not consecutive (fetch=)
    requests: bool = False  # a Batcher's: the items are (request id, item), one outcome each


class StreamResult(NamedTuple):
    data: Any  # the collated batch, or None when every item was skipped
    n_items: int  # items that made it into ``data``
    skipped: tuple[tuple[int, str], ...]  # (source position, "Type: message")
    pid: int
    start_ns: int
    end_ns: int

    def unpicklable(self, task: StreamTask, exc: BaseException, where: str) -> StreamResult | None:
        # see aioloader._worker.culprit.salvage
        if task.requests:
            return _unpicklable.requests(self, task, exc, where)  # type: ignore[no-any-return]
        _unpicklable.stream(self, task, exc, where)
        return None


def run_stream_batch(task: StreamTask) -> StreamResult | str:
    """Apply ``fn`` and ``collate_fn`` to one micro-batch. Runs on any executor.

    Returns :data:`~aioloader._worker.tasks.NEED_PAYLOAD` when this worker has not seen the
    stream yet and the task came without its payload. Exceptions from user code are
    raised with their own type and a note naming the source position of the item.
    """
    return _tasks.run_task(task, _build, StreamResult, StreamContext)


def _where(task: StreamTask) -> str:
    return f"micro-batch {task.batch} of the stream, {_reply.process_label()}"


def _build(ctx: StreamContext, task: StreamTask) -> tuple[Any, int, tuple[tuple[int, str], ...]]:
    items = list(task.items)
    first = task.first
    skipped: list[tuple[int, str]] = []
    fn = ctx.fn
    where = task.positions if task.positions is not None else range(first, first + len(items))
    kept: list[int]
    if fn is None:
        outputs: Any = items
        kept = list(where)
    elif ctx.batched_fn:
        last = first + len(items) - 1
        try:
            outputs = fn(items)
        except BaseException as exc:  # SystemExit too: named, then carried home as a value
            if ctx.on_error == "skip" and isinstance(exc, Exception):
                why = f"{type(exc).__name__}: {exc}"
                return None, 0, tuple((p, why) for p in where)
            add_note(exc, f"aioloader: raised by fn(items) on stream items {first}..{last} in {_where(task)}")
            raise
        kept = list(where)
    else:
        outputs = []
        kept = []
        for k, item in enumerate(items):
            pos = where[k]
            try:
                outputs.append(fn(item))
            except BaseException as exc:
                if ctx.on_error == "skip" and isinstance(exc, Exception):
                    skipped.append((pos, f"{type(exc).__name__}: {exc}"))
                    continue
                add_note(
                    exc,
                    f"aioloader: raised by fn(item) on stream item {pos} (item {k} of {_where(task)})",
                )
                raise
            kept.append(pos)
        if not outputs:
            return None, 0, tuple(skipped)
    try:
        batch = ctx.collate_fn(outputs)
    except Exception as exc:
        named = ""
        if isinstance(exc, CollateError):
            positions = getattr(exc, "positions", [])
            exc.indices = [kept[p] for p in positions if p < len(kept)]  # type: ignore[attr-defined]
            named = f"; the mismatching items are at source positions {exc.indices}"  # type: ignore[attr-defined]
        add_note(
            exc,
            f"aioloader: raised by collate_fn in {_where(task)}, source positions {_span(kept)}{named}",
        )
        raise
    return batch, len(kept), tuple(skipped)


def _span(positions: list[int]) -> str:
    if positions and positions == list(range(positions[0], positions[-1] + 1)) and len(positions) > 3:
        return f"{positions[0]}..{positions[-1]}"
    return str(positions)


class Chain:
    """``fn(transform(item))`` per item, or ``fn([transform(item), ...])`` with
    ``batched``: a stream's ``transform`` in front of its ``fn`` (either may be absent).
    Picklable when both are."""

    def __init__(
        self, transform: Callable[[Any], Any], fn: Callable[[Any], Any] | None, batched: bool
    ) -> None:
        self.transform = transform
        self.fn = fn
        self.batched = batched

    def __call__(self, x: Any) -> Any:
        t = self.transform
        if self.batched:
            return self.fn([t(v) for v in x]) if self.fn is not None else [t(v) for v in x]
        return self.fn(t(x)) if self.fn is not None else t(x)

    def __repr__(self) -> str:
        return f"Chain({self.transform!r}, {self.fn!r})"

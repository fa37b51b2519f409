"""What a worker says when a batch it built will not pickle (see :mod:`aioloader._worker.culprit`).

Each result type's ``unpicklable`` method calls one of these from
:class:`aioloader._worker.reply.Entry`, on that failure path only. They name the batch, the
sample and the field; a group of batches sends back its other batches, with only the
one that failed as an error. This module never imports asyncio.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .._shm._encode import ShmBatch
from ..errors import add_note
from . import culprit as _culprit
from . import reply as _reply
from . import serve as _serve

__all__ = ["batch", "group", "requests", "shard", "stream"]


def _kept(ids: Sequence[int], skipped: Sequence[tuple[int, str]]) -> list[int]:
    """``ids`` less the ones ``on_error="skip"`` left out (each skipped id once)."""
    gone = [i for i, _ in skipped]
    kept = []
    for i in ids:
        if i in gone:
            gone.remove(i)
        else:
            kept.append(i)
    return kept


def _indices(raw: Any) -> list[int]:
    """A task's indices in any of their forms (int64 bytes, an array, a list)."""
    if isinstance(raw, bytes):
        return [int(i) for i in np.frombuffer(raw, dtype=np.int64)]
    return [int(i) for i in raw]


def _explain(exc: BaseException, what: str, data: Any, ids: list[int], id_name: str, where: str) -> None:
    tree = data.tree if isinstance(data, ShmBatch) else data
    unit, makers = ("item", "fn and collate_fn") if id_name == "source position" else ("sample", "")
    note = _culprit.batch_note(what, tree, ids, id_name, where, unit, makers)
    add_note(exc, note or f"aioloader: raised while pickling {what} in {where}")


def batch(result: Any, task: Any, exc: BaseException, where: str) -> None:
    """A DataLoader batch (a ``BatchResult`` of a ``BatchTask``)."""
    ids = _kept(_indices(task.indices), result.skipped)
    _explain(exc, f"batch {task.position} of epoch {task.epoch}", result.data, ids, "sample index", where)


def stream(result: Any, task: Any, exc: BaseException, where: str) -> None:
    """A stream's micro-batch (a ``StreamResult`` of a ``StreamTask``)."""
    first = task.first
    positions = task.positions if task.positions is not None else range(first, first + len(task.items))
    ids = _kept([int(p) for p in positions], result.skipped)
    _explain(exc, f"micro-batch {task.batch} of the stream", result.data, ids, "source position", where)


def requests(result: Any, task: Any, exc: BaseException, where: str) -> Any:
    """A Batcher's micro-batch: each result that will not pickle fails its own request,
    with its own error naming the request; the others go back (``None`` if none fails
    alone)."""
    outcomes = list(result.data) if isinstance(result.data, list) else []
    if len(outcomes) != len(task.items):
        add_note(exc, f"aioloader: raised while pickling micro-batch {task.batch} of a Batcher in {where}")
        return None
    failed = False
    for k, ((rid, _item), out) in enumerate(zip(task.items, outcomes, strict=True)):
        if type(out) is _serve.Failed:
            continue
        try:
            _culprit.result_dumps(out)
        except Exception as own:
            found = _culprit.find(out, _culprit.result_dumps)
            held = ""
            if found is not None:
                steps, part = found
                kind = f"{type(part).__module__}.{type(part).__qualname__}".removeprefix("builtins.")
                path = "".join(s.text for s in steps)
                held = f": result{path} holds a {kind}" if path else f": it is a {kind}"
            add_note(
                own,
                f"aioloader: the result of request {rid} cannot be pickled to travel to the main "
                f"process{held}; in {where}. Make fn return picklable objects, or use num_workers=0",
            )
            outcomes[k] = _serve.Failed(own)
            failed = True
    if not failed:
        add_note(exc, f"aioloader: raised while pickling micro-batch {task.batch} of a Batcher in {where}")
        return None
    return result._replace(data=outcomes)


def group(result: Any, task: Any, exc: BaseException, where: str) -> Any:
    """Several batches in one task: each one that will not pickle becomes its own
    error; the group goes back with the others (``None`` if none fails alone)."""
    outcomes = list(result.outcomes)
    failed = False
    for k, (member, outcome) in enumerate(zip(task.members, outcomes, strict=True)):
        if isinstance(outcome, _reply.Failed):
            continue
        try:
            _culprit.result_dumps(outcome)
        except Exception as own:
            batch(outcome, member, own, where)
            outcomes[k] = _reply.Failed.of(own)
            failed = True
    if not failed:
        add_note(exc, f"aioloader: raised while pickling a group of batches in {where}")
        return None
    return result._replace(outcomes=tuple(outcomes))


def shard(exc: BaseException, task: Any, j: int, first: int, samples: list[Any], data: Any) -> None:
    """Batch ``j`` of an iterable dataset's shard, as the worker sends it (``first``: the
    number of the shard's first sample in it, counted from 0)."""
    what = f"batch {j} of worker {task.shard} in epoch {task.epoch}"
    ids = list(range(first, first + len(samples)))
    _explain(exc, what, data, ids, f"sample {{}} of worker {task.shard}'s iteration", _reply.process_label())

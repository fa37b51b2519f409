"""A Batcher's micro-batch as a unit of the run: requests on their way to a worker.

It travels as a stream task of ``(request id, item)`` pairs. Lost to a dying worker,
overrunning ``timeout`` or not pickling, it divides into one unit per request
(:mod:`aioloader._engine.isolate`), and puts their outcomes back together.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .._worker import stream as _stream
from .dispatch import Unsent
from .epochs import WorkerSide
from .isolate import Joined

if TYPE_CHECKING:
    from .requests import Request

__all__ = ["ServeUnit"]


class ServeUnit:
    """One micro-batch of requests (a stream task of ``(request id, item)`` pairs).

    Lost to a dying worker or overrunning ``timeout``, it runs again one request a task
    (:mod:`aioloader._engine.isolate`); each request then gets its own outcome."""

    __slots__ = ("_alone", "_side", "group", "isolated", "key", "requests", "size")

    fn = staticmethod(_stream.run_stream_batch)
    names_indices = True  # its label names its requests: errors need no "sample indices"

    def __init__(self, side: WorkerSide, seq: int, requests: list[Request], alone: str | None = None) -> None:
        self._side = side
        self.group = 0
        self.key = seq
        self.requests = requests
        self.size = len(requests)
        self._alone = alone  # why this request runs alone (a part of a lost micro-batch)
        self.isolated = False  # its requests ran alone: its time says nothing of the cost

    @property
    def label(self) -> str:
        if self._alone is not None:
            return f"request {self.requests[0].rid} ({self._alone})"
        return f"micro-batch {self.key} (requests {_rids(self.requests)})"

    @property
    def indices(self) -> list[int]:
        return [r.rid for r in self.requests]

    def make_task(self, task_id: int, with_payload: bool) -> _stream.StreamTask:
        side = self._side
        payload = side.inline if side.inline is not None else side.payload() if with_payload else None
        pairs = [(r.rid, r.item) for r in self.requests]
        return _stream.StreamTask(
            side.token, task_id, self.key, self.requests[0].rid, pairs, payload, requests=True
        )

    # ------------------------------------------------------------- isolation
    @property
    def divisible(self) -> bool:
        return self.size > 1

    def divide(self, why: str) -> list[ServeUnit]:
        """One unit per request still waiting for its answer (none for a request that
        was cancelled or expired meanwhile: no worker runs it again)."""
        self.isolated = True
        alone = f"run alone after its micro-batch {self.key}, requests {_rids(self.requests)}, {why}"
        return [ServeUnit(self._side, self.key, [r], alone) for r in self.requests if not r.future.done()]

    def rejoin(self, parts: Sequence[ServeUnit], outcomes: Sequence[Any]) -> Joined:
        """Each request's own outcome: its result, or what its task raised (a
        :class:`~aioloader.WorkerCrashedError`, a :class:`~aioloader.LoaderTimeout`, or
        pickle's error, naming it) as its :class:`~aioloader._worker.serve.Failed`."""
        from .._worker.serve import Failed

        got: dict[int, Any] = {}
        for part, out in zip(parts, outcomes, strict=True):
            if isinstance(out, Unsent):
                out = out.exc
            got[part.requests[0].rid] = Failed(out) if isinstance(out, BaseException) else out.data[0]
        # (a request without a part was answered already: resolve drops its slot)
        return Joined([got.get(r.rid) for r in self.requests], ())


def _rids(requests: list[Request], limit: int = 16) -> str:
    ids = [r.rid for r in requests]
    return str(ids) if len(ids) <= limit else f"{ids[:limit]}... ({len(ids)} requests)"

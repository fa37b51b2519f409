"""The Batcher's cost model: when would a request submitted now be answered?

:class:`~aioloader._engine.requests.RequestQueue` asks it at ``submit()`` (admission by
deadline) and when it cuts a micro-batch (is there still time for one item?). It learns
from three measurements, each a moving average, so it follows a pool that speeds up or
slows down:

- a worker's busy time per item (from each finished micro-batch, through the recorder);
- a micro-batch's time from dispatch to answer;
- the time between answered items while requests were waiting (the pool's drain rate).

A raw estimate is then corrected by what past estimates missed: scaled by the mean of
actual / estimated time (never below 1), plus a high quantile of what the scaled estimates
still missed (stalls of the event loop or of the machine). A request is admitted when the
corrected estimate leaves a fifth of its deadline spare (``HEADROOM``).

Why the spare fifth: every correction learns from answers, so it lags a pool that slows
down after a request was admitted (a shared machine, another process, a collector pass),
and the requests admitted at the edge of their deadlines just before are the ones that
miss together. On this project's 2-core machine the pool's rate moves by 15-30% between
seconds; a request admitted at 80% of its deadline survives a slowdown of 25%. Under
overload the queue stays full either way, so the pool answers as many requests a second;
what the spare costs is only the requests whose answers would have come in the last fifth
of their deadline, refused at once instead.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np

__all__ = ["CostModel"]

# How fast a learnt cost follows a change (the weight of the newest measurement).
_ALPHA = 0.2
# The correction: the mean of actual / estimated time (the weight of the newest answer),
# and a high quantile of what is still missed after scaling by it, over the last answers
# (recomputed every _TAIL_EVERY answers; every 8 for the first 4 * _TAIL_EVERY).
_GAIN = 1 / 8
_TAIL_Q, _TAIL_N, _TAIL_EVERY = 99.9, 2048, 64
# The share of a deadline that admission keeps spare (see the module docstring).
HEADROOM = 0.2


def _ewma(old: float | None, new: float) -> float:
    return new if old is None else (1 - _ALPHA) * old + _ALPHA * new


class CostModel:
    """What a Batcher's pool costs, as measured while it runs (one event loop)."""

    def __init__(self) -> None:
        self.concurrency = 1  # tasks the pool runs at once (set by the Batcher)
        self.item_s: float | None = None  # worker seconds per item (None until measured)
        self.service_s: float | None = None  # dispatch -> answer of a micro-batch
        self.drain_s: float | None = None  # seconds between answered items, pool saturated
        self._last_answer: float | None = None  # the last answer, if requests waited then
        # (otherwise the gap to the next says nothing of the pool)
        self.ratio, self.tail = 1.0, 0.0
        self._misses: deque[float] = deque(maxlen=_TAIL_N)
        self._answers = 0

    def estimate(self, ahead: int) -> float | None:
        """Seconds until a request with ``ahead`` requests before it would be answered, or
        None before anything was measured. The requests ahead leave the queue at the rate
        the pool answers while saturated (before that was measured: the workers' busy time
        per item shared by the workers); then its own micro-batch takes the service time."""
        if self.service_s is None or self.item_s is None:
            return None
        per = self.drain_s if self.drain_s is not None else self.item_s / self.concurrency
        return ahead * per + self.service_s

    def corrected(self, raw: float) -> float:
        """``raw`` as past estimates say it will turn out."""
        return raw * max(1.0, self.ratio) + self.tail

    @staticmethod
    def fits(expected: float, deadline: float) -> bool:
        """Does an answer ``expected`` (corrected) seconds from now leave ``deadline`` its
        spare share?"""
        return expected <= deadline * (1.0 - HEADROOM)

    def observe(self, unit: Any, busy_ns: int) -> None:
        """A micro-batch kept its worker busy ``busy_ns`` (the recorder's ``on_task``)."""
        size = getattr(unit, "size", 0)
        if size:
            self.item_s = _ewma(self.item_s, busy_ns / 1e9 / size)

    def answered(self, size: int, dispatched: float, now: float, waiting: bool) -> None:
        """A micro-batch of ``size`` dispatched at ``dispatched`` was answered at ``now``;
        ``waiting``: requests were still waiting then."""
        self.service_s = _ewma(self.service_s, now - dispatched)
        if self._last_answer is not None:
            self.drain_s = _ewma(self.drain_s, (now - self._last_answer) / size)
        self._last_answer = now if waiting else None

    def calibrate(self, actual: float, estimate: float) -> None:
        """An admitted request was answered ``actual`` seconds after ``submit()``: correct
        later estimates by how far off its own was (loop, pipe and pickling overheads the
        model leaves out, a pool slower than its workers' busy time says)."""
        if estimate <= 0.0:  # (a clock too coarse to time the fastest answers says nothing)
            return
        misses = self._misses
        misses.append(actual - self.ratio * estimate)
        self.ratio += _GAIN * (actual / estimate - self.ratio)
        self._answers += 1
        if self._answers % (_TAIL_EVERY if self._answers > 4 * _TAIL_EVERY else 8) == 0:
            self.tail = max(0.0, float(np.percentile(np.fromiter(misses, np.float64, len(misses)), _TAIL_Q)))

"""Always-on loader statistics: a few integer additions per batch, no locks on the hot path.

Counters are touched by the event loop that runs an epoch; a snapshot may be taken from
any thread at any time (it may be one batch stale, never torn into nonsense).
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from ._trace import Tracer

__all__ = ["EpochStats", "FetchCounters", "LoaderStats", "Recorder", "fmt_ms", "fmt_share"]


def fmt_ms(*seconds: float | None) -> str:
    """Durations in milliseconds joined by `` / ``, ``-`` for an unknown one (for ``__str__``)."""
    return " / ".join("-" if v is None else f"{v * 1e3:.2f}" for v in seconds)


def fmt_share(share: float | None) -> str:
    """A fraction as a whole percentage, ``-`` when unknown (for ``__str__``)."""
    return "-" if share is None else f"{share:.0%}"


def _rate(count: int, seconds: float) -> str:
    return f"{count / seconds:,.1f}" if seconds > 0 else "-"


@dataclass(frozen=True)
class EpochStats:
    """Per-epoch figures."""

    epoch: int
    """The epoch number."""
    batches: int
    """Batches delivered to the consumer in this epoch."""
    stall_s: float
    """Seconds the consumer waited for data in this epoch."""
    first_batch_s: float | None
    """Seconds from the start of iteration to the first batch, or None before it."""


@dataclass(frozen=True)
class LoaderStats:
    """A snapshot of a loader's statistics (``loader.stats()``)."""

    batches: int
    """Batches delivered to the consumer, all epochs."""
    samples: int
    """Samples in those batches."""
    stall_s: float
    """Seconds the consumer spent waiting for a batch, all epochs."""
    epochs: tuple[EpochStats, ...]
    """Per-epoch figures, oldest first (the last 1,000 epochs)."""
    latency_p50_s: float | None
    """Median time from submitting a batch to delivering it (last 10,000 batches)."""
    latency_p99_s: float | None
    """99th percentile of the same."""
    worker_busy: float | None
    """Fraction of worker time spent building batches since the first submit."""
    in_flight: int
    """Batches submitted, running or finished but not yet taken, right now."""
    retries: int
    """Batches resubmitted after a worker died or needed the dataset."""
    restarts: int
    """Workers replaced after a crash or a timeout."""
    skipped: int
    """Samples dropped by ``on_error="skip"``."""
    active_s: float = 0.0
    """Seconds spent iterating: from the start of each epoch to its latest batch, with
    overlapping epochs counted once (the time between epochs is left out)."""
    fetches: int = 0
    """Samples fetched by ``fetch=`` (successful fetches; retries not counted)."""
    fetch_retries: int = 0
    """Fetches retried after a transient failure."""
    fetch_bytes: int = 0
    """Bytes those fetches returned (as weighed against ``io_buffer``)."""
    fetch_peak_in_flight: int = 0
    """The most fetches running at once (at most ``io_concurrency``)."""
    fetch_wait_s: float = 0.0
    """Seconds batches spent waiting for their fetches, summed over batches (batches
    fetched at the same time each count their own wait)."""
    fetch_buffer_peak_bytes: int = 0
    """The most fetched bytes held at once before being handed to workers (bounded by
    ``io_buffer`` plus one batch)."""
    payload_bytes: int = 0
    """Bytes of the pickled worker context (dataset, ``collate_fn``, ...) sent to each worker."""
    shared_bytes: int = 0
    """Bytes of its large arrays that went to the workers through one shared-memory
    segment instead (mapped by every worker, not copied)."""
    payload_s: float = 0.0
    """Seconds the consumer spent pickling the worker context (and writing the segment)."""
    settings: tuple[str, ...] = ()
    """What ``num_workers="auto"`` and ``prefetch="auto"`` chose, and why (one line each)."""
    tasks: int = 0
    """Pool tasks that finished building batches: fewer than the batches built when
    cheap batches go to a worker several at a time (``batches_per_task``)."""
    batches_per_task: int = 1
    """How many batches a pool task holds now (see :attr:`grouping`)."""
    grouping: str = ""
    """What ``batches_per_task`` chose and from what (empty where each batch is a task)."""
    window: int = 0
    """Slots in the window now: where it started (``prefetch``), or what it grew to."""
    window_note: str = ""
    """How the window is sized, where it may grow (empty where it is ``prefetch``)."""
    isolated: int = 0
    """StreamLoader micro-batches lost to a dying worker or overrunning ``timeout`` that
    then ran one item a task, so that only the culprit failed."""

    @property
    def batches_per_s(self) -> float | None:
        """Batches delivered per second of :attr:`active_s` (None before any)."""
        return self.batches / self.active_s if self.active_s > 0 else None

    @property
    def samples_per_s(self) -> float | None:
        """Samples delivered per second of :attr:`active_s` (None before any)."""
        return self.samples / self.active_s if self.active_s > 0 else None

    def __str__(self) -> str:
        """A summary of a few lines for a person (``print(loader.stats())``)."""
        shown = self.epochs[-_FIRSTS_SHOWN:]
        firsts = ", ".join(f"{e.epoch}: {fmt_ms(e.first_batch_s)}" for e in shown) or "-"
        if len(self.epochs) > len(shown):
            firsts += f"  (last {len(shown)} of {len(self.epochs)} epochs)"
        stall = min(1.0, self.stall_s / self.active_s) if self.active_s > 0 else None
        return (
            f"Loader: {self.batches} batches, {self.samples} samples, {len(self.epochs)} epochs, "
            f"{self.active_s:.2f} s iterating; now {self.in_flight} in flight\n"
            f"  throughput: {_rate(self.batches, self.active_s)} batches/s, "
            f"{_rate(self.samples, self.active_s)} samples/s\n"
            f"  consumer stalled: {fmt_share(stall)} of the time ({self.stall_s:.2f} s)\n"
            f"  first batch ms by epoch: {firsts}\n"
            f"  batch latency ms p50/p99: {fmt_ms(self.latency_p50_s, self.latency_p99_s)}\n"
            f"  workers busy: {fmt_share(self.worker_busy)}\n"
            f"  retries {self.retries}, pool restarts {self.restarts}, skipped samples {self.skipped}"
            + (f", micro-batches run one item a task {self.isolated}" if self.isolated else "")
            + "\n"
            f"  dataset to workers: {_mib(self.payload_bytes)} pickled, {_mib(self.shared_bytes)} shared, "
            f"in {self.payload_s * 1000:.0f} ms"
            + self._fetch_line()
            + (f"\n  batches per pool task: {self.grouping}" if self.grouping else "")
            + (f"\n  window: {self.window_note}" if self.window_note else "")
            + "".join(f"\n  {line}" for line in self.settings)
        )

    def _fetch_line(self) -> str:
        if not self.fetches and not self.fetch_retries:
            return ""
        return (
            f"\n  fetches: {self.fetches} ({_mib(self.fetch_bytes)}), {self.fetch_retries} retried, "
            f"peak {self.fetch_peak_in_flight} in flight\n"
            f"  fetched bytes waiting for workers: peak {_mib(self.fetch_buffer_peak_bytes)}; "
            f"batches waited {self.fetch_wait_s:.2f} s on fetches"
        )

    def __repr__(self) -> str:
        # up to 1,000 epochs: show the first and the last, count the rest
        eps = [repr(e) for e in self.epochs]
        if len(eps) > 3:
            eps = [eps[0], f"<{len(eps) - 2} more>", eps[-1]]
        body = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self) if f.name != "epochs")
        return f"LoaderStats({body}, epochs=({', '.join(eps)}))"


_FIRSTS_SHOWN = 5


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 1024:.0f} KiB"


@dataclass
class _Epoch:
    epoch: int
    started_ns: int
    batches: int = 0
    stall_ns: int = 0
    first_ns: int | None = None
    last_ns: int | None = None


class FetchCounters:
    """The fetch stage's figures (see :class:`LoaderStats`), kept by the stage itself."""

    __slots__ = ("buffer_peak", "bytes", "done", "peak", "retries", "wait_ns")

    def __init__(self) -> None:
        self.done = self.retries = self.bytes = self.peak = self.wait_ns = self.buffer_peak = 0


@dataclass
class Recorder:
    """Mutable counters behind :class:`LoaderStats`."""

    batches: int = 0
    samples: int = 0
    stall_ns: int = 0
    retries: int = 0
    skipped: int = 0
    isolated: int = 0
    in_flight: int = 0
    busy_ns: int = 0
    payload_bytes: int = 0
    shared_bytes: int = 0
    payload_ns: int = 0
    first_submit_ns: int | None = None
    workers_seen: set[int] = field(default_factory=set)
    latencies: deque[int] = field(default_factory=lambda: deque(maxlen=10_000))
    epochs: deque[_Epoch] = field(default_factory=lambda: deque(maxlen=1_000))
    tracer: Tracer | None = None
    fetch: FetchCounters = field(default_factory=lambda: FetchCounters())
    settings: tuple[str, ...] = ()
    tasks: int = 0
    group: Any = None  # the grouping policy (aioloader._engine.group.GroupPolicy), if any
    # A unit source that learns what its units cost (the Batcher's admission control):
    # called with each finished task's unit and the worker time it took, in ns.
    on_task: Callable[[Any, int], None] | None = None
    prefetch: int = 0  # the window a run starts with

    def epoch_started(self, epoch: int) -> _Epoch:
        rec = _Epoch(epoch, time.monotonic_ns())
        self.epochs.append(rec)
        return rec

    def submitted(self, now: int) -> None:
        self.in_flight += 1
        if self.first_submit_ns is None:
            self.first_submit_ns = now

    def finished(
        self, pid: int, start_ns: int, end_ns: int, submit_ns: int, now: int, named: Any = None
    ) -> None:
        """One task done; ``named.label`` (read only when tracing) names it."""
        self.busy_ns += end_ns - start_ns
        self.tasks += 1
        if self.group is not None:  # the grouping policy learns what batches cost
            self.group.observe(getattr(named, "batches", 1), end_ns - start_ns)
        if self.on_task is not None:
            self.on_task(named, end_ns - start_ns)
        self.workers_seen.add(pid)
        self.latencies.append(now - submit_ns)
        if self.tracer is not None:
            label = getattr(named, "label", None) or "task"
            self.tracer.span(label, pid, "batches", start_ns, end_ns, {"latency_ms": (now - submit_ns) / 1e6})

    def released(self) -> None:
        self.in_flight -= 1

    def delivered(self, ep: _Epoch, n_samples: int, waited_ns: int, now: int) -> None:
        self.batches += 1
        self.samples += n_samples
        self.stall_ns += waited_ns
        ep.batches += 1
        ep.stall_ns += waited_ns
        if ep.first_ns is None:
            ep.first_ns = now - ep.started_ns
        ep.last_ns = now
        if self.tracer is not None:
            self.tracer.span(f"wait (epoch {ep.epoch})", os.getpid(), "consumer", now - waited_ns, now)

    def _fetch_figures(self) -> dict[str, Any]:
        return _fetch_figures_of(self.fetch)

    def snapshot(self, restarts: int, concurrency: int) -> LoaderStats:
        lat = np.fromiter(list(self.latencies), dtype=np.int64)
        p50 = p99 = None
        if len(lat):
            p50 = float(np.percentile(lat, 50)) / 1e9
            p99 = float(np.percentile(lat, 99)) / 1e9
        busy = None
        if self.first_submit_ns is not None:
            span = (time.monotonic_ns() - self.first_submit_ns) * max(concurrency, 1)
            busy = min(1.0, self.busy_ns / span) if span > 0 else None
        epochs = tuple(
            EpochStats(e.epoch, e.batches, e.stall_ns / 1e9, None if e.first_ns is None else e.first_ns / 1e9)
            for e in list(self.epochs)
        )
        return LoaderStats(
            active_s=_active_ns(list(self.epochs)) / 1e9,
            batches=self.batches,
            samples=self.samples,
            stall_s=self.stall_ns / 1e9,
            epochs=epochs,
            latency_p50_s=p50,
            latency_p99_s=p99,
            worker_busy=busy,
            in_flight=self.in_flight,
            retries=self.retries,
            restarts=restarts,
            skipped=self.skipped,
            payload_bytes=self.payload_bytes,
            shared_bytes=self.shared_bytes,
            payload_s=self.payload_ns / 1e9,
            settings=self.settings,
            tasks=self.tasks,
            batches_per_task=self.group.size if self.group is not None else 1,
            grouping=self.group.describe() if self.group is not None else "",
            window=self.group.window if self.group is not None else self.prefetch,
            window_note=self.group.describe_window() if self.group is not None else "",
            isolated=self.isolated,
            **self._fetch_figures(),
        )


def _fetch_figures_of(f: FetchCounters) -> dict[str, Any]:
    return {
        "fetches": f.done, "fetch_retries": f.retries, "fetch_bytes": f.bytes, "fetch_peak_in_flight": f.peak,
        "fetch_wait_s": f.wait_ns / 1e9, "fetch_buffer_peak_bytes": f.buffer_peak,
    }  # fmt: skip


def _active_ns(epochs: list[_Epoch]) -> int:
    # the union of the epochs' [start, latest batch] intervals (with prefetch_next_epoch
    # an epoch starts before the one before it has ended)
    total, reach = 0, 0
    for e in sorted(epochs, key=lambda e: e.started_ns):
        if e.last_ns is None:
            continue
        start = max(e.started_ns, reach)
        if e.last_ns > start:
            total += e.last_ns - start
            reach = e.last_ns
    return total

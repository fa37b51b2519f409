"""Latency benchmark for StreamLoader (issue 6's targets).

    python examples/benchmarks/bench_stream_latency.py                 # both scenarios, ~10 s
    python examples/benchmarks/bench_stream_latency.py --seconds 10 --workers 2 --mode sync

A source produces items at a steady rate (default 500 items/s, one every 2 ms, on an
absolute schedule) and each item costs ``fn`` a fixed busy-wait (default 1 ms) in a
worker process. Every item carries the time it was produced; ``fn`` records when it
started and ended (CLOCK_MONOTONIC, shared by all processes on Linux); the consumer
records when the batch reached it.

Scenario "added" (``batch_size=1``): the latency aioloader adds over ``fn`` itself,
``delivered - produced - fn duration`` per item. Targets: p50 < 2 ms, p99 < 10 ms.

Scenario "deadline" (``batch_size=32, max_latency=10 ms``; at 500 items/s about 5
items arrive per deadline, so every batch is flushed by the deadline): how late the
flush is, ``first fn start of the batch - (first item produced + max_latency)``. This
includes handing the batch to a worker, so it is an upper bound on the batcher's own
lateness. Target: p99 < 2 ms. End-to-end latency per item is reported as well.

The first ``--warmup`` seconds (worker start-up) are not measured.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np

from aioloader.stream import StreamLoader


def work(item: tuple[int, int, float]) -> tuple[int, int, int, int]:
    """Busy-wait ``item[2]`` seconds; return (seq, produced_ns, start_ns, end_ns)."""
    seq, produced, seconds = item
    start = time.monotonic_ns()
    end = start + int(seconds * 1e9)
    while time.monotonic_ns() < end:
        pass
    return seq, produced, start, time.monotonic_ns()


async def steady(rate: float, seconds: float, fn_s: float) -> AsyncIterator[tuple[int, int, float]]:
    """Items at ``rate`` per second for ``seconds``, on an absolute schedule."""
    loop = asyncio.get_running_loop()
    period = 1.0 / rate
    t0 = loop.time()
    n = int(rate * seconds)
    for seq in range(n):
        delay = t0 + seq * period - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        yield seq, time.monotonic_ns(), fn_s


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


def analyse(batches: list[tuple[np.ndarray, int]], warm_ns: int, max_latency: float | None) -> dict[str, Any]:
    added: list[float] = []
    total: list[float] = []
    late: list[float] = []
    sizes: list[int] = []
    for arr, delivered in batches:
        seq, produced, start, end = arr[:, 0], arr[:, 1], arr[:, 2], arr[:, 3]
        if produced[0] < warm_ns:
            continue
        sizes.append(len(seq))
        total.extend(((delivered - produced) / 1e6).tolist())
        added.extend(((delivered - produced - (end - start)) / 1e6).tolist())
        if max_latency is not None:
            late.append((start[0] - (produced[0] + max_latency * 1e9)) / 1e6)
    out: dict[str, Any] = {
        "items": len(total),
        "mean_batch": round(float(np.mean(sizes)), 2) if sizes else None,
        "end_to_end_ms": {"p50": round(pct(total, 50), 3), "p99": round(pct(total, 99), 3)},
        "added_ms": {"p50": round(pct(added, 50), 3), "p99": round(pct(added, 99), 3)},
    }
    if max_latency is not None:
        out["flush_late_ms"] = {
            "p50": round(pct(late, 50), 3),
            "p99": round(pct(late, 99), 3),
            "max": round(max(late), 3) if late else None,
        }
    return out


async def consume(stream: StreamLoader) -> list[tuple[np.ndarray, int]]:
    out = []
    async for batch in stream:
        out.append((np.stack(batch, axis=1), time.monotonic_ns()))
    return out


def run_scenario(args: argparse.Namespace, batch_size: int, max_latency: float | None) -> dict[str, Any]:
    warm_ns = time.monotonic_ns() + int(args.warmup * 1e9)
    source = steady(args.rate, args.seconds + args.warmup, args.fn_ms / 1e3)
    stream = StreamLoader(
        source, work, batch_size=batch_size, max_latency=max_latency, num_workers=args.workers, ordered=True
    )
    with stream:
        if args.mode == "async":
            batches = _run_loop(args.loop, consume(stream))
        else:
            batches = []
            for batch in stream:
                batches.append((np.stack(batch, axis=1), time.monotonic_ns()))
    return analyse(batches, warm_ns, max_latency)


def _run_loop(kind: str, coro: Any) -> Any:
    if kind == "uvloop":
        import uvloop

        return uvloop.run(coro)
    return asyncio.run(coro)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="StreamLoader latency at a steady input rate.")
    ap.add_argument("--rate", type=float, default=500.0, help="items per second")
    ap.add_argument("--fn-ms", type=float, default=1.0, help="busy work per item in fn, ms")
    ap.add_argument("--seconds", type=float, default=4.0, help="measured seconds per scenario")
    ap.add_argument("--warmup", type=float, default=0.5, help="unmeasured seconds at the start")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=32, help="for the deadline scenario")
    ap.add_argument("--max-latency-ms", type=float, default=10.0, help="for the deadline scenario")
    ap.add_argument("--mode", choices=["async", "sync"], default="async", help="async for, or for")
    ap.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop", help="loop for --mode async")
    ap.add_argument("--scenario", choices=["both", "added", "deadline"], default="both")
    args = ap.parse_args(argv)

    results: dict[str, Any] = {
        "rate": args.rate,
        "fn_ms": args.fn_ms,
        "workers": args.workers,
        "mode": args.mode,
        "loop": args.loop if args.mode == "async" else "portal (uvloop)",
    }
    verdicts = []
    if args.scenario in ("both", "added"):
        r = run_scenario(args, 1, None)
        results["added"] = r
        ok = r["added_ms"]["p50"] < 2 and r["added_ms"]["p99"] < 10
        verdicts.append(("added latency p50 < 2 ms and p99 < 10 ms", ok))
        print(
            f"added   (batch_size=1): {r['items']} items; aioloader adds p50 {r['added_ms']['p50']} ms, "
            f"p99 {r['added_ms']['p99']} ms over fn; end to end p50 {r['end_to_end_ms']['p50']} ms, "
            f"p99 {r['end_to_end_ms']['p99']} ms"
        )
    if args.scenario in ("both", "deadline"):
        ml = args.max_latency_ms / 1e3
        r = run_scenario(args, args.batch_size, ml)
        results["deadline"] = r
        ok = r["flush_late_ms"]["p99"] < 2
        verdicts.append((f"max_latency={args.max_latency_ms} ms honoured within 2 ms at p99", ok))
        print(
            f"deadline (batch_size={args.batch_size}, max_latency={args.max_latency_ms} ms): {r['items']} items, "
            f"mean batch {r['mean_batch']}; flush late by p50 {r['flush_late_ms']['p50']} ms, "
            f"p99 {r['flush_late_ms']['p99']} ms, max {r['flush_late_ms']['max']} ms; end to end p50 "
            f"{r['end_to_end_ms']['p50']} ms, p99 {r['end_to_end_ms']['p99']} ms"
        )
    for text, ok in verdicts:
        print(f"  [{'PASS' if ok else 'MISS'}] {text}")
    results["targets_met"] = all(ok for _, ok in verdicts)
    print(json.dumps(results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

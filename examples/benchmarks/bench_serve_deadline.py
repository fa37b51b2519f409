"""Serving under overload, with and without a deadline: does what is admitted finish in time?

The load of issue 52: a Batcher with ``batch_size=16``, ``max_latency=0.005`` and 2
worker processes; ``fn`` burns 5 ms of CPU; 200 closed-loop clients each submit one
request at a time and back off 50 ms after ``Overloaded``. Run once with
``deadline=0.1`` per request and once without. Reported:

- goodput: answers per second that came in time (all answers, without a deadline);
- the share of admitted requests that ended late (``DeadlineExceeded``);
- how long ``submit()`` took to raise ``Overloaded`` (median, p99).

    python examples/benchmarks/bench_serve_deadline.py --seconds 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

from aioloader import Batcher, DeadlineExceeded, Overloaded


def burn(x: int) -> int:
    """About 5 ms of CPU."""
    end = time.process_time() + 0.005
    while time.process_time() < end:
        pass
    return x


async def run(deadline: float | None, seconds: float, clients: int) -> dict[str, Any]:
    answered = late = rejected = 0
    refusals: list[float] = []
    stop = time.monotonic() + seconds
    async with Batcher(burn, batch_size=16, max_latency=0.005, num_workers=2) as b:
        await b.submit_many(range(64))  # workers up, costs measured

        async def client(k: int) -> None:
            nonlocal answered, late, rejected
            while time.monotonic() < stop:
                t0 = time.perf_counter()
                try:
                    await b.submit(k, deadline=deadline)
                except Overloaded:
                    refusals.append(time.perf_counter() - t0)
                    rejected += 1
                    await asyncio.sleep(0.05)
                    continue
                except DeadlineExceeded:
                    late += 1
                    continue
                answered += 1

        t = time.monotonic()
        await asyncio.gather(*(client(k) for k in range(clients)))
        wall = time.monotonic() - t
        stats = b.stats()
    refusals.sort()
    return {
        "deadline_s": deadline,
        "goodput_per_s": answered / wall,
        "admitted": answered + late,
        "late_share": late / max(1, answered + late),
        "rejected": rejected,
        "overloaded_ms_p50": statistics.median(refusals) * 1e3 if refusals else None,
        "overloaded_ms_p99": refusals[int(0.99 * (len(refusals) - 1))] * 1e3 if refusals else None,
        "batch_sizes": dict(sorted(stats.batch_sizes.items())),
        "cut_for_deadline": stats.cut_for_deadline,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--clients", type=int, default=200)
    ap.add_argument("--json")
    args = ap.parse_args()
    free = asyncio.run(run(None, args.seconds, args.clients))
    held = asyncio.run(run(0.1, args.seconds, args.clients))
    out = {"no_deadline": free, "deadline": held, "goodput_ratio": held["goodput_per_s"] / free["goodput_per_s"]}
    print(json.dumps(out, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()

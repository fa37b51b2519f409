"""Serving: aioloader's Batcher against the two ways people do it by hand, one run.

Requests of one JPEG each (decode + resize to 64x64), 2 worker processes, open-loop
arrivals (a request arrives on schedule whatever the earlier ones are doing) at rising
rates. Latency is measured from a request's scheduled arrival to its answer.

Contenders:

- ``batcher``: ``aioloader.Batcher(preprocess, batch_size=16, max_latency=0.002,
  num_workers=2)``, one ``await batcher.submit(jpeg)`` per request;
- ``naive``: ``await loop.run_in_executor(ProcessPoolExecutor(2), preprocess, jpeg)`` per
  request (one pickled task and one future per request);
- ``stream``: torch-style hand routing, the old ``examples/serve.py``: requests go into an
  ``asyncio.Queue`` with an id, a ``StreamLoader`` micro-batches them, a task resolves each
  request's future from its batch.

Also measured: the Batcher's added latency at low load (one request at a time) over ``fn``
itself, and behaviour under 2x overload with ``max_pending`` and a 50 ms deadline.

    python examples/benchmarks/bench_serve.py --json serve.json --png docs/serving.png
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures as cf
import io
import itertools
import json
import multiprocessing
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
from PIL import Image

import aioloader
from aioloader.stream import StreamLoader

SIZE = 64


def preprocess(body: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(body)) as im:
        rgb = im.convert("RGB").resize((SIZE, SIZE), Image.Resampling.BILINEAR)
    return np.asarray(rgb, dtype=np.uint8)


def routed(item: tuple[int, bytes]) -> tuple[int, np.ndarray]:
    return item[0], preprocess(item[1])


def pairs(items: list[tuple[int, np.ndarray]]) -> list[tuple[int, np.ndarray]]:
    return items


def make_jpegs(n: int, side: int) -> list[bytes]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        base = rng.integers(0, 256, (side // 8, side // 8, 3), dtype=np.uint8)
        img = Image.fromarray(base).resize((side, side), Image.Resampling.BILINEAR)
        buf = io.BytesIO()
        img.save(buf, format="JPEG", quality=90)
        out.append(buf.getvalue())
    return out


# ------------------------------------------------------------------ contenders
class Contender:
    name = ""

    async def start(self) -> None: ...

    async def call(self, body: bytes) -> Any:
        raise NotImplementedError

    async def stop(self) -> None: ...


class BatcherContender(Contender):
    name = "batcher"

    def __init__(self, workers: int, **kw: Any) -> None:
        self.batcher: aioloader.Batcher[np.ndarray] = aioloader.Batcher(
            preprocess, batch_size=16, max_latency=0.002, num_workers=workers, **kw
        )

    async def start(self) -> None:
        await self.batcher.__aenter__()

    async def call(self, body: bytes, **kw: Any) -> Any:
        return await self.batcher.submit(body, **kw)

    async def stop(self) -> None:
        await self.batcher.aclose()


class NaiveContender(Contender):
    name = "naive"

    def __init__(self, workers: int) -> None:
        # The same start method as aioloader's workers, so only the dispatch differs.
        self.pool = cf.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("forkserver"))

    async def call(self, body: bytes) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.pool, preprocess, body)

    async def stop(self) -> None:
        self.pool.shutdown()


class StreamContender(Contender):
    name = "stream"

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self.ids = itertools.count()
        self.futures: dict[int, asyncio.Future[Any]] = {}

    async def start(self) -> None:
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.stream = StreamLoader(
            self.queue, routed, batch_size=16, max_latency=0.002, num_workers=self.workers, collate_fn=pairs
        )
        self.task = asyncio.ensure_future(self._route())

    async def _route(self) -> None:
        async for batch in self.stream:
            for rid, arr in batch:
                fut = self.futures.pop(rid)
                if not fut.done():
                    fut.set_result(arr)

    async def call(self, body: bytes) -> Any:
        rid = next(self.ids)
        fut = self.futures[rid] = asyncio.get_running_loop().create_future()
        self.queue.put_nowait((rid, body))
        return await fut

    async def stop(self) -> None:
        self.queue.put_nowait(aioloader.stream.END)
        await self.task
        await self.stream.aclose()


MAKERS: dict[str, Callable[[int], Contender]] = {
    "batcher": BatcherContender,
    "naive": NaiveContender,
    "stream": StreamContender,
}


# ---------------------------------------------------------------- measurements
async def open_loop(call: Callable[[bytes], Awaitable[Any]], jpegs: list[bytes], rate: float, n: int) -> dict[str, Any]:
    clock = time.perf_counter  # (uvloop's loop.time() ticks in whole milliseconds)
    lat: list[float] = []
    errors = 0

    async def one(body: bytes, due: float) -> None:
        nonlocal errors
        try:
            await call(body)
        except Exception:
            errors += 1
            return
        lat.append(clock() - due)

    t0 = clock()
    tasks = []
    for k in range(n):
        due = t0 + k / rate
        delay = due - clock()
        if delay > 0:
            await asyncio.sleep(delay)  # the arrival schedule itself
        tasks.append(asyncio.ensure_future(one(jpegs[k % len(jpegs)], due)))
    await asyncio.gather(*tasks)
    a = np.array(lat) * 1e3
    return {
        "rate": rate,
        "p50_ms": float(np.percentile(a, 50)) if len(a) else None,
        "p99_ms": float(np.percentile(a, 99)) if len(a) else None,
        "errors": errors,
    }


async def warm(c: Contender, jpegs: list[bytes]) -> None:
    await asyncio.gather(*(c.call(j) for j in jpegs[:32]))


async def sweep(name: str, workers: int, jpegs: list[bytes], rates: list[float], seconds: float) -> list[dict[str, Any]]:
    c = MAKERS[name](workers)
    await c.start()
    try:
        await warm(c, jpegs)
        rows = []
        for rate in rates:
            rows.append(await open_loop(c.call, jpegs, rate, max(50, int(rate * seconds))))
        return rows
    finally:
        await c.stop()


async def low_load(workers: int, jpegs: list[bytes], n: int) -> dict[str, float]:
    fn_times = []
    for body in jpegs[:n]:
        t = time.perf_counter()
        preprocess(body)
        fn_times.append(time.perf_counter() - t)
    c = BatcherContender(workers, max_pending=1024)
    await c.start()
    try:
        await warm(c, jpegs)
        times = []
        for body in jpegs[:n]:
            t = time.perf_counter()
            await c.call(body)
            times.append(time.perf_counter() - t)
    finally:
        await c.stop()
    fn_ms, total_ms = statistics.median(fn_times) * 1e3, statistics.median(times) * 1e3
    return {"fn_p50_ms": fn_ms, "batcher_p50_ms": total_ms, "added_p50_ms": total_ms - fn_ms}


async def overload(workers: int, jpegs: list[bytes], rate: float, seconds: float) -> dict[str, Any]:
    c = BatcherContender(workers, max_pending=32)
    await c.start()
    clock = time.perf_counter
    admitted: list[float] = []
    rejected: list[float] = []
    expired = 0
    try:
        await warm(c, jpegs)

        async def one(body: bytes, due: float) -> None:
            nonlocal expired
            t = clock()
            try:
                await c.call(body, deadline=0.05)
            except aioloader.Overloaded:
                rejected.append(clock() - t)
                return
            except aioloader.DeadlineExceeded:
                expired += 1
                return
            admitted.append(clock() - due)

        t0 = clock()
        n = int(rate * seconds)
        tasks = []
        for k in range(n):
            due = t0 + k / rate
            if due > clock():
                await asyncio.sleep(due - clock())
            tasks.append(asyncio.ensure_future(one(jpegs[k % len(jpegs)], due)))
        await asyncio.gather(*tasks)
        st = c.batcher.stats()
    finally:
        await c.stop()
    return {
        "rate": rate,
        "admitted": len(admitted),
        "rejected": len(rejected),
        "expired": expired,
        "admitted_p99_ms": float(np.percentile(np.array(admitted) * 1e3, 99)) if admitted else None,
        "rejected_max_ms": max(rejected) * 1e3 if rejected else None,
        "worker_items": sum(k * v for k, v in st.batch_sizes.items()),
    }


def best_rate(rows: list[dict[str, Any]], limit_ms: float = 50.0) -> float:
    ok = [r["rate"] for r in rows if r["p99_ms"] is not None and r["p99_ms"] < limit_ms and not r["errors"]]
    return max(ok, default=0.0)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    jpegs = make_jpegs(64, args.side)
    rates = [float(r) for r in args.rates.split(",")]
    out: dict[str, Any] = {"rates": rates, "side": args.side, "workers": args.workers, "sweeps": {}}
    for name in ("batcher", "naive", "stream"):
        out["sweeps"][name] = await sweep(name, args.workers, jpegs, rates, args.seconds)
        print(name, [(r["rate"], round(r["p99_ms"] or -1, 1)) for r in out["sweeps"][name]], flush=True)
    out["best_rate"] = {k: best_rate(v) for k, v in out["sweeps"].items()}
    out["low_load"] = await low_load(args.workers, jpegs, 200)
    top = out["best_rate"]["batcher"] or rates[-1]
    out["overload"] = await overload(args.workers, jpegs, 2 * top, args.seconds)
    return out


def chart(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, rows in result["sweeps"].items():
        ax.plot([r["rate"] for r in rows], [r["p99_ms"] for r in rows], marker="o", label=name)
    ax.axhline(50, color="grey", linestyle="--", linewidth=1)
    ax.set_yscale("log")
    ax.set_xlabel("offered load, requests/s (open loop)")
    ax.set_ylabel("p99 latency, ms (log)")
    ax.set_title(f"One JPEG per request, decode + resize, {result['workers']} workers")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--side", type=int, default=256, help="side of the request JPEGs, pixels")
    ap.add_argument("--rates", default="100,200,400,600,800,1000,1200,1400,1600")
    ap.add_argument("--seconds", type=float, default=2.0, help="seconds of arrivals per rate")
    ap.add_argument("--json")
    ap.add_argument("--png")
    args = ap.parse_args(argv)
    import uvloop

    result = uvloop.run(main_async(args))
    b, n = result["best_rate"]["batcher"], result["best_rate"]["naive"]
    result["batcher_vs_naive"] = b / n if n else None
    print(json.dumps({k: v for k, v in result.items() if k != "sweeps"}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.png:
        chart(result, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())

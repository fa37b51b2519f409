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

The offered rates climb from 100 req/s by 200 up to twice the compute bound (what the
workers do running ``fn`` back to back), measured before the sweeps; a contender stops
climbing after two rates in a row past its knee (p99 over 50 ms, or an error), and a
knee at the top of the ladder is reported as capped. A rate's median counts the
repetitions that had stopped before it as infinitely slow.

Also measured: the added latency at low load (one request at a time) over ``fn`` itself as
timed in the worker, for the Batcher and the naive way; and the Batcher under 2x overload
with a 50 ms deadline per request (admission by the estimated answer time), each refusal
over 1 ms put down to its cause (see ``Stretches``).

    python examples/benchmarks/bench_serve.py --repeat 3 --gc-freeze --json serve.json --png docs/serving.png
    python examples/benchmarks/bench_serve.py --overload-only 6400 --repeat 20 --gc-freeze --json ovl.json
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures as cf
import gc
import io
import itertools
import json
import math
import multiprocessing
import resource
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
DEADLINE_S = 0.05  # the overload run's per-request deadline


def preprocess(body: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(body)) as im:
        rgb = im.convert("RGB").resize((SIZE, SIZE), Image.Resampling.BILINEAR)
    return np.asarray(rgb, dtype=np.uint8)


def timed_preprocess(body: bytes) -> tuple[np.ndarray, float]:
    """``preprocess`` and the seconds it took, measured where it ran (a worker)."""
    t = time.perf_counter()
    out = preprocess(body)
    return out, time.perf_counter() - t


def fn_loop(side: int, seconds: float) -> int:
    """How many requests' ``preprocess`` one process gets through in ``seconds``, back
    to back, with nothing dispatched to it (for the compute bound)."""
    jpegs = make_jpegs(64, side)
    preprocess(jpegs[0])
    n, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        preprocess(jpegs[n % len(jpegs)])
        n += 1
    return n


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

    def __init__(self, workers: int, fn: Callable[[bytes], Any] = preprocess, **kw: Any) -> None:
        self.batcher: aioloader.Batcher[Any] = aioloader.Batcher(
            fn, batch_size=16, max_latency=0.002, num_workers=workers, **kw
        )

    async def start(self) -> None:
        await self.batcher.__aenter__()

    async def call(self, body: bytes, **kw: Any) -> Any:
        return await self.batcher.submit(body, **kw)

    async def stop(self) -> None:
        await self.batcher.aclose()


class NaiveContender(Contender):
    name = "naive"

    def __init__(self, workers: int, fn: Callable[[bytes], Any] = preprocess) -> None:
        # The same start method as aioloader's workers, so only the dispatch differs.
        self.pool = cf.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("forkserver"))
        self.fn = fn

    async def call(self, body: bytes) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.pool, self.fn, body)

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
async def arrivals(
    one: Callable[[bytes, float], Awaitable[None]], jpegs: list[bytes], rate: float, n: int
) -> None:
    """Start ``one(body, due)`` for ``n`` requests on an open-loop schedule of ``rate``
    per second, and return when all have finished. Only the requests in flight are held
    (as a server holds its open requests), not every task of the run: a heap of finished
    tasks would make the collector's full passes, and so the loop's stalls, longer."""
    clock = time.perf_counter
    live: set[asyncio.Task[None]] = set()
    done = asyncio.get_running_loop().create_future()
    left = n

    def finished(task: asyncio.Task[None]) -> None:
        nonlocal left
        live.discard(task)
        left -= 1
        if not left and not done.done():
            done.set_result(None)

    if n <= 0:
        return
    t0 = clock()
    for k in range(n):
        due = t0 + k / rate
        delay = due - clock()
        if delay > 0:
            await asyncio.sleep(delay)  # the arrival schedule itself
        task = asyncio.ensure_future(one(jpegs[k % len(jpegs)], due))
        live.add(task)
        task.add_done_callback(finished)
    await done


async def open_loop(
    call: Callable[[bytes], Awaitable[Any]], jpegs: list[bytes], rate: float, n: int
) -> dict[str, Any]:
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

    await arrivals(one, jpegs, rate, n)
    a = np.array(lat) * 1e3
    return {
        "rate": rate,
        "p50_ms": float(np.percentile(a, 50)) if len(a) else None,
        "p99_ms": float(np.percentile(a, 99)) if len(a) else None,
        "errors": errors,
    }


FREEZE = False  # --gc-freeze: freeze the heap once each contender is up, as examples/serve.py does


async def warm(c: Contender, jpegs: list[bytes]) -> None:
    await asyncio.gather(*(c.call(j) for j in jpegs[:32]))
    if FREEZE:
        # What the contender allocated to start (its pool, its loop's machinery, modules
        # imported on the way) lives as long as it does: out of the collector's reach.
        gc.collect()
        gc.freeze()


LIMIT_MS = 50.0  # the knee: the highest rate whose p99 stays under this, with no error
GIVE_UP = 2  # a contender stops climbing after this many failing rates in a row


async def sweep(
    name: str, workers: int, jpegs: list[bytes], rates: list[float], seconds: float
) -> list[dict[str, Any]]:
    """The rates in order, until ``GIVE_UP`` of them in a row miss the limit: the rates
    above are not offered (rows with ``None`` latencies), as a queue that grows without
    bound says nothing more at a higher rate and keeps the machine busy draining it."""
    c = MAKERS[name](workers)
    await c.start()
    try:
        await warm(c, jpegs)
        rows: list[dict[str, Any]] = []
        missed = 0
        for rate in rates:
            if missed >= GIVE_UP:
                rows.append({"rate": rate, "p50_ms": None, "p99_ms": None, "errors": 0, "offered": False})
                continue
            row = await open_loop(c.call, jpegs, rate, max(50, int(rate * seconds)))
            rows.append({**row, "offered": True})
            missed = 0 if best_rate([row]) else missed + 1
        return rows
    finally:
        await c.stop()


def auto_rates(bound: float, step: float = 200.0) -> list[float]:
    """100, 200, then every ``step`` up to twice ``bound`` (the compute bound measured
    before the sweeps; a contender stops climbing at its knee long before): a ladder that
    stops short of the knees would cap them, and the bound itself moves between runs."""
    top = step * math.ceil(2 * bound / step)
    return [100.0, *(step * k for k in range(1, int(top / step) + 1))]


async def compute_bound(workers: int, side: int, seconds: float) -> float:
    """Requests/s that ``workers`` processes answer when all they do is ``fn``, back to
    back (no dispatch, no results sent back, the main process idle): no contender can
    go faster on the same cores, since every one also needs the main process's CPU."""
    loop = asyncio.get_running_loop()
    with cf.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("forkserver")) as pool:
        await asyncio.gather(*(loop.run_in_executor(pool, fn_loop, side, 0.01) for _ in range(workers)))
        counts = await asyncio.gather(*(loop.run_in_executor(pool, fn_loop, side, seconds) for _ in range(workers)))
    return sum(counts) / seconds


async def low_load(workers: int, jpegs: list[bytes], n: int) -> dict[str, float]:
    """One request at a time, through the Batcher and through the naive way. Each
    request's added latency is its round trip less the time its own ``fn`` took in the
    worker (``timed_preprocess`` measures it there, so a worker slower or faster than
    the main process does not count); the medians are reported, with ``fn`` timed in
    the main process for reference."""
    fn_times = []
    for body in jpegs[:n]:
        t = time.perf_counter()
        preprocess(body)
        fn_times.append(time.perf_counter() - t)
    out: dict[str, float] = {"fn_main_p50_ms": statistics.median(fn_times) * 1e3}
    contenders: list[Contender] = [
        BatcherContender(workers, timed_preprocess, max_pending=1024),
        NaiveContender(workers, timed_preprocess),
    ]
    try:
        for c in contenders:
            await c.start()
            await warm(c, jpegs)
            totals, added, fns = [], [], []
            for body in jpegs[:n]:
                t = time.perf_counter()
                _, fn_s = await c.call(body)
                total = time.perf_counter() - t
                totals.append(total)
                fns.append(fn_s)
                added.append(total - fn_s)
            out[f"{c.name}_p50_ms"] = statistics.median(totals) * 1e3
            out[f"{c.name}_fn_p50_ms"] = statistics.median(fns) * 1e3
            out[f"{c.name}_added_p50_ms"] = statistics.median(added) * 1e3
    finally:
        for c in contenders:
            await c.stop()
    return out


SLOW_S = 0.001  # the refusal target: Overloaded within 1 ms
_RUSAGE_THREAD = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)


class Stretches:
    """Times short stretches of the event loop's thread (here: refusals), and puts each
    one over ``SLOW_S`` down to a cause, the first of these that its counts show:

    - ``collector``: the cyclic garbage collector ran inside it (an allocation in it
      started a collection, which is as long as the young generations are big);
    - ``blocked``: the thread waited in the kernel (a voluntary context switch: a lock,
      the GIL, a page brought in);
    - ``switched_out``: the kernel preempted the thread (for another process) in between;
    - ``unseen``: the thread used under half of the stretch's time on a CPU and was never
      switched out: time the kernel did not account to it (the host running something
      else on the virtual CPU, or interrupts);
    - ``own_code``: none of those: the stretch's own code was that slow.

    A cause says what happened inside the stretch, not that nothing else did: each slow
    stretch's own counts (CPU time, switches, collections) are kept in ``slow`` too.
    Without ``RUSAGE_THREAD`` (not Linux) the switch counts are the whole process's.
    While installed (``with``), it also records every collection's pause, in ``pauses``.
    """

    CAUSES = ("collector", "blocked", "switched_out", "unseen", "own_code")

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.slow: list[dict[str, Any]] = []
        self.pauses: list[tuple[int, float]] = []  # (generation, seconds) of each collection
        self._began = 0.0

    @property
    def collections(self) -> int:
        return len(self.pauses)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        else:
            self.pauses.append((info["generation"], time.perf_counter() - self._began))

    def __enter__(self) -> Stretches:
        gc.callbacks.append(self._on_gc)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._on_gc)

    def start(self) -> tuple[float, float, int, int, int]:
        ru = resource.getrusage(_RUSAGE_THREAD)
        cpu = time.thread_time()
        return time.perf_counter(), cpu, ru.ru_nvcsw, ru.ru_nivcsw, self.collections  # the clock last

    def stop(self, mark: tuple[float, float, int, int, int]) -> None:
        wall = time.perf_counter() - mark[0]  # the clock first
        self.wall.append(wall)
        if wall <= SLOW_S:
            return
        cpu = time.thread_time() - mark[1]
        ru = resource.getrusage(_RUSAGE_THREAD)
        counts = {
            "ms": round(wall * 1e3, 3),
            "cpu_ms": round(cpu * 1e3, 3),
            "collections": self.collections - mark[4],
            "voluntary_switches": ru.ru_nvcsw - mark[2],
            "involuntary_switches": ru.ru_nivcsw - mark[3],
        }
        if counts["collections"] > 0:
            cause = "collector"
        elif counts["voluntary_switches"] > 0:
            cause = "blocked"
        elif counts["involuntary_switches"] > 0:
            cause = "switched_out"
        elif cpu < wall / 2:
            cause = "unseen"
        else:
            cause = "own_code"
        self.slow.append({"cause": cause, **counts})

    def summary(self, prefix: str) -> dict[str, Any]:
        by_cause = {c: [d["ms"] for d in self.slow if d["cause"] == c] for c in self.CAUSES}
        return {
            f"{prefix}_over_1ms": len(self.slow),
            f"{prefix}_over_1ms_by_cause": {c: len(v) for c, v in by_cause.items()},
            f"{prefix}_over_1ms_max_by_cause": {c: max(v) for c, v in by_cause.items() if v},
            f"{prefix}_over_1ms_detail": self.slow,
            "thread_switch_counts": _RUSAGE_THREAD != resource.RUSAGE_SELF,
        }


async def overload(
    workers: int, jpegs: list[bytes], rate: float, seconds: float
) -> dict[str, Any]:
    """Open-loop arrivals at ``rate`` (in a full run, twice the Batcher's median knee;
    ``--overload-only``: the rate given), each with a budget of 50 ms
    from its scheduled arrival and the default ``max_pending``: the request is submitted
    with ``deadline=`` what is left of the budget when the event loop gets to it (a loop
    busy at 2x overload gets to it late), and the Batcher refuses what it estimates it
    cannot answer in time. Rejection time is measured from the ``submit()`` call to the
    ``Overloaded``, and each refusal over 1 ms is put down to its cause (see
    :class:`Stretches`: one ``getrusage`` and one ``thread_time`` call per request, a
    few microseconds of the loop's time); admitted latency from the scheduled arrival to the answer
    (a result, or ``DeadlineExceeded`` at the deadline), and also from the ``submit()``
    call. The cyclic garbage collector's pauses during the arrivals are recorded too: a
    pause stops the event loop, service and load generator alike."""
    c = BatcherContender(workers)
    await c.start()
    clock = time.perf_counter
    completed: list[float] = []
    answered: list[float] = []  # every admitted request: its result or its DeadlineExceeded
    from_submit: list[float] = []  # the same, from the submit() call
    refusals = Stretches()
    expired = 0
    try:
        await warm(c, jpegs)

        async def one(body: bytes, due: float) -> None:
            nonlocal expired
            mark = refusals.start()
            t = mark[0]
            try:
                # What is left of the request's budget when the service gets to it, as a
                # service that propagates its clients' deadlines passes it on.
                await c.call(body, deadline=max(0.0, DEADLINE_S - (t - due)))
            except aioloader.Overloaded:
                refusals.stop(mark)
                return
            except aioloader.DeadlineExceeded:
                expired += 1
                answered.append(clock() - due)
                from_submit.append(clock() - t)
                return
            completed.append(clock() - due)
            answered.append(completed[-1])
            from_submit.append(clock() - t)

        n = int(rate * seconds)
        with refusals:  # (and the collector's pauses)
            await arrivals(one, jpegs, rate, n)
        st = c.batcher.stats()
    finally:
        await c.stop()
    rejected, pauses = refusals.wall, refusals.pauses
    return {
        "rate": rate,
        "deadline_ms": DEADLINE_S * 1e3,
        "offered": n,
        "admitted": len(answered),
        "completed": len(completed),
        "expired": expired,
        "expired_after_dispatch": st.expired_after_dispatch,
        "rejected": len(rejected),
        "rejected_late": st.rejected_late,
        "completed_per_s": len(completed) / seconds,
        "admitted_p50_ms": pct(answered, 50),
        "admitted_p99_ms": pct(answered, 99),
        "completed_p99_ms": pct(completed, 99),
        "admitted_max_ms": pct(answered, 100),
        "admitted_from_submit_p99_ms": pct(from_submit, 99),
        "arrival_lag_p99_ms": pct([a - f for a, f in zip(answered, from_submit, strict=True)], 99),
        "rejected_p50_ms": pct(rejected, 50),
        "rejected_p99_ms": pct(rejected, 99),
        "rejected_max_ms": pct(rejected, 100),
        **refusals.summary("rejected"),
        "worker_items": sum(k * v for k, v in st.batch_sizes.items()),
        "gc_collections": len(pauses),
        "gc_full_collections": sum(1 for g, _ in pauses if g == 2),
        "gc_max_pause_ms": max((d for _, d in pauses), default=0.0) * 1e3,
    }


def pct(values: list[float], q: float) -> float | None:
    """The ``q``th percentile of ``values`` (seconds), in ms."""
    return float(np.percentile(np.array(values) * 1e3, q)) if values else None


def best_rate(rows: list[dict[str, Any]], limit_ms: float = LIMIT_MS) -> float:
    ok = [r["rate"] for r in rows if r["p99_ms"] is not None and r["p99_ms"] < limit_ms and not r["errors"]]
    return max(ok, default=0.0)


def _median_rows(reps: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per rate, the medians over the repetitions. A repetition that did not offer the
    rate (it had stopped climbing) or got no answer at it counts as infinitely slow, so a
    median is never taken over the faster repetitions alone; a median that is infinite
    is ``None``. ``offered`` counts the repetitions that ran the rate; errors are summed."""

    def med(cells: tuple[dict[str, Any], ...], key: str) -> float | None:
        m = statistics.median(math.inf if c[key] is None else c[key] for c in cells)
        return None if math.isinf(m) else m

    return [
        {"rate": cells[0]["rate"], "p50_ms": med(cells, "p50_ms"), "p99_ms": med(cells, "p99_ms"),
         "errors": sum(c["errors"] for c in cells), "offered": sum(c.get("offered", True) for c in cells)}
        for cells in zip(*reps, strict=True)
    ]  # fmt: skip


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    global FREEZE
    jpegs = make_jpegs(64, args.side)
    FREEZE = args.gc_freeze
    out: dict[str, Any] = {
        "side": args.side, "workers": args.workers, "repeat": args.repeat, "gc_freeze": args.gc_freeze,
    }  # fmt: skip
    if args.overload_only is not None:
        return {**out, **await overloads(args, jpegs, args.overload_only)}
    if args.rates == "auto":
        out["ladder_bound"] = await compute_bound(args.workers, args.side, 2 * args.seconds)
        rates = auto_rates(out["ladder_bound"])
        print(f"compute bound {out['ladder_bound']:.0f} req/s: rates up to {rates[-1]:.0f}", flush=True)
    else:
        rates = [float(r) for r in args.rates.split(",")]
    out["rates"] = rates
    names = ["batcher", "naive", "stream"]
    raw: dict[str, list[list[dict[str, Any]]]] = {n: [] for n in names}
    bounds: list[float] = []
    for rep in range(args.repeat):  # interleaved: the order rotates every repetition
        for name in names[rep % 3 :] + names[: rep % 3]:
            if name == "batcher":  # the bound, measured next to the sweeps it bounds
                bounds.append(await compute_bound(args.workers, args.side, 2 * args.seconds))
                print(f"rep {rep + 1}/{args.repeat} compute bound {bounds[-1]:.0f} req/s", flush=True)
            raw[name].append(await sweep(name, args.workers, jpegs, rates, args.seconds))
            rows = raw[name][-1]
            print(
                f"rep {rep + 1}/{args.repeat}",
                name,
                [(r["rate"], round(r["p99_ms"], 1)) for r in rows if r["p99_ms"] is not None],
                flush=True,
            )
    out["sweeps_raw"] = raw
    out["sweeps"] = {n: _median_rows(raw[n]) for n in names}
    out["best_rate_by_rep"] = {n: [best_rate(rows) for rows in raw[n]] for n in names}
    out["best_rate"] = {n: statistics.median(v) for n, v in out["best_rate_by_rep"].items()}
    # A knee at the top of the ladder is a floor, not a knee: say so.
    out["capped"] = {n: rates[-1] in v for n, v in out["best_rate_by_rep"].items()}
    for n, capped in out["capped"].items():
        if capped:
            print(f"warning: {n} passed the top rate offered ({rates[-1]:.0f} req/s): its knee is higher", flush=True)
    ratios = [
        b / n for b, n in zip(*(out["best_rate_by_rep"][k] for k in ("batcher", "naive")), strict=True) if n
    ]
    out["batcher_vs_naive_by_rep"] = ratios
    out["batcher_vs_naive"] = statistics.median(ratios) if ratios else None
    out["compute_bound_by_rep"] = bounds
    out["compute_bound"] = statistics.median(bounds)
    # The share of the bound each contender's knee reaches, by repetition: 2x the naive
    # way is only possible where the naive way's share is under half of what is reachable.
    out["share_of_bound_by_rep"] = {
        n: [b / cb for b, cb in zip(out["best_rate_by_rep"][n], bounds, strict=True)] for n in names
    }
    lows = [await low_load(args.workers, jpegs, 200) for _ in range(args.repeat)]
    out["low_load_by_rep"] = lows
    out["low_load"] = {k: statistics.median(r[k] for r in lows) for k in lows[0]}
    top = out["best_rate"]["batcher"] or rates[-1]
    out.update(await overloads(args, jpegs, 2 * top))
    return out


async def overloads(args: argparse.Namespace, jpegs: list[bytes], rate: float) -> dict[str, Any]:
    """``--repeat`` overload runs at ``rate``: the medians, and every slow refusal by cause."""
    runs = [await overload(args.workers, jpegs, rate, args.seconds) for _ in range(args.repeat)]
    return {"overload_by_rep": runs, **merge_overloads(runs)}


def merge_overloads(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The repetitions' medians (numbers), and their refusals over 1 ms by cause, summed."""
    out: dict[str, Any] = {}
    out["overload"] = {
        k: statistics.median(r[k] for r in runs) if all(r[k] is not None for r in runs) else None
        for k, v in runs[0].items()
        if v is None or isinstance(v, (int, float))
    }
    # The refusals over 1 ms of every repetition, by cause: counts summed, the slowest kept.
    by_cause = [r["rejected_over_1ms_by_cause"] for r in runs]
    slowest = [r["rejected_over_1ms_max_by_cause"] for r in runs]
    out["overload_slow_refusals"] = {
        "refusals": sum(r["rejected"] for r in runs),
        "over_1ms": sum(r["rejected_over_1ms"] for r in runs),
        "by_cause": {c: sum(d[c] for d in by_cause) for c in by_cause[0]},
        "max_ms_by_cause": {c: max(d[c] for d in slowest if c in d) for c in by_cause[0] if any(c in d for d in slowest)},
    }
    return out


def chart(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, rows in result["sweeps"].items():
        shown = [r for r in rows if r["p99_ms"] is not None]
        ax.plot([r["rate"] for r in shown], [r["p99_ms"] for r in shown], marker="o", label=name)
    ax.axhline(50, color="grey", linestyle="--", linewidth=1)
    ax.set_yscale("log")
    ax.set_xlabel("offered load, requests/s (open loop)")
    ax.set_ylabel("p99 latency, ms (log)")
    ax.set_title(f"One {result['side']}x{result['side']} JPEG per request, decode + resize, {result['workers']} workers")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--side", type=int, default=256, help="side of the request JPEGs, pixels")
    ap.add_argument(
        "--rates",
        default="auto",
        help="comma-separated offered rates, req/s; 'auto': 100, 200, then every 200 up to twice "
        "the compute bound measured first",
    )
    ap.add_argument("--seconds", type=float, default=2.0, help="seconds of arrivals per rate")
    ap.add_argument("--repeat", type=int, default=3, help="interleaved repetitions (medians are reported)")
    ap.add_argument(
        "--gc-freeze",
        action="store_true",
        help="gc.freeze() once set up, as a service would after start-up (every contender)",
    )
    ap.add_argument(
        "--overload-only",
        type=float,
        metavar="RATE",
        help="only the overload part, --repeat times at RATE req/s (no sweeps, no low load)",
    )
    ap.add_argument("--json")
    ap.add_argument("--png")
    args = ap.parse_args(argv)
    if args.overload_only is not None:
        if args.overload_only * args.seconds < 1:
            ap.error("--overload-only: RATE times --seconds must be at least one request")
        if args.png:
            ap.error("--png charts the sweeps, which --overload-only does not run")
    import uvloop

    result = uvloop.run(main_async(args))
    print(json.dumps({k: v for k, v in result.items() if not k.startswith("sweeps")}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.png:
        chart(result, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())

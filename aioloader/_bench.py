"""``python -m aioloader bench MODULE:FACTORY``: measure a dataset under several
``num_workers``/``prefetch`` settings and recommend one."""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .loader import DataLoader

__all__ = ["BenchResult", "bench_main", "measure", "recommend"]


@dataclass(frozen=True)
class BenchResult:
    workers: int
    prefetch: int
    samples_per_s: float
    """Median over the measured epochs (the first epoch is excluded when there are more)."""
    first_batch_ms: float
    """Time to the first batch of the first epoch (includes starting the workers)."""
    stall_fraction: float
    """Share of the measured epochs' wall time the consumer spent waiting for data."""
    main_cpu_ms_per_batch: float
    """Main-process CPU time per batch (all of its threads)."""


def load_factory(spec: str) -> Callable[[], Any]:
    if ":" not in spec:
        raise ValueError(f"factory must look like MODULE:FUNCTION, got {spec!r}")
    mod_name, _, attr = spec.partition(":")
    obj: Any = importlib.import_module(mod_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"{spec} is not callable")
    return obj  # type: ignore[no-any-return]


def measure(
    dataset: Any, *, workers: int, prefetch: int | None, batch_size: int, epochs: int, max_batches: int | None
) -> BenchResult:
    rates: list[float] = []
    walls: list[float] = []
    batches_seen = 0
    cpu0 = time.process_time()
    with DataLoader(
        dataset, batch_size, shuffle=True, seed=0, num_workers=workers, prefetch=prefetch
    ) as loader:
        for _epoch in range(epochs):
            t0 = time.perf_counter()
            n = 0
            for k, batch in enumerate(loader):
                n += len(batch[0]) if isinstance(batch, (tuple, list)) else len(batch)
                batches_seen += 1
                if max_batches is not None and k + 1 >= max_batches:
                    break
            wall = time.perf_counter() - t0
            walls.append(wall)
            rates.append(n / wall if wall > 0 else float("inf"))
        st = loader.stats()
        used_prefetch = loader.prefetch
    cpu = time.process_time() - cpu0
    measured = slice(1, None) if epochs > 1 else slice(None)
    stall = sum(e.stall_s for e in st.epochs[measured])
    first = st.epochs[0].first_batch_s or 0.0
    return BenchResult(
        workers=workers,
        prefetch=used_prefetch,
        samples_per_s=statistics.median(rates[measured]),
        first_batch_ms=first * 1000,
        stall_fraction=stall / max(sum(walls[measured]), 1e-9),
        main_cpu_ms_per_batch=cpu * 1000 / max(batches_seen, 1),
    )


def recommend(results: Sequence[BenchResult], tolerance: float = 0.05) -> BenchResult:
    """The cheapest setting within ``tolerance`` of the best throughput: fewer workers
    first (they cost memory and cores), then a smaller prefetch (it costs memory)."""
    best = max(r.samples_per_s for r in results)
    good = [r for r in results if r.samples_per_s >= (1 - tolerance) * best]
    return min(good, key=lambda r: (r.workers, r.prefetch))


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def bench_main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m aioloader bench", description=__doc__)
    parser.add_argument("factory", help="MODULE:FUNCTION returning the dataset (importable by workers)")
    parser.add_argument("--workers", type=_ints, default=[1, 2, 4], help="comma-separated num_workers values")
    parser.add_argument(
        "--prefetch", type=_ints, default=None, help="comma-separated prefetch values (default: 2 x workers)"
    )
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument(
        "--epochs", type=int, default=2, help="epochs per setting; the first is excluded from throughput"
    )
    parser.add_argument("--max-batches", type=int, default=None, help="cap batches per epoch")
    args = parser.parse_args(argv)
    sys.path.insert(0, "")
    dataset = load_factory(args.factory)()
    prefetches: list[int | None] = list(args.prefetch) if args.prefetch else [None]
    results = []
    header = f"{'workers':>7} {'prefetch':>8} {'samples/s':>11} {'first batch':>11} {'stall':>6} {'main CPU/batch':>14}"
    print(header)
    print("-" * len(header))
    for w in args.workers:
        for p in prefetches:
            r = measure(
                dataset,
                workers=w,
                prefetch=p,
                batch_size=args.batch_size,
                epochs=args.epochs,
                max_batches=args.max_batches,
            )
            results.append(r)
            print(
                f"{r.workers:>7} {r.prefetch:>8} {r.samples_per_s:>11,.0f} {r.first_batch_ms:>9.0f} ms"
                f" {r.stall_fraction:>6.0%} {r.main_cpu_ms_per_batch:>11.2f} ms",
                flush=True,
            )
    best = recommend(results)
    print(
        f"\nrecommended: num_workers={best.workers}, prefetch={best.prefetch} "
        f"({best.samples_per_s:,.0f} samples/s; the cheapest setting within 5% of the fastest)"
    )
    return 0

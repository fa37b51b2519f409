"""``python -m aioloader bench MODULE:FACTORY``: measure a dataset under several
``num_workers``/``prefetch`` settings, with repetitions, and recommend one.

Every setting is measured ``--repeat`` times, each time with a fresh loader that runs
``--epochs`` epochs; the first epoch is a warm-up (it starts the workers, fills the page
cache) and is left out of the figures unless it is the only one. The repetitions go
round-robin over the settings, so a change in the machine's load while the benchmark
runs is spread over all settings instead of favouring some. Each row reports the median
over the repetitions and their range.

The stall column is the share of the measured time the consumer waited for a batch
while doing ``--step-ms`` of other work per batch (a stand-in for the training step; it
sleeps, as a step waiting on an accelerator does). Without a step the consumer does
nothing but wait, so the share would read 100% for every setting and is not shown.

The recommendation is the cheapest setting whose median is within 5% of the best: fewer
workers first, then a smaller prefetch. A setting with more workers than this process
may run on (``os.sched_getaffinity``) is only a candidate when every one of its
repetitions beat every repetition of every setting within the usable cores.

``aioloader.datasets:SyntheticJpegDataset`` is the demo's data set (JPEG decode and
augmentation), a factory that needs no arguments.
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..loader import DataLoader
from . import program, usage_error

__all__ = [
    "BenchResult",
    "Run",
    "aggregate",
    "bench_main",
    "load_factory",
    "measure",
    "recommend",
    "usable_cores",
]


@dataclass(frozen=True)
class Run:
    """One repetition of one setting."""

    samples_per_s: float
    """Samples per second over the measured epochs."""
    first_batch_s: float
    """Time to the first batch of the first epoch (starting the workers included)."""
    stall_fraction: float
    """Share of the measured epochs' wall time the consumer spent waiting for data."""
    main_cpu_s_per_batch: float
    """Main-process CPU time per batch (all of its threads)."""


@dataclass(frozen=True)
class BenchResult:
    """The figures of one setting over its repetitions."""

    workers: int
    """``num_workers`` of the setting."""
    prefetch: int
    """``prefetch`` of the setting (the loader's value when the default was measured)."""
    samples_per_s: float
    """Median of the repetitions' samples per second."""
    rates: tuple[float, ...]
    """Samples per second of each repetition, in the order they ran."""
    first_batch_ms: float
    """Median time to the first batch of a fresh loader, in milliseconds."""
    stall_fraction: float | None
    """Median share of time the consumer waited for data; ``None`` when it did no work
    between batches (no ``--step-ms``), where the share says nothing."""
    main_cpu_ms_per_batch: float
    """Median main-process CPU time per batch, in milliseconds."""

    @property
    def spread(self) -> float:
        """The repetitions' range relative to their median (0 for a single repetition)."""
        return (max(self.rates) - min(self.rates)) / self.samples_per_s if self.samples_per_s else 0.0


def usable_cores() -> int:
    """The CPUs this process may run on (its affinity mask, not the machine's count)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def load_factory(spec: str) -> Callable[[], Any]:
    """The callable named by ``MODULE:ATTRIBUTE`` (dots in the attribute walk into it).

    Raises :class:`ValueError` for a malformed spec or one that names nothing callable,
    :class:`ImportError` when the module does not import.
    """
    mod_name, sep, attr = spec.partition(":")
    if not sep or not mod_name or not attr:
        raise ValueError(f"factory must look like MODULE:FUNCTION, got {spec!r}")
    obj: Any = importlib.import_module(mod_name)
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"{spec}: {obj.__name__!r} has no attribute {part!r}") from None
    if not callable(obj):
        raise ValueError(f"{spec} is not callable")
    return obj  # type: ignore[no-any-return]


def measure(
    dataset: Any,
    *,
    workers: int,
    prefetch: int | None,
    batch_size: int,
    epochs: int,
    max_batches: int | None,
    step_s: float = 0.0,
) -> tuple[int, Run]:
    """Run ``epochs`` epochs on a fresh loader; return its ``prefetch`` and the figures.

    After each batch the consumer sleeps ``step_s`` seconds (the simulated training
    step). The first epoch is left out of the figures when there are more.
    """
    samples: list[int] = []
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
                if step_s:
                    time.sleep(step_s)
                if max_batches is not None and k + 1 >= max_batches:
                    break
            walls.append(time.perf_counter() - t0)
            samples.append(n)
        st = loader.stats()
        used_prefetch = loader.prefetch
    cpu = time.process_time() - cpu0
    measured = slice(1, None) if epochs > 1 else slice(None)
    wall = sum(walls[measured])
    stalled = sum(e.stall_s for e in st.epochs[-epochs:][measured])
    return used_prefetch, Run(
        samples_per_s=sum(samples[measured]) / wall if wall > 0 else float("inf"),
        first_batch_s=st.epochs[-epochs].first_batch_s or 0.0,
        stall_fraction=min(1.0, stalled / wall) if wall > 0 else 0.0,
        main_cpu_s_per_batch=cpu / max(batches_seen, 1),
    )


def aggregate(workers: int, prefetch: int, runs: Sequence[Run], *, stepped: bool) -> BenchResult:
    """Medians over ``runs``; the stall share only when the consumer did work (``stepped``)."""
    if not runs:
        raise ValueError("aggregate needs at least one run")
    return BenchResult(
        workers=workers,
        prefetch=prefetch,
        samples_per_s=statistics.median(r.samples_per_s for r in runs),
        rates=tuple(r.samples_per_s for r in runs),
        first_batch_ms=1000 * statistics.median(r.first_batch_s for r in runs),
        stall_fraction=statistics.median(r.stall_fraction for r in runs) if stepped else None,
        main_cpu_ms_per_batch=1000 * statistics.median(r.main_cpu_s_per_batch for r in runs),
    )


def recommend(results: Sequence[BenchResult], *, cores: int, tolerance: float = 0.05) -> BenchResult:
    """The cheapest setting within ``tolerance`` of the best median: fewer workers first
    (they cost memory and cores), then a smaller prefetch (it costs memory).

    Settings with more than ``cores`` workers compete only when each of their
    repetitions is faster than every repetition of every setting within ``cores``: on
    an oversubscribed machine a higher median alone is more often luck than speed.
    """
    within = [r for r in results if r.workers <= cores]
    if within:
        ceiling = max(max(r.rates) for r in within)
        results = within + [r for r in results if r.workers > cores and min(r.rates) > ceiling]
    best = max(r.samples_per_s for r in results)
    good = [r for r in results if r.samples_per_s >= (1 - tolerance) * best]
    return min(good, key=lambda r: (r.workers, r.prefetch))


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one integer")
    return values


def _default_workers(cores: int) -> list[int]:
    # Powers of two up to the usable cores, and the cores themselves.
    return sorted({1 << k for k in range(cores.bit_length()) if 1 << k <= cores} | {cores})


def _parser(cores: int) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"{program()} bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("factory", help="MODULE:FUNCTION returning the dataset (importable by workers)")
    default = ",".join(map(str, _default_workers(cores)))
    parser.add_argument(
        "--workers", type=_ints, default=None, help=f"comma-separated num_workers values (default {default})"
    )
    parser.add_argument(
        "--prefetch", type=_ints, default=None, help="comma-separated prefetch values (default: 2 x workers)"
    )
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument(
        "--epochs",
        type=int,
        default=2,
        help="epochs per repetition; the first is a warm-up left out (default 2)",
    )
    parser.add_argument("--repeat", type=int, default=3, help="repetitions per setting (default 3)")
    parser.add_argument("--max-batches", type=int, default=None, help="cap batches per epoch")
    parser.add_argument(
        "--step-ms",
        type=float,
        default=0.0,
        help="simulated training step per batch, in ms (gives the stall column)",
    )
    return parser


def _row(r: BenchResult) -> str:
    stall = "-" if r.stall_fraction is None else f"{r.stall_fraction:.0%}"
    span = f"{min(r.rates):,.0f}-{max(r.rates):,.0f}"
    return (
        f"{r.workers:>7} {r.prefetch:>8} {r.samples_per_s:>11,.0f} {span:>19}"
        f" {r.first_batch_ms:>8.0f} ms {stall:>6} {r.main_cpu_ms_per_batch:>11.2f} ms"
    )


def bench_main(argv: Sequence[str] | None = None) -> int:
    """Run ``bench``; print the table on stdout and each repetition on stderr; return the status.

    Returns 2 with a one-line message when the factory cannot be loaded; exits with
    status 2 for invalid arguments.
    """
    cores = usable_cores()
    parser = _parser(cores)
    args = parser.parse_args(argv)
    workers_list: list[int] = args.workers or _default_workers(cores)
    checks = [
        ("--batch-size", args.batch_size, 1),
        ("--epochs", args.epochs, 1),
        ("--repeat", args.repeat, 1),
    ]
    checks += [("--workers", w, 0) for w in workers_list] + [
        ("--prefetch", p, 1) for p in args.prefetch or []
    ]
    if args.max_batches is not None:
        checks.append(("--max-batches", args.max_batches, 1))
    for name, value, low in checks:
        if value < low:
            parser.error(f"{name} must be {low} or more, got {value}")
    if not 0 <= args.step_ms < float("inf"):
        parser.error(f"--step-ms must be 0 or more, got {args.step_ms}")
    sys.path.insert(0, "")
    try:
        dataset = load_factory(args.factory)()
    except (ImportError, ValueError) as err:
        return usage_error("bench", err)
    settings = [(w, p) for w in workers_list for p in (args.prefetch or [None])]
    runs: dict[tuple[int, int | None], list[Run]] = {s: [] for s in settings}
    used: dict[tuple[int, int | None], int] = {}
    print(
        f"{cores} usable cores; {args.repeat} repetitions per setting, round-robin, each a fresh loader "
        f"running {args.epochs} epoch(s){' (the first a warm-up)' if args.epochs > 1 else ''}; "
        f"consumer step {args.step_ms:g} ms",
        flush=True,
    )
    for rep in range(args.repeat):
        for w, p in settings:
            used[w, p], run = measure(
                dataset,
                workers=w,
                prefetch=p,
                batch_size=args.batch_size,
                epochs=args.epochs,
                max_batches=args.max_batches,
                step_s=args.step_ms / 1000,
            )
            runs[w, p].append(run)
            print(
                f"bench: repetition {rep + 1}/{args.repeat}, workers={w} prefetch={used[w, p]}: "
                f"{run.samples_per_s:,.0f} samples/s",
                file=sys.stderr,
                flush=True,
            )
    results = [aggregate(w, used[w, p], runs[w, p], stepped=args.step_ms > 0) for w, p in settings]
    header = (
        f"{'workers':>7} {'prefetch':>8} {'samples/s':>11} {'range (min-max)':>19} "
        f"{'first batch':>11} {'stall':>6} {'main CPU/batch':>14}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        print(_row(r))
    best = recommend(results, cores=cores)
    over = (
        f", more than the {cores} usable cores: it beat them in every repetition"
        if best.workers > cores
        else ""
    )
    print(
        f"\nrecommended: num_workers={best.workers}, prefetch={best.prefetch} "
        f"({best.samples_per_s:,.0f} samples/s median; the cheapest setting within 5% of the fastest{over})"
    )
    if args.step_ms == 0:
        print("stall: pass --step-ms (your training step per batch) to measure how long the consumer waits")
    return 0

"""IPC-bound batches: how fast can a loader move large arrays from workers to the consumer?

Batches of 32 float32 arrays of 3x512x512 (96 MiB) with trivial compute (each sample is
``np.full``), 2 persistent workers, 4 batches in flight, everything started once and then
measured in interleaved rounds (the order rotates every round) so that drift on a shared
machine hits every configuration alike:

- ``aioloader shm`` / ``aioloader pickle``: ``DataLoader(transport=...)``;
- ``torch, numpy samples``: torch's DataLoader with torch's default collate (which stacks
  numpy samples into shared-memory tensors in the worker);
- ``torch, numpy samples, numpy collate``: the batch stays numpy and is pickled;
- ``torch, tensor samples``: the dataset returns tensors (torch's best case);
- ``produce only``: the workers build each batch (same dataset, same collate) and throw it
  away; a bound on what any transport can reach.

Per configuration: median GB/s over the rounds (1 GB = 1e9 bytes), main-process CPU
seconds per GB and per batch (``getrusage``: every thread of the consumer process), and
the main process's peak RSS during its epochs (``VmHWM``, reset before each epoch; the
baseline, with numpy, torch and aioloader imported, is about 230 MB). The consumer reads
one value per batch (``--touch``: every page) and drops the batch. The last row repeats
``aioloader shm`` with batches a quarter of the size: its main-process CPU per batch should
be the same.

    python examples/benchmarks/bench_ipc.py            # ~2-3 minutes
    python examples/benchmarks/bench_ipc.py --quick    # ~30 s
    python examples/benchmarks/bench_ipc.py --json out.json
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import gc
import json
import multiprocessing as mp
import os
import platform
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

from aioloader import DataLoader, default_collate

try:
    import torch
    import torch.utils.data as tud
except ImportError:  # the torch rows are skipped
    torch = None  # type: ignore[assignment]

SHAPE = (3, 512, 512)
SAMPLE_BYTES = int(np.prod(SHAPE)) * 4
WORKERS = 2
PREFETCH = 4  # batches in flight, for every loader


# --------------------------------------------------------------------------- datasets
class NumpySamples:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        return np.full(SHAPE, i % 251, dtype=np.float32)


class TensorSamples(NumpySamples):
    def __getitem__(self, i: int) -> Any:
        return torch.full(SHAPE, float(i % 251), dtype=torch.float32)


def numpy_collate(samples: list[np.ndarray]) -> np.ndarray:
    return np.stack(samples)


def produce(n_samples: int, start: int) -> int:
    """The produce-only bound's task: build one batch exactly as the loaders do, drop it."""
    ds = NumpySamples(start + n_samples)
    batch = default_collate([ds[i] for i in range(start, start + n_samples)])
    return int(batch.nbytes)


# ------------------------------------------------------------------------ measurement
def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss_mb() -> float:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _consume(batches: Iterable[Any], touch: bool) -> tuple[int, int]:
    """Take every batch, read it (one value, or one per page), drop it."""
    n = nbytes = 0
    for b in batches:
        arr = b if isinstance(b, np.ndarray) else b.numpy()
        if touch:
            float(arr.reshape(-1)[::1024].sum())
        else:
            float(arr[-1, -1, -1, -1])
        n += 1
        nbytes += arr.nbytes
        del arr, b
    return n, nbytes


class Config:
    """One row: ``epoch()`` runs one epoch and returns (batches, bytes)."""

    def __init__(self, name: str, epoch: Callable[[], tuple[int, int]], close: Callable[[], None]) -> None:
        self.name = name
        self.epoch = epoch
        self.close = close
        self.runs: list[dict[str, float]] = []

    def measure(self) -> None:
        gc.collect()
        _reset_peak_rss()
        c0, t0 = _cpu(), time.perf_counter()
        batches, nbytes = self.epoch()
        wall, cpu = time.perf_counter() - t0, _cpu() - c0
        self.runs.append(
            {
                "batches": batches,
                "bytes": nbytes,
                "wall_s": wall,
                "cpu_s": cpu,
                "gb_s": nbytes / wall / 1e9,
                "cpu_s_per_gb": cpu / (nbytes / 1e9),
                "cpu_ms_per_batch": 1e3 * cpu / batches,
                "peak_rss_mb": _peak_rss_mb(),
            }
        )

    def summary(self) -> dict[str, Any]:
        med = {k: statistics.median(r[k] for r in self.runs) for k in self.runs[0]}
        return {
            "name": self.name,
            "median": med,
            "gb_s_min": min(r["gb_s"] for r in self.runs),
            "gb_s_max": max(r["gb_s"] for r in self.runs),
            "runs": self.runs,
        }


def aioloader_config(name: str, transport: str, batch_size: int, n: int, touch: bool) -> Config:
    loader = DataLoader(
        NumpySamples(n),
        batch_size=batch_size,
        num_workers=WORKERS,
        prefetch=PREFETCH,
        transport=transport,  # type: ignore[arg-type]
        prefetch_next_epoch=False,  # nothing may run in the background of another row
        seed_samples=False,
    )
    return Config(name, lambda: _consume(loader, touch), loader.close)


def torch_config(name: str, dataset: Any, collate: Any, batch_size: int, touch: bool) -> Config:
    kw = {"collate_fn": collate} if collate is not None else {}
    loader = tud.DataLoader(
        dataset,
        batch_size=batch_size,
        num_workers=WORKERS,
        prefetch_factor=PREFETCH // WORKERS,
        persistent_workers=True,
        multiprocessing_context="forkserver",
        **kw,
    )

    def close() -> None:
        it = getattr(loader, "_iterator", None)
        if it is not None:
            it._shutdown_workers()

    return Config(name, lambda: _consume(loader, touch), close)


def produce_config(batch_size: int, n: int) -> Config:
    pool = cf.ProcessPoolExecutor(WORKERS, mp_context=mp.get_context("forkserver"))

    def epoch() -> tuple[int, int]:
        starts = iter(range(0, n - batch_size + 1, batch_size))
        pending: list[cf.Future[int]] = []
        batches = nbytes = 0

        def submit() -> None:
            for s in starts:
                pending.append(pool.submit(produce, batch_size, s))
                return

        for _ in range(PREFETCH):
            submit()
        while pending:
            nbytes += pending.pop(0).result()
            batches += 1
            submit()
        return batches, nbytes

    return Config("produce only (bound)", epoch, lambda: pool.shutdown(wait=True))


def build(args: argparse.Namespace) -> list[Config]:
    bs, n, touch = args.batch_size, args.batch_size * args.batches, args.touch
    configs = [
        aioloader_config("aioloader shm", "shm", bs, n, touch),
        aioloader_config("aioloader pickle", "pickle", bs, n, touch),
    ]
    if torch is not None and not args.no_torch:
        configs += [
            torch_config("torch, numpy samples", NumpySamples(n), None, bs, touch),
            torch_config("torch, numpy samples, numpy collate", NumpySamples(n), numpy_collate, bs, touch),
            torch_config("torch, tensor samples", TensorSamples(n), None, bs, touch),
        ]
    configs.append(produce_config(bs, n))
    # Main-process CPU per batch should not depend on the batch size: batches a quarter
    # of the size, as many per epoch (so per-epoch costs weigh the same per batch).
    small = max(1, bs // 4)
    configs.append(
        aioloader_config(f"aioloader shm, batch {small}", "shm", small, small * args.batches, touch)
    )
    return configs


def rotate(items: list[Config], k: int) -> Iterator[Config]:
    k %= len(items)
    yield from items[k:] + items[:k]


def table(results: list[dict[str, Any]], bs: int) -> str:
    produce_gb = next(r["median"]["gb_s"] for r in results if r["name"].startswith("produce"))
    head = (
        f"| configuration (batch {bs} x 3x512x512 float32 unless noted) | GB/s median (min-max) | "
        "x produce-only | main CPU s/GB | main CPU ms/batch | peak RSS MB |"
    )
    lines = [head, "|---|---|---|---|---|---|"]
    for r in results:
        m = r["median"]
        lines.append(
            f"| {r['name']} | {m['gb_s']:.2f} ({r['gb_s_min']:.2f}-{r['gb_s_max']:.2f}) | "
            f"{m['gb_s'] / produce_gb:.2f} | {m['cpu_s_per_gb']:.3f} | {m['cpu_ms_per_batch']:.2f} | "
            f"{m['peak_rss_mb']:.0f} |"
        )
    return "\n".join(lines)


def verdict(results: list[dict[str, Any]], bs: int) -> list[str]:
    by = {r["name"]: r["median"] for r in results}
    shm = by["aioloader shm"]
    out = [f"shm / produce-only = {shm['gb_s'] / by['produce only (bound)']['gb_s']:.2f} (target >= 0.8)"]
    torch_rows = {k: v for k, v in by.items() if k.startswith("torch")}
    if torch_rows:
        best_name, best = max(torch_rows.items(), key=lambda kv: kv[1]["gb_s"])
        out.append(f"shm / torch's best ({best_name}) = {shm['gb_s'] / best['gb_s']:.2f} (target >= 1.5)")
    small = next(v for k, v in by.items() if k.startswith("aioloader shm, batch"))
    out.append(
        f"main CPU per batch: {shm['cpu_ms_per_batch']:.2f} ms at batch {bs} vs "
        f"{small['cpu_ms_per_batch']:.2f} ms at batch {max(1, bs // 4)} (4x smaller batches)"
    )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer rounds and batches (~30 s)")
    p.add_argument("--rounds", type=int, default=None, help="measured epochs per configuration")
    p.add_argument("--batches", type=int, default=None, help="batches per epoch")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--touch", action="store_true", help="the consumer reads every page of each batch")
    p.add_argument("--no-torch", action="store_true")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = p.parse_args(argv)
    args.rounds = args.rounds or (2 if args.quick else 5)
    args.batches = args.batches or (6 if args.quick else 12)

    t_start = time.perf_counter()
    configs = build(args)
    try:
        for c in configs:  # start every pool and warm every arena before measuring
            c.epoch()
        for k in range(args.rounds):
            for c in rotate(configs, k):
                c.measure()
                print(
                    f"  round {k + 1}/{args.rounds}  {c.name:<44} {c.runs[-1]['gb_s']:6.2f} GB/s", flush=True
                )
    finally:
        for c in configs:
            c.close()
    results = [c.summary() for c in configs]
    print()
    print(table(results, args.batch_size))
    print()
    for line in verdict(results, args.batch_size):
        print(line)
    elapsed = time.perf_counter() - t_start
    print(f"\n{args.rounds} rounds x {args.batches} batches, {elapsed:.0f} s in all")
    if args.json:
        info = {
            "python": sys.version.split()[0],
            "numpy": np.__version__,
            "torch": getattr(torch, "__version__", None),
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "args": vars(args),
            "elapsed_s": elapsed,
            "verdict": verdict(results, args.batch_size),
        }
        with open(args.json, "w") as f:
            json.dump({"machine": info, "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

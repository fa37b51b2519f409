"""aioloader against torch's DataLoader, Grain and SPDL, side by side, on this machine.

Runs, interleaved (A B C D, A B C D, ...), on the same data and worker count:

- ``aioloader``: ``aioloader.DataLoader`` with its defaults (forkserver workers, shared-memory
  transport, next-epoch prefetch);
- ``torch-numpy``: ``torch.utils.data.DataLoader`` at its best for the output aioloader
  gives: ``persistent_workers=True`` and ``collate_fn=aioloader.default_collate``, so
  its batches are numpy arrays, as aioloader's are (no tensors through shared memory);
- ``torch-persistent`` and ``torch``: ``torch.utils.data.DataLoader`` with
  ``persistent_workers=True`` / ``False`` (default ``fork`` start method, default
  ``prefetch_factor``, numpy samples collated by torch into tensors);
- ``grain`` and ``spdl``: Grain's ``MapDataset`` pipeline with ``mp_prefetch`` and SPDL's
  ``spdl.pipeline`` with a process pool, both on their numpy paths, with the same 2 worker
  processes; their configurations, and why, are in ``_bench_peers.py``. A peer whose
  package is not installed is skipped and named in the tables (``pip install grain spdl``,
  or the ``bench`` extra);
- ``bound``: the produce-only bound, two forked processes each building half the samples
  and sending nothing back (the most two cores can do).

Workloads:

1. ``jpeg``: 2,048 synthetic JPEGs of 320-512 px, decode + RandomResizedCrop(224) + flip,
   batch 64 -> images/s (5 epochs; quick: 3);
2. ``tiny``: 200,000 samples that are just ints, batch 256 -> batches/s, i.e. loader
   overhead (4 epochs; quick: 3); aioloader also runs with ``seed_samples=False``;
3. ``boundary``: the epoch boundary as a training loop sees it: the first 512 JPEGs, 5
   epochs, an 80 ms sleep per batch (a training step slower than every loader), time from
   ``iter(loader)`` to the first batch of epochs 2-5; aioloader also runs with
   ``prefetch_next_epoch=False``;
4. ``dispatch``: the dispatch ceiling, 4,000 samples that are ints, batch 1 -> batches/s
   (4 epochs; quick: 3): each batch costs its worker almost nothing, so this is what a
   loader pays per batch; aioloader also runs with ``prefetch=16`` (a window that lets it
   give a worker 8 batches a task);
5. ``cold``: the cold start, a fresh process's first loader over 4,096 ints from a
   dataset module that imports torch (imported by the consumer before the clock starts),
   batch 64 -> seconds from construction to the first batch; aioloader also runs with
   ``AIOLOADER_FORKSERVER=spawn`` (``aioloader-spawned``: the forkserver multiprocessing
   spawns, which imports the dataset's modules again).

Three more run only when named in ``--workloads`` (or with ``--workloads all``), each
beside ``torch-numpy``; ``iterable`` and ``hfstream`` also beside ``torch-persistent``,
which gives the same tensors as aioloader gives a torch ``IterableDataset``:

6. ``iterable``: a torch ``IterableDataset`` of 100,000 ints that each worker splits with
   ``get_worker_info()``, batch 64 -> batches/s (4 epochs; quick: 3);
7. ``hfmap``: a HuggingFace ``datasets.Dataset.from_dict`` of 20,000 rows in numpy format,
   shuffled, batch 32 -> batches/s (4 epochs; quick: 3). torch reads each batch with one
   ``__getitems__`` call;
8. ``hfstream``: ``datasets.load_dataset("parquet", streaming=True)`` over 4 local parquet
   shards of 4,000 rows in all, batch 32 -> seconds from the loader's construction to the
   end of its first and only epoch (worker start included). The shards are written once,
   beside the JPEGs. ``hfmap`` and ``hfstream`` need ``pip install datasets`` (the dev
   extra has it).
9. ``start``: how fast workers start in a real training script, the gate of issue 49.
   Each run is a fresh process that runs ``_train_start.py``: it imports torch and numpy,
   defines a dataset of 4,096 samples of ``np.full(8, i)`` in ``__main__``, 2 workers,
   batch 32 -> seconds from a loader's construction to its first batch, in three cases:
   ``thread`` (an idle thread started before the loader), ``second`` (a val loader built
   while a train loader, read to its first batch, lives on) and ``plain`` (one loader,
   nothing else). ``--start-cases`` may add ``tqdm`` (the thread is tqdm's monitor),
   ``omp`` (torch's intra-op pool of native threads is up) and ``early`` (the idle thread
   starts before ``import aioloader``).
   Beside ``torch-numpy`` (fork, persistent workers, a numpy collate); medians of
   ``--start-runs`` processes (default 5), each case against torch and the goal
   "within 1.5x torch + 50 ms".

On ``jpeg``, ``tiny`` and ``dispatch``, ``aioloader-auto`` is aioloader with
``num_workers="auto", prefetch="auto"`` (2 workers on a 2-core machine; the window grows
while batches are cheap).

Each (workload, loader, repetition) runs in a fresh Python process, so that the main
process's CPU time (``time.process_time()``: all threads of the main process, the
loader's helper threads included, not its workers; also split by thread from /proc) and
peak RSS (``getrusage``) belong to that loader alone. Throughput and CPU are measured over
epochs 2..N (epoch 1 includes starting the workers; its time to first batch is reported as
the cold start). Tables print medians of the repetitions (default 3) and ratios.

Usage (with ``--reps 2`` the run took 807 s on 2 cores; the default 3 repetitions take about
half as long again)::

    python examples/benchmarks/bench_suite.py --quick           # fewer epochs and repetitions
    python examples/benchmarks/bench_suite.py --json performance.json --png docs/performance.png
    python examples/benchmarks/bench_suite.py --redraw performance.json --png docs/performance.png
    python examples/benchmarks/bench_suite.py --workloads iterable,hfmap,hfstream --reps 3
    python examples/benchmarks/bench_suite.py --workloads start --start-runs 5
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import _bench_proc  # noqa: E402  (beside this script)
import _bench_start  # noqa: E402

TORCH_LOADERS = ("torch-numpy", "torch-persistent", "torch")
# The other loaders users weigh: the best of these and torch's is "the best peer".
PEERS = ("grain", "spdl", "spdl-threads")
# The loaders each workload runs, in interleaving order. The tiny workload also runs
# aioloader with ``seed_samples=False`` (what the default once-a-batch seeding of the global
# generators costs on samples this cheap); the epoch-boundary workload also runs
# it with ``prefetch_next_epoch=False``, to show what the next-epoch prefetch buys.
WORKLOAD_LOADERS: dict[str, tuple[str, ...]] = {
    "jpeg": ("aioloader", "aioloader-auto", "torch-numpy", "torch-persistent", "torch", "grain", "spdl", "bound"),
    "tiny": (
        "aioloader", "aioloader-auto", "aioloader-noseed", "torch-numpy", "torch-persistent", "torch", "grain", "spdl", "bound",
    ),
    "boundary": ("aioloader", "aioloader-noprefetch", "torch-numpy", "torch-persistent", "torch", "grain", "spdl"),
    "dispatch": (
        "aioloader", "aioloader-auto", "aioloader-p16", "torch-numpy", "torch-persistent", "torch", "grain", "spdl", "bound",
    ),
    "cold": ("aioloader", "aioloader-spawned", "torch-numpy", "torch-persistent", "torch", "grain", "spdl"),
    # A torch IterableDataset gives aioloader tensors (torch mode): torch-persistent is
    # torch with the same output, torch-numpy its fastest.
    "iterable": ("aioloader", "torch-numpy", "torch-persistent"),
    "hfmap": ("aioloader", "torch-numpy"),
    "hfstream": ("aioloader", "torch-numpy", "torch-persistent"),
    # Fresh training scripts, one loader's start each (``_bench_start.py``).
    "start": ("aioloader", "torch-numpy"),
}
# What runs without --workloads; the others are named there (or run with "all").
DEFAULT_WORKLOADS = ("jpeg", "tiny", "boundary", "dispatch", "cold")
# Workloads over an iterable dataset: no shuffle (the dataset sets its own order).
ITERABLE_WORKLOADS = ("iterable", "hfstream")
HF_WORKLOADS = ("hfmap", "hfstream")
LOADER_KWARGS: dict[str, dict[str, Any]] = {
    "aioloader-noseed": {"seed_samples": False},
    "aioloader-noprefetch": {"prefetch_next_epoch": False},
    "aioloader-p16": {"prefetch": 16},
    "aioloader-auto": {"num_workers": "auto", "prefetch": "auto"},
}
# Environment of a loader's child process: ``aioloader-spawned`` is aioloader with the
# forkserver multiprocessing spawns (a new interpreter that imports the dataset's modules
# again), instead of the one it forks from a consumer with one thread.
LOADER_ENV: dict[str, dict[str, str]] = {"aioloader-spawned": {"AIOLOADER_FORKSERVER": "spawn"}}
WORKERS = 2
BAR_LABELS = {  # the chart's names of the aioloader variants
    "aioloader-noseed": "aioloader,\nseed_samples=False",
    "aioloader-noprefetch": "aioloader, prefetch_\nnext_epoch=False",
    "aioloader-p16": "aioloader,\nprefetch=16",
    "aioloader-auto": 'aioloader, "auto"',
    "aioloader-spawned": "aioloader, spawned\nforkserver",
}

# --------------------------------------------------------------------------- child side


def _maxrss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


def _rss_now_mb() -> float:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return float("nan")


def _thread_cpu() -> dict[int, float]:
    """CPU seconds of every thread of this process, by native thread id (Linux)."""
    out: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        fields = _bench_proc.stat_fields(f"/proc/self/task/{tid}/stat")
        if fields is not None:
            out[int(tid)] = (int(fields[11]) + int(fields[12])) / tick  # utime + stime
    return out


def _thread_names() -> dict[int, str]:
    import threading

    names = {}
    for t in threading.enumerate():
        if t.native_id is None:
            continue
        name = t.name
        if name.startswith("Thread-") or name.startswith("Dummy-"):
            name = type(t).__name__.lstrip("_")
        names[t.native_id] = name
    return names


def _cpu_by_thread(
    before: dict[int, float], after: dict[int, float], names: dict[int, str]
) -> dict[str, float]:
    by_name: dict[str, float] = {}
    for tid, cpu in after.items():
        name = names.get(tid, "native (no Python thread)")
        by_name[name] = by_name.get(name, 0.0) + cpu - before.get(tid, 0.0)
    return {k: round(v, 3) for k, v in sorted(by_name.items(), key=lambda kv: -kv[1])}


def _make_dataset(spec: dict[str, Any]) -> Any:
    import _bench_datasets as bd

    if spec["workload"] in ("jpeg", "boundary"):
        return bd.jpeg_dataset(spec["root"], spec.get("limit"))
    if spec["workload"] == "cold":
        import gc

        import _bench_torch_dataset  # imports torch, here in the consumer, before the clock starts

        # Importing torch leaves so many new objects that CPython's next full collection
        # (about 100 ms) comes due soon after: which loader's start-up it lands in would
        # depend on how many objects each allocated before, not on the loader. It runs
        # here, before every loader's clock starts.
        gc.collect()
        return _bench_torch_dataset.TorchModuleInts(spec["samples"])
    if spec["workload"] == "iterable":
        import _bench_torch_dataset

        return _bench_torch_dataset.ShardedInts(spec["samples"])
    if spec["workload"] == "hfmap":
        import _bench_hf

        return _bench_hf.hf_map_dataset(spec["samples"])
    if spec["workload"] == "hfstream":
        import _bench_hf

        return _bench_hf.hf_stream_dataset(spec["files"])
    return bd.IntDataset(spec["samples"])


def _count(batch: Any) -> int:
    if isinstance(batch, (tuple, list)):
        return len(batch[1])
    if isinstance(batch, dict):  # a HuggingFace batch: columns of one length
        return len(next(iter(batch.values())))
    return len(batch)


def _torch_collate(kind: str) -> dict[str, Any]:
    """``torch-numpy`` collates into numpy, as aioloader and SPDL do here."""
    if kind != "torch-numpy":
        return {}
    from aioloader import default_collate

    return {"collate_fn": default_collate}


def _run_loader(spec: dict[str, Any]) -> dict[str, Any]:
    """One loader, ``epochs`` epochs back to back, as a training loop would run them."""
    kind = spec["loader"]
    dataset = _make_dataset(spec)
    shuffle = spec["workload"] not in ITERABLE_WORKLOADS
    if kind in TORCH_LOADERS:
        import torch.utils.data as tud

        rss_base = _rss_now_mb()
        t_make = time.perf_counter()
        loader: Any = tud.DataLoader(
            dataset,
            batch_size=spec["batch_size"],
            shuffle=shuffle,
            num_workers=WORKERS,
            persistent_workers=kind != "torch",
            **_torch_collate(kind),
        )
    elif kind in PEERS:
        import _bench_peers

        rss_base = _rss_now_mb()
        t_make = time.perf_counter()
        loader = _bench_peers.make_peer(kind, dataset, spec, WORKERS)
    else:
        import aioloader

        rss_base = _rss_now_mb()
        t_make = time.perf_counter()
        kwargs: dict[str, Any] = {"num_workers": WORKERS, **LOADER_KWARGS.get(kind, {})}
        loader = aioloader.DataLoader(dataset, spec["batch_size"], shuffle=shuffle, seed=0, **kwargs)
    step_s = spec.get("step_ms", 0) / 1000.0
    epochs = []
    threads_before: dict[int, float] = {}
    names: dict[int, str] = {}
    for epoch in range(spec["epochs"]):
        if epoch == 1:
            threads_before = _thread_cpu()
            names = _thread_names()
        t0 = time.perf_counter()
        c0 = time.process_time()
        first = None
        second = None  # the wait for the epoch's second batch
        samples = 0
        batches = 0
        wait = 0.0  # time spent waiting for batches after the first
        it = iter(loader)
        while True:
            w0 = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                break
            w1 = time.perf_counter()
            if first is None:
                first = w1 - t0
            else:
                if second is None:
                    second = w1 - w0
                wait += w1 - w0
            samples += _count(batch)
            batches += 1
            del batch
            if step_s:
                time.sleep(step_s)  # a training step that leaves the CPUs to the workers
        epochs.append(
            {
                "wall_s": time.perf_counter() - t0,
                "cpu_s": time.process_time() - c0,
                "first_batch_s": first,
                "second_batch_wait_s": second,
                "wait_after_first_s": wait,
                "samples": samples,
                "batches": batches,
            }
        )
        if len(epochs) == 1:
            epochs[0]["cold_start_s"] = t0 - t_make + (first or 0.0)
            epochs[0]["epoch_with_start_s"] = t0 - t_make + epochs[0]["wall_s"]
    cpu_threads = _cpu_by_thread(threads_before, _thread_cpu(), {**names, **_thread_names()})
    own_stats = None
    if kind.startswith("aioloader"):
        st = loader.stats()
        own_stats = {
            "first_batch_s": [e.first_batch_s for e in st.epochs],
            "stall_s": [e.stall_s for e in st.epochs],
            "latency_p50_s": st.latency_p50_s,
            "latency_p99_s": st.latency_p99_s,
            "worker_busy": st.worker_busy,
        }
        loader.close()
    elif kind in PEERS:
        loader.close()
    else:
        del loader
    return {
        "epochs": epochs,
        "rss_base_mb": rss_base,
        "peak_rss_mb": _maxrss_mb(),
        "aioloader_stats": own_stats,
        "cpu_by_thread_s": cpu_threads,
    }


def _run_bound(spec: dict[str, Any]) -> dict[str, Any]:
    """Two forked producers, each building half the samples ``epochs - 1`` times."""
    import multiprocessing as mp

    import _bench_datasets as bd
    import numpy as np

    dataset = _make_dataset(spec)
    ctx = mp.get_context("fork")
    order = np.random.default_rng(0).permutation(len(dataset))
    barrier = ctx.Barrier(WORKERS)
    out: Any = ctx.Queue()
    passes = max(1, spec["epochs"] - 1)
    procs = [
        ctx.Process(target=bd.produce_only, args=(dataset, part, passes, barrier, out))
        for part in np.array_split(order, WORKERS)
    ]
    for p in procs:
        p.start()
    reports = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    start = min(r[0] for r in reports)
    end = max(r[1] for r in reports)
    samples = sum(r[2] for r in reports)
    return {"wall_s": end - start, "samples": samples, "passes": passes, "peak_rss_mb": _maxrss_mb()}


def child_main(spec: dict[str, Any]) -> int:
    result = _run_bound(spec) if spec["loader"] == "bound" else _run_loader(spec)
    print("RESULT " + json.dumps(result), flush=True)
    return 0


# -------------------------------------------------------------------------- parent side


def require_torch() -> None:
    """The comparison needs torch; say how to get it rather than installing anything."""
    if importlib.util.find_spec("torch") is None:
        sys.exit(
            "torch is not installed, and this benchmark compares against torch's DataLoader. "
            'Install the bench or dev extra (pip install -e ".[bench]" or ".[dev]", both pin torch==2.13.0) and rerun.'
        )


def require_datasets() -> None:
    """The HuggingFace workloads need ``datasets``; say how to get it."""
    if importlib.util.find_spec("datasets") is None:
        sys.exit(
            "datasets is not installed, and the hfmap and hfstream workloads read HuggingFace datasets. "
            'Install it (pip install datasets, or pip install -e ".[dev]") and rerun.'
        )


def run_child(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)]
    env = {**os.environ, **LOADER_ENV.get(spec["loader"], {})}
    proc = _bench_proc.run(cmd, timeout=timeout, env=env)  # returns once its helpers are gone too
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("RESULT "):
            result: dict[str, Any] = json.loads(line[len("RESULT ") :])
            return result
    raise RuntimeError(
        f"benchmark child failed ({spec['workload']}, {spec['loader']}), exit code {proc.returncode}:\n"
        f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    )


def run_start(cases: tuple[str, ...], runs: int, started: float) -> dict[str, dict[str, list[float]]]:
    """The start workload: ``runs`` fresh processes per case and loader, interleaved, the
    order of the loaders rotating from one run to the next."""
    kinds = WORKLOAD_LOADERS["start"]
    times: dict[str, dict[str, list[float]]] = {k: {c: [] for c in cases} for k in kinds}
    for rep in range(runs):
        order = kinds[rep % len(kinds) :] + kinds[: rep % len(kinds)]
        for case in cases:
            for kind in order:
                res = _bench_start.run_one("torch" if kind.startswith("torch") else "aioloader", case)
                times[kind][case].append(res["first_batch_s"])
                print(
                    f"[{time.perf_counter() - started:6.1f} s] run {rep + 1}/{runs} start {case:<6} {kind:<12} "
                    f"first batch in {res['first_batch_s'] * 1e3:.1f} ms",
                    flush=True,
                )
    return times


def _version(package: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _median(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def summarize(workload: str, runs: dict[str, list[dict[str, Any]]], batch_size: int) -> dict[str, Any]:
    """Medians over repetitions; throughput and CPU over epochs 2..N."""
    rows: dict[str, Any] = {}
    for kind, reps in runs.items():
        if not reps:
            continue
        if kind == "bound":
            rates = [r["samples"] / r["wall_s"] for r in reps]
            rows[kind] = {
                "samples_per_s": _median(rates),
                "batches_per_s": _median([x / batch_size for x in rates]),
                "peak_rss_mb": _median([r["peak_rss_mb"] for r in reps]),
                "reps": len(reps),
            }
            continue
        rates, bps, cpu, cpu_per_batch, firsts, cold, rss, rss_base = [], [], [], [], [], [], [], []
        waits: list[float] = []
        boundary: list[float] = []
        for r in reps:
            steady = r["epochs"][1:] or r["epochs"]
            wall = sum(e["wall_s"] for e in steady)
            samples = sum(e["samples"] for e in steady)
            # Counted where the run counted them: an iterable dataset's workers each end
            # with a short batch, more than the samples over the batch size.
            batches = sum(e.get("batches", -(-e["samples"] // batch_size)) for e in steady)
            rates.append(samples / wall)
            bps.append(batches / wall)
            cpu.append(sum(e["cpu_s"] for e in steady))
            cpu_per_batch.append(cpu[-1] / batches)
            firsts.extend(e["first_batch_s"] for e in r["epochs"][1:])
            waits.extend(e["wait_after_first_s"] / max(1, e["samples"] // batch_size - 1) for e in steady)
            # The epoch boundary, free of the workers' phase: with 2 workers, batches come in
            # staggered pairs (short and long waits alternate), so one wait says more about
            # the phase than about the boundary. The first two waits of an epoch against two
            # mean waits of the same epoch does not depend on it.
            for e in r["epochs"][1:]:
                n = -(-e["samples"] // batch_size)
                if e.get("second_batch_wait_s") is not None and n > 2 and e["wait_after_first_s"] > 0:
                    gap = e["wait_after_first_s"] / (n - 1)
                    boundary.append((e["first_batch_s"] + e["second_batch_wait_s"]) / (2 * gap))
            cold.append(r["epochs"][0]["cold_start_s"])
            rss.append(r["peak_rss_mb"])
            rss_base.append(r["rss_base_mb"])
        row = {
            "samples_per_s": _median(rates),
            "batches_per_s": _median(bps),
            "main_cpu_s": _median(cpu),
            "main_cpu_ms_per_batch": 1000 * (_median(cpu_per_batch) or 0.0),
            "first_batch_epoch2plus_ms": 1000 * (_median(firsts) or 0.0),
            "first_batch_epoch2plus_max_ms": 1000 * max(firsts) if firsts else None,
            "wait_per_batch_after_first_ms": 1000 * (_median(waits) or 0.0),
            "boundary_vs_two_gaps": _median(boundary),
            "epoch_s": _median(
                [sum(e["wall_s"] for e in r["epochs"][1:]) / max(1, len(r["epochs"]) - 1) for r in reps]
            ),
            "cold_start_s": _median(cold),
            "epoch_with_start_s": _median([r["epochs"][0].get("epoch_with_start_s") for r in reps]),
            "peak_rss_mb": _median(rss),
            "rss_before_loader_mb": _median(rss_base),
            "reps": len(reps),
            "epochs": len(reps[0]["epochs"]),
        }
        thread_names = sorted({n for r in reps for n in r.get("cpu_by_thread_s", {})})
        by_thread = {
            n: _median([r.get("cpu_by_thread_s", {}).get(n, 0.0) for r in reps]) for n in thread_names
        }
        by_thread = {n: v for n, v in by_thread.items() if v}
        # Threads that ended before the measurement did (torch's per-iterator feeder
        # threads) are in process_time() but no longer in /proc: count them by difference.
        gone = (row["main_cpu_s"] or 0.0) - sum(v for v in by_thread.values() if v)
        if gone > 0.01:
            by_thread["exited threads, rounding (by difference)"] = round(gone, 3)
        row["main_cpu_by_thread_s"] = dict(sorted(by_thread.items(), key=lambda kv: -kv[1]))
        stats = [r["aioloader_stats"] for r in reps if r.get("aioloader_stats")]
        if stats:
            row["own_first_batch_epoch2plus_ms"] = 1000 * (
                _median([x for s in stats for x in s["first_batch_s"][1:]]) or 0.0
            )
            row["own_latency_p50_ms"] = 1000 * (_median([s["latency_p50_s"] for s in stats]) or 0.0)
            row["own_latency_p99_ms"] = 1000 * (_median([s["latency_p99_s"] for s in stats]) or 0.0)
            row["own_worker_busy"] = _median([s["worker_busy"] for s in stats])
            row["own_stall_epoch2plus_ms"] = 1000 * (
                _median([x for s in stats for x in s["stall_s"][1:]]) or 0.0
            )
        rows[kind] = row
    out: dict[str, Any] = {"rows": rows, "ratios": {}}
    torch_rows = {k: v for k, v in rows.items() if k in TORCH_LOADERS}
    if torch_rows:
        best_kind = max(torch_rows, key=lambda k: torch_rows[k]["samples_per_s"])
        out["torch_best"] = best_kind
    peer_rows = {k: v for k, v in rows.items() if k in TORCH_LOADERS or k in PEERS}
    if peer_rows:
        out["peer_best"] = max(peer_rows, key=lambda k: peer_rows[k]["samples_per_s"])
    for kind, aio in rows.items():
        if not kind.startswith("aioloader"):
            continue
        ratios: dict[str, float] = {}
        if torch_rows:
            best = torch_rows[out["torch_best"]]
            ratios["vs_torch_best"] = aio["samples_per_s"] / best["samples_per_s"]
            ratios["cpu_vs_torch_best"] = aio["main_cpu_s"] / best["main_cpu_s"]
            ratios["cpu_vs_torch_min"] = aio["main_cpu_s"] / min(v["main_cpu_s"] for v in torch_rows.values())
            if best["first_batch_epoch2plus_ms"]:  # none where a run has one epoch
                ratios["first_batch_vs_torch_best"] = (
                    aio["first_batch_epoch2plus_ms"] / best["first_batch_epoch2plus_ms"]
                )
        if peer_rows:
            best = peer_rows[out["peer_best"]]
            ratios["vs_peer_best"] = aio["samples_per_s"] / best["samples_per_s"]
            ratios["cpu_vs_peer_best"] = aio["main_cpu_s"] / best["main_cpu_s"]
            ratios["cpu_vs_peer_min"] = aio["main_cpu_s"] / min(v["main_cpu_s"] for v in peer_rows.values())
            ratios["first_batch_vs_peer_min"] = aio["first_batch_epoch2plus_ms"] / max(
                1e-6, min(v["first_batch_epoch2plus_ms"] for v in peer_rows.values())
            )
        if peer_rows:
            ratios["cold_vs_peer_min"] = aio["cold_start_s"] / min(v["cold_start_s"] for v in peer_rows.values())
        if "bound" in rows:
            ratios["vs_bound"] = aio["samples_per_s"] / rows["bound"]["samples_per_s"]
        out["ratios"][kind] = ratios
    return out


def _skipped_rows(summary: dict[str, Any], empty_cells: int) -> list[str]:
    """One row per contender that did not run because its package is missing."""
    return [
        f"| {kind} | not installed (`pip install {pkg}`) |" + " |" * empty_cells
        for kind, pkg in summary.get("skipped", {}).items()
    ]


def fmt_table(name: str, summary: dict[str, Any], unit: str) -> str:
    key = "samples_per_s" if unit == "images/s" else "batches_per_s"
    lines = [
        f"{name}",
        f"| loader | {unit} | first batch, epochs 2+ (median / max, ms) | cold start (s) "
        "| main-process CPU (s) | CPU per batch (ms) | peak RSS (MB) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for kind, row in summary["rows"].items():
        if kind == "bound":
            lines.append(f"| bound (produce only) | {row[key]:,.0f} | | | | | |")
            continue
        lines.append(
            f"| {kind} | {row[key]:,.0f} | {row['first_batch_epoch2plus_ms']:.1f} / "
            f"{row['first_batch_epoch2plus_max_ms']:.1f} | {row['cold_start_s']:.2f} | "
            f"{row['main_cpu_s']:.2f} | {row['main_cpu_ms_per_batch']:.2f} | {row['peak_rss_mb']:.0f} |"
        )
    lines.extend(_skipped_rows(summary, 5))
    notes = []
    for kind, r in summary["ratios"].items():
        parts = []
        if "vs_torch_best" in r:
            parts.append(f"{r['vs_torch_best']:.2f}x torch best ({summary['torch_best']}) throughput")
            parts.append(f"{r['cpu_vs_torch_best']:.2f}x its main-process CPU")
        if "vs_peer_best" in r and summary["peer_best"] not in TORCH_LOADERS:
            parts.append(f"{r['vs_peer_best']:.2f}x the best peer ({summary['peer_best']}) throughput")
            parts.append(f"{r['cpu_vs_peer_best']:.2f}x its main-process CPU")
        if "vs_bound" in r:
            parts.append(f"{r['vs_bound']:.2f}x the bound")
        if parts:
            notes.append(f"{kind}: " + ", ".join(parts))
    edges = {k: r["boundary_vs_two_gaps"] for k, r in summary["rows"].items() if r.get("boundary_vs_two_gaps")}
    if edges:
        notes.append(
            "epoch boundary, the first two waits of epochs 2+ against two steady gaps (median): "
            + ", ".join(f"{k} {v:.2f}x" for k, v in edges.items())
        )
    return "\n".join(lines + (["", *notes] if notes else []))


def fmt_threads(name: str, summary: dict[str, Any]) -> str:
    """Main-process CPU seconds (epochs 2+) split by thread, one line per loader."""
    lines = [f"{name}", "| loader | total (s) | by thread (s) |", "|---|---:|---|"]
    for kind, row in summary["rows"].items():
        if "main_cpu_by_thread_s" not in row:
            continue
        parts = ", ".join(f"{n} {v:.2f}" for n, v in row["main_cpu_by_thread_s"].items())
        lines.append(f"| {kind} | {row['main_cpu_s']:.2f} | {parts} |")
    return "\n".join(lines)


def fmt_boundary(name: str, summary: dict[str, Any], step_ms: float) -> str:
    lines = [
        f"{name}",
        f"| loader | first batch of epochs 2-5, median (ms) | max (ms) | wait per later batch, median (ms) "
        f"| epoch time incl. {step_ms:.0f} ms steps (s) |",
        "|---|---:|---:|---:|---:|",
    ]
    for kind, row in summary["rows"].items():
        batches = row["batches_per_s"]
        lines.append(
            f"| {kind} | {row['first_batch_epoch2plus_ms']:.1f} | {row['first_batch_epoch2plus_max_ms']:.1f} "
            f"| {row['wait_per_batch_after_first_ms']:.2f} | {row['epoch_s']:.2f} |"
            if batches
            else f"| {kind} | | | | |"
        )
    lines.extend(_skipped_rows(summary, 3))
    return "\n".join(lines)


def fmt_cold(name: str, summary: dict[str, Any]) -> str:
    """Construction to first batch of a fresh process's first loader, the dataset's
    module (and so torch) already imported by the consumer."""
    rows = summary["rows"]
    peers = [row["cold_start_s"] for kind, row in rows.items() if kind in TORCH_LOADERS or kind in PEERS]
    fastest = min(peers) if peers else None
    lines = [name, "", "| loader | construction to first batch (s) | vs the fastest peer |", "|---|---:|---:|"]
    for kind, row in rows.items():
        ratio = f"{row['cold_start_s'] / fastest:.2f}x" if fastest else ""
        lines.append(f"| {kind} | {row['cold_start_s']:.3f} | {ratio} |")
    lines.extend(_skipped_rows(summary, 1))
    return "\n".join(lines)


def fmt_epoch_with_start(name: str, summary: dict[str, Any]) -> str:
    """A fresh process's one epoch, from the loader's construction to its last batch."""
    rows = summary["rows"]
    peers = [row["epoch_with_start_s"] for kind, row in rows.items() if kind in TORCH_LOADERS or kind in PEERS]
    fastest = min(peers) if peers else None
    lines = [
        name,
        "",
        "| loader | construction to the epoch's end (s) | of which to the first batch (s) | vs the fastest peer |",
        "|---|---:|---:|---:|",
    ]
    for kind, row in rows.items():
        ratio = f"{row['epoch_with_start_s'] / fastest:.2f}x" if fastest else ""
        lines.append(f"| {kind} | {row['epoch_with_start_s']:.3f} | {row['cold_start_s']:.3f} | {ratio} |")
    lines.extend(_skipped_rows(summary, 2))
    return "\n".join(lines)


def draw_png(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {
        "aioloader": "#2a7ab0",
        "aioloader-noseed": "#7fb3d5",
        "aioloader-noprefetch": "#9dc3e6",
        "aioloader-p16": "#5499c7",
        "aioloader-auto": "#1b4f72",
        "aioloader-spawned": "#a9cce3",
        "torch-numpy": "#a04000",
        "torch-persistent": "#e08a2c",
        "torch": "#f2c14e",
        "grain": "#3a9e5c",
        "spdl": "#b04a8c",
        "spdl-threads": "#d68fbf",
        "bound": "#8a8a8a",
    }
    panels = []
    wl = results["workloads"]
    if "jpeg" in wl:
        rows = wl["jpeg"]["rows"]
        panels.append(("JPEG workload: images/s", {k: v["samples_per_s"] for k, v in rows.items()}, False))
    if "boundary" in wl or "jpeg" in wl:
        b_rows = wl["boundary" if "boundary" in wl else "jpeg"]["rows"]
        panels.append(
            (
                "Epoch boundary: first batch of\nepochs 2-5, median ms (log)",
                {k: max(v["first_batch_epoch2plus_ms"], 0.01) for k, v in b_rows.items() if k != "bound"},
                True,
            )
        )
    if "jpeg" in wl:
        rows = wl["jpeg"]["rows"]
        panels.append(
            (
                "JPEG: main-process CPU s\n(epochs 2+, lower is better)",
                {k: v["main_cpu_s"] for k, v in rows.items() if k != "bound"},
                False,
            )
        )
    for name, title in (
        ("tiny", "Tiny workload: batches/s"),
        ("dispatch", "Dispatch ceiling: batches/s"),
        ("iterable", "Iterable dataset: batches/s"),
        ("hfmap", "HF datasets, map-style:\nbatches/s"),
    ):
        if name in wl:
            rows = wl[name]["rows"]
            panels.append((title, {k: v["batches_per_s"] for k, v in rows.items() if k != "bound"}, False))
    if "cold" in wl:
        rows = wl["cold"]["rows"]
        panels.append(
            (
                "Cold start, dataset imports\ntorch: construction to first\nbatch, s (log)",
                {k: v["cold_start_s"] for k, v in rows.items()},
                True,
            )
        )
    if "hfstream" in wl:
        rows = wl["hfstream"]["rows"]
        panels.append(
            (
                "HF streaming, one epoch\nincluding start, s\n(lower is better)",
                {k: v["epoch_with_start_s"] for k, v in rows.items()},
                False,
            )
        )
    if not panels:
        return
    # Drawn for the docs' content column (about 690 px wide at a 1280 px window): 9 inches
    # shown 690 px wide puts 11 pt text at about 11.7 px. Horizontal bars, so that the
    # loaders' names never overlap; each bar carries its value, so no value axis. A
    # title's lines stay within about 30 characters, the width of its panel.
    font = 11
    ncols = 1 if len(panels) == 1 else 2
    nrows = -(-len(panels) // ncols)
    most = max(len(values) for _, values, _ in panels)
    fig, axes = plt.subplots(
        nrows, ncols, figsize=(9.0, nrows * (0.36 * most + 1.0) + 0.4), squeeze=False
    )
    for ax, (title, values, log) in zip(axes.flat, panels, strict=False):
        names = list(values)
        vals = [values[n] for n in names]
        bars = ax.barh(range(len(names)), vals, color=[colors.get(n, "#555") for n in names])
        ax.set_yticks(range(len(names)))
        ax.set_yticklabels([BAR_LABELS.get(n, n) for n in names], fontsize=font)
        ax.invert_yaxis()  # the first loader on top
        ax.set_title(title, fontsize=font + 1)
        if log:
            ax.set_xscale("log")
        ax.set_xticks([])
        ax.minorticks_off()
        for side in ("top", "right", "bottom"):
            ax.spines[side].set_visible(False)
        for bar, v in zip(bars, vals, strict=True):
            label = f"{v:,.0f}" if v >= 100 else (f"{v:.1f}" if v >= 1 else f"{v:.2f}")
            ax.annotate(
                label, (v, bar.get_y() + bar.get_height() / 2), xytext=(3, 0),
                textcoords="offset points", ha="left", va="center", fontsize=font,
            )  # fmt: skip
        lo, hi = min(vals), max(vals)
        if log:
            ax.set_xlim(lo / 2, hi * 12)  # room for the labels on a log axis
        else:
            ax.set_xlim(0, hi * 1.3)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle(
        f"aioloader vs torch, Grain and SPDL, {WORKERS} workers, {results['machine']['cpus']} cores "
        f"(medians; {results['mode']} mode)",
        fontsize=font + 1,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=150)  # sharp on high-density screens too
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer repetitions and epochs (about 5 min)")
    parser.add_argument(
        "--workloads",
        default=",".join(DEFAULT_WORKLOADS),
        help=f"comma-separated, or all: {', '.join(WORKLOAD_LOADERS)} (default {','.join(DEFAULT_WORKLOADS)})",
    )
    parser.add_argument("--reps", type=int, default=None, help="repetitions per loader (default 3; quick 2)")
    parser.add_argument("--epochs", type=int, default=None, help="JPEG epochs per run (default 5; quick 3)")
    parser.add_argument("--images", type=int, default=2048, help="synthetic JPEGs")
    parser.add_argument("--tiny-samples", type=int, default=200_000)
    parser.add_argument("--dispatch-samples", type=int, default=4_000)
    parser.add_argument("--iterable-samples", type=int, default=100_000)
    parser.add_argument("--hfmap-rows", type=int, default=20_000)
    parser.add_argument("--hfstream-rows", type=int, default=4_000)
    parser.add_argument("--start-runs", type=int, default=5, help="fresh processes per start case and loader")
    parser.add_argument(
        "--start-cases",
        default=",".join(_bench_start.DEFAULT_CASES),
        help=f"start cases, comma-separated: {', '.join(_bench_start.ALL_CASES)}",
    )
    parser.add_argument(
        "--boundary-images", type=int, default=512, help="images per epoch in the epoch-boundary runs"
    )
    parser.add_argument(
        "--step-ms",
        type=float,
        default=80.0,
        help="simulated training step per batch in the epoch-boundary runs (slower than every loader)",
    )
    parser.add_argument("--cache", type=Path, default=None, help="JPEG folder (default ~/.cache/aioloader)")
    parser.add_argument("--json", type=Path, default=None, help="write all results here")
    parser.add_argument(
        "--png", type=Path, default=None, help="draw the chart here (e.g. docs/performance.png)"
    )
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--redraw", type=Path, default=None, help="only draw --png from this --json file")
    args = parser.parse_args(argv)
    # Every loader runs as users' programs do, with bytecode caching: where the environment
    # turns it off (PYTHONDONTWRITEBYTECODE, as on this project's machine), each fresh
    # interpreter (every child, a spawned forkserver, Grain's workers) compiles its modules
    # from source, which weighs on start-up times, and the garbage it leaves moves the
    # cyclic collector's first full pass into a loader's cold start.
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    if args.child is not None:
        return child_main(json.loads(args.child))
    if args.redraw is not None:
        draw_png(json.loads(args.redraw.read_text()), args.png or Path("performance.png"))
        return 0

    require_torch()
    from aioloader._formats.synthetic import default_cache, make_synthetic_jpegs

    reps = args.reps or (2 if args.quick else 3)
    jpeg_epochs = args.epochs or (3 if args.quick else 5)
    tiny_epochs = 3 if args.quick else 4
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    if workloads == ["all"]:
        workloads = list(WORKLOAD_LOADERS)
    unknown = [w for w in workloads if w not in WORKLOAD_LOADERS]
    if unknown:
        parser.error(f"unknown workloads {unknown}: choose from {', '.join(WORKLOAD_LOADERS)}, or all")
    if any(w in HF_WORKLOADS for w in workloads):
        require_datasets()
    try:
        start_cases = _bench_start.parse_cases(args.start_cases)
    except ValueError as e:
        parser.error(str(e))
    specs: dict[str, dict[str, Any]] = {}
    root = (args.cache or default_cache()) / f"bench-jpegs-{args.images}"
    if "jpeg" in workloads or "boundary" in workloads:
        t0 = time.perf_counter()
        make_synthetic_jpegs(root, args.images)
        print(f"JPEGs: {args.images} in {root} (ready in {time.perf_counter() - t0:.1f} s)", flush=True)
    if "jpeg" in workloads:
        specs["jpeg"] = {"workload": "jpeg", "root": str(root), "batch_size": 64, "epochs": jpeg_epochs}
    # Ints, as many as asked for: batches of 256 (loader overhead) and of 1 (dispatch ceiling).
    for name, samples, batch_size in (("tiny", args.tiny_samples, 256), ("dispatch", args.dispatch_samples, 1)):
        if name in workloads:
            specs[name] = {"workload": name, "samples": samples, "batch_size": batch_size, "epochs": tiny_epochs}
    if "cold" in workloads:
        specs["cold"] = {"workload": "cold", "samples": 4096, "batch_size": 64, "epochs": 2}
    if "iterable" in workloads:
        specs["iterable"] = {
            "workload": "iterable", "samples": args.iterable_samples, "batch_size": 64, "epochs": tiny_epochs,
        }  # fmt: skip
    if "hfmap" in workloads:
        specs["hfmap"] = {"workload": "hfmap", "samples": args.hfmap_rows, "batch_size": 32, "epochs": tiny_epochs}
    if "hfstream" in workloads:
        import _bench_hf

        shards_dir = (args.cache or default_cache()) / f"bench-hf-parquet-{args.hfstream_rows}"
        files = _bench_hf.write_parquet_shards(shards_dir, args.hfstream_rows, 4)
        specs["hfstream"] = {"workload": "hfstream", "files": files, "batch_size": 32, "epochs": 1}
    if "boundary" in workloads:
        specs["boundary"] = {
            "workload": "boundary",
            "root": str(root),
            "limit": args.boundary_images,
            "batch_size": 64,
            "epochs": 5,
            "step_ms": args.step_ms,
        }

    import _bench_peers

    # A peer whose package is missing is left out of every workload and named in the tables.
    skipped = {
        k: pkg for k in {k for w in specs for k in WORKLOAD_LOADERS[w]} if (pkg := _bench_peers.missing_package(k))
    }
    for kind, pkg in sorted(skipped.items()):
        print(f"{kind}: skipped, {pkg} is not installed (pip install {pkg}, or the bench extra)", flush=True)
    loaders = {w: tuple(k for k in WORKLOAD_LOADERS[w] if k not in skipped) for w in specs}
    raw: dict[str, dict[str, list[dict[str, Any]]]] = {w: {k: [] for k in loaders[w]} for w in specs}
    started = time.perf_counter()
    for rep in range(reps):
        for workload, base in specs.items():
            # Interleaved: every loader once per repetition; the order rotates so that no
            # loader always runs first (or right after the heaviest one).
            kinds = loaders[workload]
            order = kinds[rep % len(kinds) :] + kinds[: rep % len(kinds)]
            for kind in order:
                spec = {**base, "loader": kind}
                t0 = time.perf_counter()
                res = run_child(spec, timeout=600)
                raw[workload][kind].append(res)
                print(
                    f"[{time.perf_counter() - started:6.1f} s] rep {rep + 1}/{reps} {workload:<4} {kind:<16} "
                    f"done in {time.perf_counter() - t0:.1f} s",
                    flush=True,
                )
    start_times = run_start(start_cases, args.start_runs, started) if "start" in workloads else None

    import torch

    results: dict[str, Any] = {
        "mode": "quick" if args.quick else "full",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            **{pkg: _version(pkg) for pkg in ("grain", "spdl", "datasets")},
            "platform": platform.platform(),
        },
        "config": {"workers": WORKERS, "reps": reps, "specs": specs},
        "workloads": {},
        "raw": raw,
    }
    for workload, spec in specs.items():
        results["workloads"][workload] = summarize(workload, raw[workload], spec["batch_size"])
        results["workloads"][workload]["skipped"] = {
            k: skipped[k] for k in WORKLOAD_LOADERS[workload] if k in skipped
        }

    print()
    if "jpeg" in results["workloads"]:
        print(fmt_table("## JPEG workload (epochs 2+)", results["workloads"]["jpeg"], "images/s"))
        print()
    if "tiny" in results["workloads"]:
        print(fmt_table("## Tiny workload (epochs 2+)", results["workloads"]["tiny"], "batches/s"))
        print()
    if "dispatch" in results["workloads"]:
        print(fmt_table("## Dispatch ceiling, batch 1 (epochs 2+)", results["workloads"]["dispatch"], "batches/s"))
        print()
    for workload in ("jpeg", "tiny", "dispatch"):
        if workload in results["workloads"]:
            print(fmt_threads(f"## Main-process CPU by thread, {workload}", results["workloads"][workload]))
            print()
    if "boundary" in results["workloads"]:
        print(fmt_boundary("## Epoch boundary", results["workloads"]["boundary"], args.step_ms))
        print()
    if "cold" in results["workloads"]:
        print(fmt_cold("## Cold start, a dataset module that imports torch", results["workloads"]["cold"]))
        print()
    for workload, title in (
        ("iterable", "## Iterable dataset, batch 64 (epochs 2+)"),
        ("hfmap", "## HF datasets, map-style, batch 32 (epochs 2+)"),
    ):
        if workload in results["workloads"]:
            print(fmt_table(title, results["workloads"][workload], "batches/s"))
            print()
            print(fmt_threads(f"## Main-process CPU by thread, {workload}", results["workloads"][workload]))
            print()
    if "hfstream" in results["workloads"]:
        print(fmt_epoch_with_start("## HF streaming, 4 parquet shards: one epoch, start included",
                                   results["workloads"]["hfstream"]))  # fmt: skip
        print()
    if start_times is not None:
        summary = _bench_start.summarize(start_times, "torch-numpy")
        summary["config"] = {"runs": args.start_runs, "cases": list(start_cases), "samples": 4096, "batch_size": 32}
        results["workloads"]["start"] = summary
        results["raw"]["start"] = start_times
        print(_bench_start.fmt("## Start in a fresh training script (issue 49)", summary, "torch-numpy"))
        print()
    print(f"total {time.perf_counter() - started:.0f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))
        print(f"wrote {args.json}")
    if args.png:
        draw_png(results, args.png)
        print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A/B of two checkouts of aioloader on the loader's own cost: batches/s and CPU a batch.

Runs the suite's tiny workload (ints, batch 256) or dispatch ceiling (ints, batch 1)
through ``for`` (or ``async for``) in fresh processes, alternating the two checkouts
(A B, B A, ...), so that both sides see the same phases of a noisy machine. Each run
reports epochs 2..N: batches/s, the main process's CPU a batch (all its threads) and
the workers' CPU a batch::

    git worktree add /tmp/before <commit>
    python examples/benchmarks/bench_ab.py /tmp/before . --workload tiny --pairs 4
    python examples/benchmarks/bench_ab.py /tmp/before . --workload dispatch --pairs 4

``--workload cold`` measures the suite's cold start instead: a fresh process that has
imported a dataset module importing torch, from the loader's construction to its first
batch (4,096 ints, batch 64, 2 workers). There ``torch`` may stand for a checkout: that
side runs torch's ``DataLoader`` (``num_workers=2``). With ``--pairs`` of 10 or more the
medians settle to about a millisecond here::

    python examples/benchmarks/bench_ab.py /tmp/before . torch --workload cold --pairs 12

``--workload pickled`` sends 108 KB pickled replies (batches of 64 samples of 1.7 KB
bytes, ``transport="pickle"``); ``--workload jpeg`` is the suite's JPEG workload (2,048
synthetic JPEGs, decode + crop + flip, batch 64) and reports images/s::

    python examples/benchmarks/bench_ab.py /tmp/before . --workload pickled --pairs 4
    python examples/benchmarks/bench_ab.py /tmp/before . --workload jpeg --pairs 3

``--workload iterable`` is a torch ``IterableDataset`` of 100,000 ints, batch 64: each
of the 2 workers iterates its shard and sends its batches while the consumer grants
credit::

    python examples/benchmarks/bench_ab.py /tmp/before . --workload iterable --pairs 4

``--workload start`` is the suite's start workload (issue 49): each run is a fresh
training script (``_train_start.py``: torch and numpy imported, a dataset of 4,096
``np.full(8, i)`` in ``__main__``, 2 workers, batch 32), timed from a loader's
construction to its first batch, in each of ``--cases`` (default ``thread,second,plain``;
``tqdm`` too on request). ``--pairs`` defaults to 5 here. A third side ``torch`` runs
torch's ``DataLoader`` (fork, persistent workers, a numpy collate), and each checkout is
then set against it and the goal "within 1.5x torch + 50 ms"::

    python examples/benchmarks/bench_ab.py /tmp/before . torch --workload start --pairs 5

``--one`` measures the aioloader that ``import aioloader`` finds (what each run does).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _bench_proc  # noqa: E402  (beside this script)
import _bench_start  # noqa: E402

WORKLOADS = {
    "tiny": (200_000, 256),
    "dispatch": (20_000, 1),
    "cold": (4_096, 64),
    "pickled": (12_800, 64),
    "jpeg": (2_048, 64),
    "iterable": (100_000, 64),
    "start": (4_096, 32),
}


class Blobs:
    """Samples of 1.7 KB of bytes: a batch of 64, kept a list, pickles to about 108 KB."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> bytes:
        return index.to_bytes(8, "little") * 212


def as_list(samples: list[Any]) -> list[Any]:
    return samples


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cold(use_torch: bool) -> str:
    """Construction to the first batch, in this fresh process (the suite's cold row)."""
    import gc

    import _bench_torch_dataset  # imports torch: before the clock, as the suite does

    if use_torch:
        import torch.utils.data as tud
    else:
        import aioloader
    gc.collect()  # torch's import leaves a full collection due: not inside the clock
    n, bs = WORKLOADS["cold"]
    dataset = _bench_torch_dataset.TorchModuleInts(n)
    loader: Any
    t0 = time.perf_counter()
    if use_torch:
        loader = tud.DataLoader(dataset, batch_size=bs, shuffle=True, num_workers=2)
    else:
        loader = aioloader.DataLoader(dataset, bs, shuffle=True, seed=0, num_workers=2)
    it = iter(loader)
    next(it)
    ms = (time.perf_counter() - t0) * 1e3
    del it
    if not use_torch:
        loader.close()
    return f"cold start {ms:6.1f} ms"


def one(workload: str, face: str, epochs: int, samples: int | None = None) -> str:
    import _bench_datasets as bd

    import aioloader

    n, bs = WORKLOADS[workload]
    n = samples or n
    loader: Any
    if workload == "pickled":
        loader = aioloader.DataLoader(
            Blobs(n), bs, shuffle=True, seed=0, num_workers=2, transport="pickle", collate_fn=as_list
        )
    elif workload == "jpeg":
        from aioloader._formats.synthetic import default_cache, make_synthetic_jpegs

        root = default_cache() / f"bench-jpegs-{n}"
        make_synthetic_jpegs(root, n)
        loader = aioloader.DataLoader(bd.jpeg_dataset(str(root)), bs, shuffle=True, seed=0, num_workers=2)
    elif workload == "iterable":  # a torch IterableDataset: one shard task per worker
        import _bench_torch_dataset as btd

        loader = aioloader.DataLoader(btd.ShardedInts(n), bs, num_workers=2)
    else:
        loader = aioloader.DataLoader(bd.IntDataset(n), bs, shuffle=True, seed=0, num_workers=2)

    async def drain_async() -> int:
        return sum([1 async for _ in loader])

    def drain() -> int:
        return sum(1 for _ in loader) if face == "for" else asyncio.run(drain_async())

    drain()  # epoch 1: the workers start
    pids = loader.worker_pids()
    w0, c0, t0 = sum(map(_cpu_s, pids)), time.process_time(), time.perf_counter()
    batches = sum(drain() for _ in range(epochs - 1))
    wall = time.perf_counter() - t0
    main_us = (time.process_time() - c0) / batches * 1e6
    workers_us = (sum(map(_cpu_s, pids)) - w0) / batches * 1e6
    loader.close()
    extra = f"  {batches * bs / wall:6.0f} images/s" if workload == "jpeg" else ""
    return f"{batches / wall:7.0f} batches/s  main {main_us:4.0f} us a batch  workers {workers_us:4.0f} us a batch{extra}"


def start_ab(
    labelled: list[tuple[str, str]], cases: tuple[str, ...], pairs: int, samples: int | None
) -> None:
    """The start workload: each side, case and pair in a fresh training script."""
    times: dict[str, dict[str, list[float]]] = {f"{label} ({tree})": {} for label, tree in labelled}
    for k in range(pairs):
        order = labelled[k % len(labelled) :] + labelled[: k % len(labelled)]
        for case in cases:
            for label, tree in order:
                if tree == "torch":
                    res = _bench_start.run_one("torch", case, samples=samples)
                else:
                    path = str(Path(tree).resolve())
                    res = _bench_start.run_one("aioloader", case, pythonpath=path, samples=samples)
                ms = res["first_batch_s"] * 1e3
                print(f"{label} {case:<6} first batch {ms:7.1f} ms", flush=True)
                times[f"{label} ({tree})"].setdefault(case, []).append(res["first_batch_s"])
    torch_side = next((f"{label} (torch)" for label, tree in labelled if tree == "torch"), None)
    summary = _bench_start.summarize(times, torch_side)
    print()
    print(_bench_start.fmt("start: construction to first batch", summary, torch_side))
    a, b = (f"{label} ({tree})" for label, tree in labelled[:2])
    for case, row in summary["cases"].items():
        print(f"{case}: B/A {row[b]['median_s'] / row[a]['median_s']:.3f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "checkouts", nargs="*", help="two source trees (A and B), each with aioloader/ in it; with cold, a third may be torch"
    )
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="tiny")
    ap.add_argument("--face", choices=("for", "async-for"), default="for")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--pairs", type=int, default=None, help="default 3; 5 with start")
    ap.add_argument(
        "--cases",
        default=",".join(_bench_start.DEFAULT_CASES),
        help=f"with start: comma-separated, of {', '.join(_bench_start.ALL_CASES)}",
    )
    ap.add_argument("--samples", type=int, default=None, help="instead of the workload's own count")
    ap.add_argument("--one", action="store_true", help="one run of the importable aioloader")
    ap.add_argument("--torch", action="store_true", help="with --one and cold: torch's DataLoader")
    args = ap.parse_args()
    if args.one and args.workload == "start":
        ap.error("start runs _train_start.py itself: python _train_start.py --loader aioloader --case thread")
    if args.one:
        line = cold(args.torch) if args.workload == "cold" else one(args.workload, args.face, args.epochs, args.samples)
        print(line, flush=True)
        return
    sides = list(args.checkouts)
    if len(sides) != 2 and not (args.workload in ("cold", "start") and len(sides) == 3 and sides[2] == "torch"):
        ap.error("give two checkouts (with --workload cold or start, a third may be torch), or --one")
    if args.pairs is None:
        args.pairs = 5 if args.workload == "start" else 3
    if args.workload == "start":
        try:
            cases = _bench_start.parse_cases(args.cases)
        except ValueError as e:
            ap.error(str(e))
        start_ab(list(zip("ABC", sides, strict=False)), cases, args.pairs, args.samples)
        return
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--one", "--workload", args.workload]
    cmd += ["--face", args.face, "--epochs", str(args.epochs)]
    if args.samples:
        cmd += ["--samples", str(args.samples)]
    colds: dict[str, list[float]] = {}
    rates: dict[str, list[float]] = {}
    mains: dict[str, list[float]] = {}
    labelled = list(zip("ABC", sides, strict=False))
    for k in range(args.pairs):
        # The order rotates: a run is slowed by what the run before it left exiting, so
        # each side follows each other side equally often.
        for label, tree in labelled[k % len(labelled) :] + labelled[: k % len(labelled)]:
            if tree == "torch":
                run_env, run = dict(env), [*cmd, "--torch"]
            else:
                run_env, run = dict(env, PYTHONPATH=str(Path(tree).resolve())), cmd
            out = _bench_proc.run(run, env=run_env, timeout=300)
            out.check_returncode()
            line = [x for x in out.stdout.splitlines() if "batches/s" in x or "cold start" in x][-1]
            print(f"{label} {line}", flush=True)
            if args.workload == "cold":
                colds.setdefault(f"{label} ({tree})", []).append(float(line.split()[2]))
            else:
                words = line.split()
                rates.setdefault(label, []).append(float(words[0]))
                mains.setdefault(label, []).append(float(words[3]))
    for side, values in colds.items():
        print(f"{side}: median {statistics.median(values):.1f} ms, range {min(values):.1f}-{max(values):.1f}")
    if "A" in rates and "B" in rates:
        ra, rb = statistics.median(rates["A"]), statistics.median(rates["B"])
        ma, mb = statistics.median(mains["A"]), statistics.median(mains["B"])
        print(f"medians: A {ra:.0f} batches/s, {ma:.0f} us main CPU a batch; B {rb:.0f}, {mb:.0f}")
        print(f"B/A: {rb / ra:.3f}x batches/s, {mb / ma:.3f}x main CPU a batch")


if __name__ == "__main__":
    main()

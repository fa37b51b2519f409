"""A/B of two checkouts of aioloader on the loader's own cost: batches/s and CPU a batch.

Runs the suite's tiny workload (ints, batch 256) or dispatch ceiling (ints, batch 1)
through ``for`` (or ``async for``) in fresh processes, alternating the two checkouts
(A B A B ...), so that both sides see the same phases of a noisy machine. Each run
reports epochs 2..N: batches/s, the main process's CPU a batch (all its threads) and
the workers' CPU a batch::

    git worktree add /tmp/before <commit>
    python examples/benchmarks/bench_ab.py /tmp/before . --workload tiny --pairs 4
    python examples/benchmarks/bench_ab.py /tmp/before . --workload dispatch --pairs 4

``--one`` measures the aioloader that ``import aioloader`` finds (what each run does).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
WORKLOADS = {"tiny": (200_000, 256), "dispatch": (20_000, 1)}


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one(workload: str, face: str, epochs: int, samples: int | None = None) -> str:
    sys.path.insert(0, str(HERE))
    import _bench_datasets as bd

    import aioloader

    n, bs = WORKLOADS[workload]
    n = samples or n
    loader: Any = aioloader.DataLoader(bd.IntDataset(n), bs, shuffle=True, seed=0, num_workers=2)

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
    return f"{batches / wall:7.0f} batches/s  main {main_us:4.0f} us a batch  workers {workers_us:4.0f} us a batch"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkouts", nargs="*", help="two source trees (A and B), each with aioloader/ in it")
    ap.add_argument("--workload", choices=sorted(WORKLOADS), default="tiny")
    ap.add_argument("--face", choices=("for", "async-for"), default="for")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--samples", type=int, default=None, help="instead of the workload's own count")
    ap.add_argument("--one", action="store_true", help="one run of the importable aioloader")
    args = ap.parse_args()
    if args.one:
        print(one(args.workload, args.face, args.epochs, args.samples), flush=True)
        return
    if len(args.checkouts) != 2:
        ap.error("give two checkouts (or --one)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--one", "--workload", args.workload]
    cmd += ["--face", args.face, "--epochs", str(args.epochs)]
    if args.samples:
        cmd += ["--samples", str(args.samples)]
    for _ in range(args.pairs):
        for label, tree in zip("AB", args.checkouts, strict=True):
            run_env = dict(env, PYTHONPATH=str(Path(tree).resolve()))
            out = subprocess.run(cmd, env=run_env, capture_output=True, text=True, timeout=300, check=True)
            line = [x for x in out.stdout.splitlines() if "batches/s" in x][-1]
            print(f"{label} {line}", flush=True)


if __name__ == "__main__":
    main()

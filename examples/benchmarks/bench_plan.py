"""What it costs to start a shuffled epoch: aioloader's plan against torch's samplers.

For each dataset length, and each implementation, a fresh Python process imports what it
needs (``torch``; ``aioloader`` and ``numpy.random``), then times building the epoch's plan and computing its first batch of 256 indices,
and reads from ``/proc/self/status`` how much resident memory that added (the peak,
``VmHWM``, reset just before through ``/proc/self/clear_refs``, minus ``VmRSS`` before).
Each case runs alone in its process, so one case's memory is not counted in another's.

Implementations:

- ``aioloader``: the planner ``DataLoader`` uses (``shuffle=True``), unsharded and
  sharded 8 ways (rank 0), and the public ``aioloader.DistributedSampler`` (8 ways);
  also the steady cost of one batch (the mean over the next 200 batches);
- ``torch RandomSampler``: ``BatchSampler(RandomSampler(range(n)), 256, False)``, what
  ``torch.utils.data.DataLoader(shuffle=True)`` iterates;
- ``torch DistributedSampler``: ``torch.utils.data.DistributedSampler`` (8 ways);
- ``torch.randperm``: the permutation array alone, the least any sampler that stores the
  epoch's order needs.

torch's cases run under an address-space limit (``--torch-limit-gb``, default 12) so that
a case that would exhaust the machine fails with ``MemoryError`` instead.

Usage::

    python examples/benchmarks/bench_plan.py                 # 10**8, 10**9, 10**12
    python examples/benchmarks/bench_plan.py --sizes 8 9 --json plan.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

BATCH = 256
WORLD = 8
CASES = [
    ("aioloader", 1),
    ("aioloader", WORLD),
    ("aioloader DistributedSampler", WORLD),
    ("torch RandomSampler", 1),
    ("torch DistributedSampler", WORLD),
    ("torch.randperm", 1),
]


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


def _first_batch(impl: str, n: int, world: int) -> tuple[Any, Any]:
    """Build the plan and its first batch; return (the batch, a way to get more)."""
    if impl == "aioloader":
        from aioloader._plan.sampler import BatchPlanner

        planner = BatchPlanner(
            n, batch_size=BATCH, shuffle=True, sampler=None, batch_sampler=None,
            last_batch="keep", seed=0, shard=(0, world), shard_policy="pad",
        )
        plan = planner.plan(0)
        return plan.batches[0], plan.batches
    if impl == "aioloader DistributedSampler":
        import itertools

        import aioloader

        it = iter(aioloader.DistributedSampler(n, 0, world, seed=0))
        return list(itertools.islice(it, BATCH)), None
    import torch
    from torch.utils.data import BatchSampler, DistributedSampler, RandomSampler

    if impl == "torch.randperm":
        perm = torch.randperm(n)
        return perm[:BATCH], perm
    sampler: Any = RandomSampler(range(n)) if impl == "torch RandomSampler" else DistributedSampler(
        range(n), num_replicas=world, rank=0, seed=0
    )
    it = iter(BatchSampler(sampler, BATCH, drop_last=False))
    return next(it), it


def child(impl: str, n: int, world: int, limit_gb: float) -> dict[str, Any]:
    if impl.startswith("torch"):
        import resource

        import torch  # noqa: F401  (imported before the limit and the baseline)

        limit = int(limit_gb * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    else:
        import numpy.random  # noqa: F401  (numpy imports it lazily: ~10 ms, once per process)

        import aioloader  # noqa: F401
    exact = _reset_peak()
    before = _status_kb("VmRSS")
    t0 = time.perf_counter()
    out: dict[str, Any] = {"impl": impl, "n": n, "world": world}
    try:
        batch, more = _first_batch(impl, n, world)
    except (MemoryError, RuntimeError) as exc:
        first_line = (str(exc).splitlines() or [""])[0]
        out.update(error=f"{type(exc).__name__}: {first_line[:120]}".rstrip(": "))
        batch = more = None
    out["first_s"] = time.perf_counter() - t0
    out["extra_rss_mb"] = (_status_kb("VmHWM" if exact else "VmRSS") - before) / 1024
    out["peak_exact"] = exact
    if batch is not None:
        assert len(batch) == BATCH
    if impl == "aioloader" and more is not None:
        t0 = time.perf_counter()
        for k in range(1, 201):
            more[k]
        out["per_batch_us"] = (time.perf_counter() - t0) / 200 * 1e6
    return out


def run_case(impl: str, n: int, world: int, limit_gb: float) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", impl, str(n), str(world), str(limit_gb)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return {"impl": impl, "n": n, "world": world, "error": f"exit {proc.returncode}: {tail[:120]}"}
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def fmt_time(s: float) -> str:
    return f"{s * 1e3:.2f} ms" if s < 1 else f"{s:.2f} s"


def fmt_mem(mb: float) -> str:
    return f"{mb:.1f} MB" if mb < 1024 else f"{mb / 1024:.2f} GB"


class _Huge:
    """A dataset of any length that is never indexed (only its state is saved and loaded)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def state_round_trips(n: int, repeat: int = 50) -> list[dict[str, Any]]:
    """Median and worst ``load_state_dict`` and ``state_dict`` times of a shuffled loader
    over ``n`` samples, sharded ``WORLD`` ways, at positions from the first batch to the last."""
    import statistics

    import aioloader

    loader = aioloader.DataLoader(_Huge(n), BATCH, shuffle=True, seed=3, shard=(0, WORLD), num_workers=0)
    base = loader.state_dict()
    last = len(loader) - 1
    out = []
    for pos in sorted({0, 12_345 % (last + 1), last // 2, max(last - 3, 0)}):
        after = [p for p in (pos + 1, pos + 2) if p <= last]
        state = dict(base, batches_delivered=pos, next_position=pos, delivered_after=after)
        loads, saves = [], []
        for _ in range(repeat):
            t = time.perf_counter()
            loader.load_state_dict(state)
            loads.append(time.perf_counter() - t)
            t = time.perf_counter()
            saved = loader.state_dict()
            saves.append(time.perf_counter() - t)
        assert saved["next_position"] == pos and saved["delivered_after"] == after
        out.append({"n": n, "position": pos, "load_us": statistics.median(loads) * 1e6,
                    "load_max_us": max(loads) * 1e6, "save_us": statistics.median(saves) * 1e6,
                    "save_max_us": max(saves) * 1e6})
    loader.close()
    return out


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        impl, n, world, limit = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
        print(json.dumps(child(impl, n, world, limit)))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[8, 9, 12], help="powers of ten (default 8 9 12)")
    ap.add_argument("--torch-limit-gb", type=float, default=12.0)
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--only", help="run only the implementations whose name contains this")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    results = []
    print(f"{'len':>6} {'ranks':>5}  {'implementation':<30} {'plan + 1st batch':>16} {'extra RSS':>10} {'per batch':>10}")
    for power in args.sizes:
        for impl, world in CASES:
            if (args.no_torch and impl.startswith("torch")) or (args.only and args.only not in impl):
                continue
            r = run_case(impl, 10**power, world, args.torch_limit_gb)
            results.append(r)
            per = f"{r['per_batch_us']:.0f} us" if "per_batch_us" in r else ""
            if "error" in r and "first_s" not in r:
                cells = f"{'failed':>16} {'':>10} {per:>10}  {r['error']}"
            else:
                cells = f"{fmt_time(r['first_s']):>16} {fmt_mem(r['extra_rss_mb']):>10} {per:>10}"
                if "error" in r:
                    cells += f"  failed: {r['error']}"
            print(f"10**{power:<2} {world:>5}  {impl:<30} {cells}", flush=True)
    print(f"\nstate_dict round trips, shuffled, {WORLD} ranks (median and worst of 50, microseconds)")
    for power in args.sizes:
        for r in state_round_trips(10**power):
            results.append(r)
            print(f"10**{power:<2} batch {r['position']:>12,}: load_state_dict {r['load_us']:>4.0f} "
                  f"(worst {r['load_max_us']:.0f}), state_dict {r['save_us']:>4.0f} (worst {r['save_max_us']:.0f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu_count": os.cpu_count(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()

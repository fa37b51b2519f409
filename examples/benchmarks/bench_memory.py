"""Memory and start-up cost of a dataset that holds one large numpy array, across workers.

Every case runs in a fresh Python process: it builds a dataset holding an ``int64``
array of ``--mib`` MiB, makes a loader with ``--workers`` workers, and iterates one
epoch of ``4 * workers`` batches in which every sample reads the whole array (so every
worker touches every page). While the workers are still alive it reads the
proportional set size (``Pss``, from ``/proc/PID/smaps_rollup``) of the main process and
of each worker, and reports their sum: shared pages are split between the processes
that map them, so the sum is the memory the run really costs. It also times the first
batch, whose one sample reads nothing: worker start-up plus the dataset's trip to the
workers; for aioloader, "pickling" is the part of it the consumer spent pickling the
dataset and writing its arrays to shared memory (``loader.stats().payload_s``).

Cases:

- ``aioloader``: the default; large arrays travel through one shared-memory segment,
  and the consumer's own array is remapped onto it;
- ``aioloader copy``: ``AIOLOADER_SHARE_ARRAYS=0``, a private copy of the payload in
  every worker (what aioloader did before);
- ``torch fork``: ``torch.utils.data.DataLoader(multiprocessing_context="fork",
  persistent_workers=True)``, whose workers share the parent's pages copy-on-write (its
  best case for memory; forkserver and spawn copy like ``aioloader copy``).

Usage::

    python examples/benchmarks/bench_memory.py                       # 64 MiB and 1 GiB, 8 workers
    python examples/benchmarks/bench_memory.py --mib 256 --workers 4 --cases aioloader torch-fork
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any

CASE_SCRIPT = r"""
import json, os, sys, time
import numpy as np

MIB = 2**20


class Held:
    def __init__(self, mib, n):
        self.data = np.arange(mib * MIB // 8, dtype=np.int64)
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == 0:  # the first batch times start-up and the dataset's trip, not a sum
            return np.array([0, os.getpid()], dtype=np.int64)
        return np.array([int(self.data.sum()), os.getpid()], dtype=np.int64)


def pss(pid):
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    return 0


def main():
    case, mib, workers = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    ds = Held(mib, 4 * workers)
    t0 = time.perf_counter()
    if case.startswith("aioloader"):
        import aioloader

        loader = aioloader.DataLoader(ds, batch_size=1, num_workers=workers, prefetch_next_epoch=False)
        it = iter(loader)
    else:
        import torch.utils.data as tud

        loader = tud.DataLoader(ds, batch_size=1, num_workers=workers, persistent_workers=True,
                                multiprocessing_context="fork", collate_fn=lambda b: b[0])
        it = iter(loader)
    first = next(it)
    first_s = time.perf_counter() - t0
    pids = {int(first[0][1] if first.ndim > 1 else first[1])}
    for b in it:
        pids.add(int(b[0][1] if b.ndim > 1 else b[1]))
    epoch_s = time.perf_counter() - t0
    payload_s = None
    if case.startswith("aioloader"):
        pids = set(loader.worker_pids())
        payload_s = loader.stats().payload_s
    main_pss = pss(os.getpid())
    worker_pss = sorted(pss(p) for p in pids)
    print(json.dumps({"case": case, "mib": mib, "workers": workers, "workers_seen": len(pids),
                      "first_batch_s": first_s, "payload_s": payload_s, "epoch_s": epoch_s, "main_pss": main_pss,
                      "worker_pss": worker_pss, "total_pss": main_pss + sum(worker_pss)}), flush=True)
    if case.startswith("aioloader"):
        loader.close()


if __name__ == "__main__":
    main()
"""

CASES = ("aioloader", "aioloader-copy", "torch-fork")


def run_case(case: str, mib: int, workers: int) -> dict[str, Any]:
    env = dict(os.environ)
    if case == "aioloader-copy":
        env["AIOLOADER_SHARE_ARRAYS"] = "0"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run(
        [sys.executable, "-c", CASE_SCRIPT, case, str(mib), str(workers)],
        env=env, capture_output=True, text=True, timeout=900, check=False,
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not lines:
        raise SystemExit(f"{case} at {mib} MiB failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def _secs(s: float | None) -> str:
    return "-" if s is None else f"{s:.2f} s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, nargs="+", default=[64, 1024], help="array sizes in MiB")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    results = []
    print(f"{'case':<15} {'array':>8} {'workers':>7} {'total PSS':>10} {'main':>8} {'per worker':>11}"
          f" {'first batch':>11} {'pickling':>8} {'epoch':>8}")
    for mib in args.mib:
        for case in args.cases:
            r = run_case(case, mib, args.workers)
            results.append(r)
            per = r["worker_pss"][len(r["worker_pss"]) // 2] if r["worker_pss"] else 0
            print(f"{case:<15} {mib:>5} MiB {r['workers_seen']:>7} {r['total_pss'] / 2**20:>6.0f} MiB"
                  f" {r['main_pss'] / 2**20:>4.0f} MiB {per / 2**20:>7.0f} MiB"
                  f" {r['first_batch_s']:>9.2f} s {_secs(r['payload_s']):>8} {r['epoch_s']:>6.2f} s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

"""The start workload's child: a small training script, run in a fresh process.

It times one loader from its construction to its first batch, in one of these cases:

- ``plain``: nothing else runs; the loader is the script's first.
- ``thread``: an idle Python thread (it waits on an Event) started before the loader.
- ``early``: the same thread, started before ``import aioloader``.
- ``tqdm``: the same, but the thread is tqdm's monitor (a progress bar is open).
- ``omp``: torch's intra-op thread pool (OpenMP, native threads) is running: a torch op
  over more than 32,768 elements (torch's grain size) ran before the loader, as one
  does in most training scripts.
- ``second``: a train loader is built and read to its first batch, and kept; the timed
  loader is the val loader built after it.

The dataset lives in this script, as it does in many training scripts: a worker started
afresh must import this script again (as ``__mp_main__``), and with it torch.

    python _train_start.py --loader aioloader --case thread
    python _train_start.py --loader torch --case second

The last line is ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import threading
import time
from typing import Any

import numpy as np
import torch  # a training script imports it; a fresh worker interpreter would too
import torch.utils.data

CASES = ("plain", "thread", "early", "tqdm", "omp", "second")


class Rows:
    """``n`` small samples: sample ``i`` is eight copies of ``i``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        return np.full(8, i)


def numpy_collate(samples: list[np.ndarray]) -> np.ndarray:
    """torch's batches as numpy arrays, as aioloader gives them."""
    return np.stack(samples)


def make_loader(kind: str, dataset: Rows, batch_size: int, shuffle: bool) -> Any:
    if kind == "torch":
        return torch.utils.data.DataLoader(
            dataset,
            batch_size=batch_size,
            shuffle=shuffle,
            num_workers=2,
            persistent_workers=True,
            collate_fn=numpy_collate,
        )
    import aioloader

    return aioloader.DataLoader(dataset, batch_size, shuffle=shuffle, seed=0, num_workers=2)


def first_batch(kind: str, dataset: Rows, batch_size: int, shuffle: bool) -> tuple[Any, Any, float]:
    """Build a loader and read its first batch: the loader, its iterator, seconds."""
    t0 = time.perf_counter()
    loader = make_loader(kind, dataset, batch_size, shuffle)
    it = iter(loader)
    batch = next(it)
    elapsed = time.perf_counter() - t0
    assert len(batch) == batch_size
    return loader, it, elapsed


def native_threads() -> int:
    """Threads of this process, Python's and native ones (Linux)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return -1


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--loader", choices=("aioloader", "torch"), required=True)
    ap.add_argument("--case", choices=CASES, required=True)
    ap.add_argument("--samples", type=int, default=4096)
    ap.add_argument("--batch-size", type=int, default=32)
    args = ap.parse_args()
    stop = threading.Event()
    if args.case == "early":
        threading.Thread(target=stop.wait, name="idle", daemon=True).start()
    if args.loader == "aioloader":
        import aioloader  # noqa: F401  (imported before the clock, as a script imports it)
    train, val = Rows(args.samples), Rows(args.samples // 4)
    bar = None
    if args.case == "thread":
        threading.Thread(target=stop.wait, name="idle", daemon=True).start()
    elif args.case == "tqdm":
        import tqdm

        sink = open(os.devnull, "w")
        bar = tqdm.tqdm(total=len(train), file=sink)  # starts tqdm's monitor thread
        assert tqdm.tqdm.monitor is not None and tqdm.tqdm.monitor.is_alive()
    elif args.case == "omp":
        torch.ones(64, 1024).sum(1)  # runs on the intra-op pool, which stays up
    # Importing torch leaves a full collection of the cyclic GC due soon; it runs here, not
    # inside one loader's clock (as the suite's cold workload does).
    gc.collect()
    loaders: list[Any] = []
    iterators: list[Any] = []
    result: dict[str, Any] = {
        "loader": args.loader,
        "case": args.case,
        "native_threads_before": native_threads(),
    }
    if args.case == "second":
        loader, it, elapsed = first_batch(args.loader, train, args.batch_size, True)
        loaders.append(loader)  # the train loader lives on, as it does during validation
        iterators.append(it)
        result["first_loader_s"] = elapsed
        loader, it, elapsed = first_batch(args.loader, val, args.batch_size, False)
    else:
        loader, it, elapsed = first_batch(args.loader, train, args.batch_size, True)
    loaders.append(loader)
    iterators.append(it)
    result["first_batch_s"] = elapsed
    result["threads"] = threading.active_count()
    print("RESULT " + json.dumps(result), flush=True)
    stop.set()
    if bar is not None:
        bar.close()
        sink.close()
    del iterators
    if args.loader == "aioloader":
        for loader in loaders:
            loader.close()


if __name__ == "__main__":
    main()

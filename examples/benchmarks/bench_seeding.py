"""What each ``seed_samples`` mode costs a worker, the seeding alone (no dataset, no collate).

For a batch of 256 shuffled indices out of 200,000: prepare the batch's seeding, then do
what the worker's loop does before each sample. Best of 5 ``timeit`` repetitions::

    python examples/benchmarks/bench_seeding.py
"""

from __future__ import annotations

import functools
import timeit

import numpy as np

from aioloader import _seeding

BATCH = 256


def one_batch(mode: _seeding.SeedMode, raw: bytes, indices: list[int]) -> None:
    seeds = _seeding.start_batch(mode, 1, 0, raw, indices)
    hook = seeds.hook
    for k in range(len(indices)):
        seeds.k = k
        if hook is not None:
            hook(k)
    _seeding.clear_sample()


def main() -> None:
    idx = np.random.default_rng(0).permutation(200_000)[:BATCH].astype(np.int64)
    raw, indices = idx.tobytes(), idx.tolist()
    modes: tuple[_seeding.SeedMode, ...] = ("batch", "sample", False)
    for mode in modes:
        n = 200 if mode == "sample" else 5000
        t = min(timeit.repeat(functools.partial(one_batch, mode, raw, indices), number=n, repeat=5)) / n
        print(f"seed_samples={mode!r:8} {t * 1e6:8.1f} us a batch, {t / BATCH * 1e6:.2f} us a sample")


if __name__ == "__main__":
    main()

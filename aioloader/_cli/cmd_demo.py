"""``python -m aioloader demo``: two epochs of JPEG decoding and augmentation on the
synthetic data set (:class:`aioloader.datasets.SyntheticJpegDataset`).

The first run writes the JPEGs to a cache folder, on the same worker pool that then
loads them, with a progress bar; later runs reuse the folder.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np

from .._formats.progress import progress_bar
from .._formats.synthetic import JpegWriter, default_cache, make_synthetic_jpegs
from .._pool import WorkerPool
from ..datasets import SyntheticJpegDataset
from ..loader import DataLoader
from . import program

__all__ = ["demo_main"]


def _writing_on(pool: WorkerPool) -> Callable[[JpegWriter], Iterator[list[int]]]:
    """A ``run`` for :func:`make_synthetic_jpegs` that writes the files on ``pool``."""

    def run(writer: JpegWriter) -> Iterator[list[int]]:
        # One pass: building the next epoch ahead would write every file twice.
        with DataLoader(
            writer, 16, pool=pool, collate_fn=list, seed_samples=False, prefetch_next_epoch=False
        ) as loader:
            yield from loader

    return run


def demo_main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; print one line per epoch on stdout (progress bars on stderr); return 0."""
    parser = argparse.ArgumentParser(prog=f"{program()} demo", description=__doc__)
    parser.add_argument("--images", type=int, default=1024, help="synthetic JPEGs to write (first run only)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--cache", type=Path, default=None, help="dataset folder (default: ~/.cache/aioloader)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    for name, value, low in (
        ("--images", args.images, 8),
        ("--epochs", args.epochs, 1),
        ("--batch-size", args.batch_size, 1),
        ("--workers", args.workers, 0),
    ):
        if value < low:
            parser.error(f"{name} must be {low} or more, got {value}")

    root = (args.cache or default_cache()) / f"demo-jpegs-{args.images}"
    with WorkerPool(args.workers) as pool:
        t0 = time.perf_counter()
        make_synthetic_jpegs(root, args.images, progress=not args.no_progress, run=_writing_on(pool))
        dataset = SyntheticJpegDataset(args.images, root=root, progress=False)
        print(
            f"dataset: {args.images} JPEGs in {root} (ready in {time.perf_counter() - t0:.1f} s)", flush=True
        )
        with DataLoader(
            dataset, args.batch_size, shuffle=True, pool=pool, seed=0, last_batch="keep"
        ) as loader:
            for epoch in range(args.epochs):
                start = time.perf_counter()
                images = 0
                with progress_bar(
                    len(loader), f"epoch {epoch}", unit="batch", disable=args.no_progress
                ) as bar:
                    for batch, labels in loader:
                        images += len(labels)
                        if batch.shape[1:] != (224, 224, 3) or batch.dtype != np.uint8:
                            raise RuntimeError(f"demo: unexpected batch {batch.dtype} {batch.shape}")
                        bar.update(1)
                elapsed = time.perf_counter() - start
                first = loader.stats().epochs[-1].first_batch_s or 0.0
                print(
                    f"epoch {epoch}: {images} images in {elapsed:.2f} s = {images / elapsed:,.0f} images/s; "
                    f"first batch after {first * 1000:.0f} ms; worker pids {loader.worker_pids()}",
                    flush=True,
                )
    return 0

"""``python -m aioloader demo``: two epochs of JPEG decoding and augmentation on a
synthetic dataset written (once) to a cache folder."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image

from .datasets import ImageFolder
from .loader import DataLoader
from .transforms import Compose, RandomHorizontalFlip, RandomResizedCrop, ToArray

__all__ = ["demo_main", "make_synthetic_jpegs", "train_transform"]


def default_cache() -> Path:
    base = os.environ.get("AIOLOADER_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "aioloader"
    )
    return Path(base)


def make_synthetic_jpegs(root: Path, count: int = 1024, classes: int = 8, seed: int = 0) -> Path:
    """Write ``count`` JPEGs of 320-512 px in ``classes`` folders under ``root`` (idempotent:
    a complete folder is reused). Returns ``root``."""
    done = root / ".complete"
    if done.exists() and done.read_text() == f"{count} {classes} {seed}":
        return root
    rng = np.random.default_rng(seed)
    for k in range(count):
        folder = root / f"class_{k % classes:02d}"
        folder.mkdir(parents=True, exist_ok=True)
        h, w = (int(x) for x in rng.integers(320, 513, size=2))
        # Smooth gradients plus noise: compresses like a photo, not like flat colour.
        y = np.linspace(0, 1, h, dtype=np.float32)[:, None, None]
        x = np.linspace(0, 1, w, dtype=np.float32)[None, :, None]
        c = rng.random(3, dtype=np.float32)[None, None, :]
        img = (255 * (0.5 * x * c + 0.5 * y * (1 - c))) + rng.normal(0, 12, (h, w, 3))
        Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(folder / f"{k:05d}.jpg", quality=90)
    done.write_text(f"{count} {classes} {seed}")
    return root


def train_transform(size: int = 224) -> Compose:
    """Decode-side augmentation used by the demo and the benchmarks."""
    return Compose([RandomResizedCrop(size), RandomHorizontalFlip(), ToArray()])


def demo_main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m aioloader demo", description=__doc__)
    parser.add_argument("--images", type=int, default=1024, help="synthetic JPEGs to write (first run only)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--cache", type=Path, default=None, help="dataset folder (default: ~/.cache/aioloader)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)

    from tqdm import tqdm

    root = (args.cache or default_cache()) / f"demo-jpegs-{args.images}"
    t0 = time.perf_counter()
    make_synthetic_jpegs(root, args.images)
    print(f"dataset: {args.images} JPEGs in {root} (ready in {time.perf_counter() - t0:.1f} s)")
    dataset = ImageFolder(root, transform=train_transform())
    with DataLoader(
        dataset, args.batch_size, shuffle=True, num_workers=args.workers, seed=0, last_batch="keep"
    ) as loader:
        for epoch in range(args.epochs):
            start = time.perf_counter()
            images = 0
            for batch, labels in tqdm(
                loader, total=len(loader), desc=f"epoch {epoch}", unit="batch", disable=args.no_progress,
                file=sys.stdout,
            ):
                images += len(labels)
                assert batch.shape[1:] == (224, 224, 3) and batch.dtype == np.uint8
            elapsed = time.perf_counter() - start
            first = loader.stats().epochs[-1].first_batch_s or 0.0
            print(
                f"epoch {epoch}: {images} images in {elapsed:.2f} s = {images / elapsed:,.0f} images/s; "
                f"first batch after {first * 1000:.0f} ms; worker pids {loader.worker_pids()}"
            )
    return 0

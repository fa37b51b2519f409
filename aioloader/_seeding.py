"""Per-sample randomness: every sample's random state is a pure function of
``(seed, epoch, index)``, never of which worker ran it.

Before each ``dataset[index]`` the loader calls :func:`seed_sample`, which seeds Python's
``random``, numpy's global generator and, when torch is already imported, torch's
generator. :func:`sample_rng` hands out a ``numpy.random.Generator`` seeded the same way,
for code that prefers an explicit generator.

This module runs inside workers and must stay free of asyncio.
"""

from __future__ import annotations

import random
import sys
import threading

import numpy as np

__all__ = ["sample_key", "sample_rng", "seed_sample"]


class _Local(threading.local):
    key: tuple[int, int, int] | None = None
    rng: np.random.Generator | None = None


_local = _Local()


def _entropy(seed: int, epoch: int, index: int) -> list[int]:
    # SeedSequence takes non-negative ints of any size; a negative index (never produced by
    # our samplers, but possible from a user batch_sampler) is folded into the positives.
    return [seed, epoch, index if index >= 0 else (1 << 64) + index]


def seed_sample(seed: int, epoch: int, index: int) -> None:
    """Seed ``random``, ``numpy.random`` and torch (if imported) for one sample."""
    state = np.random.SeedSequence(_entropy(seed, epoch, index)).generate_state(2, np.uint32)
    s64 = (int(state[0]) << 32) | int(state[1])
    random.seed(s64)
    np.random.seed(state)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.manual_seed(s64 & 0x7FFF_FFFF_FFFF_FFFF)
    _local.key = (seed, epoch, index)
    _local.rng = None


def clear_sample() -> None:
    """Forget the current sample (called after each batch)."""
    _local.key = None
    _local.rng = None


def sample_key() -> tuple[int, int, int] | None:
    """``(seed, epoch, index)`` of the sample being loaded in this thread, or ``None``."""
    return _local.key


def sample_rng() -> np.random.Generator:
    """A ``numpy.random.Generator`` for the sample being loaded.

    Inside a loader it is seeded from ``(seed, epoch, index)``, so the same sample gets
    the same numbers whatever ``num_workers`` is; repeated calls while loading one sample
    return the same generator (the stream continues, it does not restart). Outside a
    loader it is drawn from numpy's global generator, so ``numpy.random.seed`` still
    makes a script reproducible.
    """
    rng = _local.rng
    if rng is not None:
        return rng
    key = _local.key
    if key is None:
        return np.random.default_rng(np.random.randint(0, 2**32, size=4, dtype=np.uint64))
    # A distinct stream from the global seeding above: append a constant to the entropy.
    rng = np.random.default_rng(np.random.SeedSequence([*_entropy(*key), 0x5EED]))
    _local.rng = rng
    return rng

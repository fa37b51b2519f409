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

__all__ = ["enter_sample", "sample_key", "sample_rng", "sample_seed", "seed_sample"]


class _Local(threading.local):
    key: tuple[int, int, int] | None = None
    rng: np.random.Generator | None = None


_local = _Local()


def _entropy(seed: int, epoch: int, index: int) -> list[int]:
    # SeedSequence takes non-negative ints of any size; a negative index (never produced by
    # our samplers, but possible from a user batch_sampler) is folded into the positives.
    return [seed, epoch, index if index >= 0 else (1 << 64) + index]


_M64 = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finaliser: a cheap, well-spread 64-bit hash."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The 64-bit seed of one sample: a pure function of ``(seed, epoch, index)``."""
    return _mix(_mix(_mix(seed & _M64) ^ (epoch & _M64)) ^ (index & _M64))


def worker_seed(seed: int, worker_id: int) -> int:
    """The seed ``torch.utils.data.get_worker_info().seed`` reports in worker
    ``worker_id``: a pure function of the loader's seed and the id. aioloader seeds per
    sample, not per worker; this is for code that seeds other libraries from it. Under
    2**63, as torch's are (it fits an int64 tensor)."""
    return (_mix(_mix(seed & _M64) ^ _mix(worker_id + 0x5EED))) >> 1


def seed_sample(seed: int, epoch: int, index: int) -> None:
    """Seed ``random``, ``numpy.random`` and torch (if imported) for one sample.

    Kept cheap because it runs before every sample: a pure-Python hash, ``random.seed``
    with an int, ``numpy.random.seed`` with a 32-bit int, and torch's CPU generator
    directly (``torch.manual_seed`` also visits every accelerator backend and costs ~100x
    more).
    """
    s64 = sample_seed(seed, epoch, index)
    enter_sample(seed, epoch, index)
    random.seed(s64)
    np.random.seed(s64 & 0xFFFF_FFFF)
    torch = sys.modules.get("torch")
    if torch is not None:
        gen = getattr(torch, "default_generator", None)
        if gen is not None:
            gen.manual_seed(s64 >> 1)


def enter_sample(seed: int, epoch: int, index: int) -> None:
    """Make :func:`sample_rng` and :func:`sample_key` answer for this sample, in this
    thread only; the global generators are left alone."""
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

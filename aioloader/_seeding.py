"""Randomness inside a loader: a pure function of what is loaded (``(seed, epoch)`` and the
batch's indices, or the sample's index), never of which worker loaded it.

Three modes (the loader's ``seed_samples``):

- ``"batch"`` (the default): :func:`start_batch` seeds Python's ``random``, numpy's global
  generator and, when torch is already imported, torch's generator once per batch, from a
  64-bit key hashed over ``(seed, epoch)`` and the batch's indices in order; the samples of
  the batch then draw from those streams one after the other.
- ``"sample"`` (``True``): the same generators are seeded before every sample from
  ``(seed, epoch, index)``, as :func:`seed_sample` does (the seeds of a whole batch are
  hashed at once, with numpy).
- ``False``: the global generators are left alone.

In every mode :func:`sample_rng` hands out a ``numpy.random.Generator`` seeded from
``(seed, epoch, index)`` alone, built only when it is called.

This module runs inside workers and must stay free of asyncio.
"""

from __future__ import annotations

import hashlib
import random
import struct
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np

# numpy imports numpy.random on first use (15-20 ms, 13 modules). Import it with the worker
# side instead, which `import aioloader` loads too: the consumer's first shuffled plan
# (its round keys) and every worker's first batch would otherwise pay for it, and the
# pool's zygote, forked from a process that imported it, hands it to the workers.
import numpy.random

__all__ = [
    "BatchSeeds", "SeedMode", "batch_key", "enter_sample", "sample_key", "sample_rng", "sample_seed", "sample_seeds",
    "seed_sample", "seed_worker", "start_batch",
]  # fmt: skip

SeedMode = Literal["batch", "sample", False]
"""How a loader seeds the global generators: once per batch, before every sample, or not."""


class BatchSeeds:
    """The batch being built in this thread. The position of the sample it loads
    (:meth:`position`) is ``k``, which the loop sets (one attribute store a sample), or,
    while ``loaded`` points at the list of the samples loaded so far, that list's length
    (no store at all). The loop calls ``hook(k)`` when it is not ``None`` (``"sample"``
    mode, which seeds the global generators for each sample)."""

    __slots__ = ("batched", "epoch", "hook", "indices", "k", "loaded", "rng", "rng_k", "seed")

    def __init__(self, seed: int, epoch: int, indices: Sequence[int]) -> None:
        self.seed, self.epoch, self.indices = seed, epoch, indices
        self.k = 0
        self.loaded: list[Any] | None = None
        self.hook: Callable[[int], None] | None = None
        self.rng: np.random.Generator | None = None
        self.rng_k = -1  # the position ``rng`` was made for
        # True while ``dataset.__getitems__`` reads the whole batch: no one sample is
        # being loaded, so only :func:`sample_rng` with an index can answer.
        self.batched = False

    def position(self) -> int:
        """The position in the batch of the sample being loaded."""
        loaded = self.loaded
        return self.k if loaded is None else len(loaded)


class _Local(threading.local):
    key: tuple[int, int, int] | None = None  # one sample's (enter_sample)
    rng: np.random.Generator | None = None
    batch: BatchSeeds | None = None  # a batch's (start_batch)
    by_index: dict[int, np.random.Generator] | None = None  # sample_rng(index)'s, this batch


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


_C0 = np.uint64(0x9E3779B97F4A7C15)
_C1 = np.uint64(0xBF58476D1CE4E5B9)
_C2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


def _mix_array(x: np.ndarray) -> np.ndarray:
    """:func:`_mix` on a ``uint64`` array (array arithmetic wraps modulo 2**64, silently)."""
    x = x + _C0
    x = (x ^ (x >> _S30)) * _C1
    x = (x ^ (x >> _S27)) * _C2
    out: np.ndarray = x ^ (x >> _S31)
    return out


def _as_uint64(indices: Any) -> np.ndarray:
    """A batch's indices (the loader's int64 bytes, an integer array or a sequence of
    ints) as ``uint64``, each one taken modulo 2**64 as :func:`sample_seed` takes it."""
    if isinstance(indices, (bytes, bytearray, memoryview)):
        return np.frombuffer(indices, dtype=np.uint64)
    arr = np.asarray(indices)
    if arr.dtype.kind in "iu":
        return arr.astype(np.uint64, copy=False)  # int64 -> uint64 wraps, as ``& _M64`` does
    # Python ints beyond int64, or an empty list (which numpy reads as float64).
    return np.array([int(i) & _M64 for i in indices], dtype=np.uint64)


def sample_seeds(seed: int, epoch: int, indices: Any) -> np.ndarray:
    """:func:`sample_seed` of every index of a batch at once: a ``uint64`` array."""
    base = np.uint64(_mix(_mix(seed & _M64) ^ (epoch & _M64)))
    return _mix_array(_as_uint64(indices) ^ base)


def batch_key(seed: int, epoch: int, indices: Any) -> int:
    """The 64-bit key a batch seeds the global generators from in ``"batch"`` mode: a
    pure function of ``(seed, epoch)`` and the batch's indices *in order* (BLAKE2b of
    their 64-bit forms, keyed with the seed and the epoch: a few µs for a batch of
    thousands), so never of the worker, the batch's position in the epoch, the shard or
    the order batches are delivered in."""
    data = (
        bytes(indices)
        if isinstance(indices, (bytes, bytearray, memoryview))
        else _as_uint64(indices).tobytes()
    )
    key = struct.pack("<QQ", seed & _M64, epoch & _M64)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8, key=key).digest(), "little")


def _torch_generator() -> Any:
    torch = sys.modules.get("torch")
    return None if torch is None else getattr(torch, "default_generator", None)


def _seed_globals(s64: int, gen: Any) -> None:
    random.seed(s64)
    np.random.seed(s64 & 0xFFFF_FFFF)
    if gen is not None:
        gen.manual_seed(s64 >> 1)


def start_batch(mode: SeedMode, seed: int, epoch: int, raw: Any, indices: Sequence[int]) -> BatchSeeds:
    """Prepare the seeding of one batch and return what the loop updates before each
    sample (see :class:`BatchSeeds`). ``raw`` and ``indices`` are the batch's indices (in
    the task's form and as a sequence of ints), in order.

    ``"batch"`` seeds ``random``, numpy's global generator (with all 64 bits of
    :func:`batch_key`) and torch's generator here, once; per sample, only
    :func:`sample_rng` follows the position. ``"sample"`` hashes the batch's seeds here
    and the hook seeds the generators exactly as :func:`seed_sample` would. ``False``
    seeds nothing. Call :func:`clear_sample` after the batch.
    """
    b = BatchSeeds(seed, epoch, indices)
    if mode == "sample":
        seeds: list[int] = sample_seeds(seed, epoch, raw).tolist()
        gen = _torch_generator()

        def seed_globals(k: int) -> None:
            _seed_globals(seeds[k], gen)

        b.hook = seed_globals
    elif mode == "batch":
        key = batch_key(seed, epoch, raw)
        random.seed(key)
        np.random.seed(np.array([key & 0xFFFF_FFFF, key >> 32], dtype=np.uint32))
        gen = _torch_generator()
        if gen is not None:
            gen.manual_seed(key >> 1)
    _local.key = None
    _local.batch = b
    _local.by_index = None
    return b


def worker_seed(seed: int, worker_id: int) -> int:
    """The seed ``torch.utils.data.get_worker_info().seed`` reports in worker
    ``worker_id``: a pure function of the loader's seed and the id. aioloader seeds per
    sample, not per worker; this is for code that seeds other libraries from it. Under
    2**63, as torch's are (it fits an int64 tensor)."""
    return (_mix(_mix(seed & _M64) ^ _mix(worker_id + 0x5EED))) >> 1


def seed_worker(seed: int) -> None:
    """Seed ``random``, numpy's global generator and torch's (if imported) from one
    64-bit ``seed``: an iterable dataset's worker, once as its iteration of an epoch
    begins (what torch does once per worker)."""
    _seed_globals(seed & _M64, _torch_generator())


def seed_sample(seed: int, epoch: int, index: int) -> None:
    """Seed ``random``, ``numpy.random`` and torch (if imported) for one sample, as the
    ``"sample"`` mode does before each sample.

    ``random.seed`` with the 64-bit :func:`sample_seed`, ``numpy.random.seed`` with its low
    32 bits, and torch's CPU generator directly (``torch.manual_seed`` also visits every
    accelerator backend and costs ~100x more).
    """
    enter_sample(seed, epoch, index)
    _seed_globals(sample_seed(seed, epoch, index), _torch_generator())


def enter_sample(seed: int, epoch: int, index: int) -> None:
    """Make :func:`sample_rng` and :func:`sample_key` answer for this sample, in this
    thread only; the global generators are left alone."""
    _local.batch = None
    _local.key = (seed, epoch, index)
    _local.rng = None
    _local.by_index = None


def clear_sample() -> None:
    """Forget the current sample (called after each batch)."""
    _local.batch = None
    _local.key = None
    _local.rng = None
    _local.by_index = None


def sample_key() -> tuple[int, int, int] | None:
    """``(seed, epoch, index)`` of the sample being loaded in this thread, or ``None``."""
    b = _local.batch
    if b is not None:
        return None if b.batched else (b.seed, b.epoch, int(b.indices[b.position()]))
    return _local.key


def sample_rng(index: int | None = None) -> np.random.Generator:
    """A ``numpy.random.Generator`` for the sample being loaded, or for ``index``.

    Inside a loader it is seeded from ``(seed, epoch, index)``, so the same sample gets
    the same numbers whatever ``num_workers`` is; repeated calls for one sample return
    the same generator (the stream continues, it does not restart). Outside a loader it
    is drawn from numpy's global generator, so ``numpy.random.seed`` still makes a
    script reproducible.

    A dataset's ``__getitems__`` reads a whole batch in one call, so no single sample
    is being loaded: there pass the index of each sample, ``sample_rng(i)``. Without
    an index it raises :class:`RuntimeError`.
    """
    b = _local.batch
    if index is not None:
        return _rng_of_index(b, int(index))
    if b is not None:
        if b.batched:
            raise RuntimeError(
                "aioloader.sample_rng() was called while dataset.__getitems__ reads a whole batch: "
                "no one sample is being loaded. Pass the sample's index, sample_rng(i), or set "
                'seed_samples="sample" on the loader to read the batch one sample at a time.'
            )
        k = b.position()
        if b.rng_k == k and b.rng is not None:
            return b.rng
        index = int(b.indices[k])
        made = _local.by_index  # a batched read asked for it by index: its stream goes on
        b.rng = made.get(index) if made is not None else None
        if b.rng is None:
            b.rng = _rng_for(b.seed, b.epoch, index)
        b.rng_k = k
        return b.rng
    rng = _local.rng
    if rng is not None:
        return rng
    key = _local.key
    if key is None:
        return np.random.default_rng(np.random.randint(0, 2**32, size=4, dtype=np.uint64))
    rng = _local.rng = _rng_for(*key)
    return rng


def _rng_of_index(b: BatchSeeds | None, index: int) -> np.random.Generator:
    """:func:`sample_rng` for an explicit ``index`` of the batch (or sample) being loaded."""
    if b is not None:
        k = b.position()
        if not b.batched and k < len(b.indices) and int(b.indices[k]) == index:
            return sample_rng()  # the sample being loaded: one stream, whichever way it is asked
        seed, epoch = b.seed, b.epoch
    elif _local.key is not None:
        seed, epoch, current = _local.key
        if current == index:
            return sample_rng()
    else:
        return sample_rng()  # outside a loader: drawn from numpy's global generator
    cache = _local.by_index
    if cache is None:
        cache = _local.by_index = {}
    rng = cache.get(index)
    if rng is None:
        rng = cache[index] = _rng_for(seed, epoch, index)
    return rng


def _rng_for(seed: int, epoch: int, index: int) -> np.random.Generator:
    # A distinct stream from the global seeding above: append a constant to the entropy.
    return np.random.default_rng(np.random.SeedSequence([*_entropy(seed, epoch, index), 0x5EED]))

"""Epoch plans: which sample indices go into which batch, epoch by epoch.

Everything here is a pure function of its inputs. With aioloader's own sampling (no
user ``sampler``/``batch_sampler``) the order of epoch ``e`` depends only on
``(seed, e, len(dataset))``, the shard and, for ``last_batch="rollover"``, the samples
carried over from the previous epoch. That is what makes resuming O(1): a plan for any
epoch can be rebuilt and entered at any batch without loading a sample.

Sharding is applied to the epoch's order before batching, so every rank sees a disjoint
part of the same permutation.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

__all__ = ["BatchPlanner", "DistributedSampler", "EpochPlan", "shard_indices"]

LastBatch = Literal["keep", "discard", "rollover"]
ShardPolicy = Literal["pad", "drop", "uneven"]

_ORDER_SALT = 0x0D0E  # keeps the order stream apart from per-sample seeds


def epoch_permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    """The shuffled order of ``range(n)`` for one epoch: a pure function of its inputs."""
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch, _ORDER_SALT])))
    dtype = np.int32 if n < 2**31 else np.int64
    return rng.permutation(n).astype(dtype, copy=False)


def shard_indices(order: np.ndarray, rank: int, world_size: int, policy: ShardPolicy) -> np.ndarray:
    """This rank's part of ``order`` (strided, so ranks interleave like torch's sampler).

    ``pad`` repeats from the start of ``order`` until every rank has the same count;
    ``drop`` cuts the tail so every rank has the same count; ``uneven`` is an exact
    partition in which ranks may differ by one sample.
    """
    if world_size == 1:
        return order
    n = len(order)
    if policy == "pad":
        total = -(-n // world_size) * world_size
        if total != n and n > 0:
            order = np.resize(order, total)  # np.resize repeats cyclically from the start
    elif policy == "drop":
        order = order[: (n // world_size) * world_size]
    return order[rank::world_size]


@dataclass(frozen=True)
class EpochPlan:
    """The batches of one epoch for one rank.

    ``batches[k]`` holds the sample indices of batch ``k``; ``carry_in`` is what the
    previous epoch rolled over into this one and ``carry_out`` what this one rolls over.
    """

    epoch: int
    batches: Sequence[np.ndarray]
    carry_in: np.ndarray
    carry_out: np.ndarray

    def __len__(self) -> int:
        return len(self.batches)


def _split(order: np.ndarray, batch_size: int, last_batch: LastBatch) -> tuple[list[np.ndarray], np.ndarray]:
    n_full, rem = divmod(len(order), batch_size)
    batches = [order[k * batch_size : (k + 1) * batch_size] for k in range(n_full)]
    tail = order[n_full * batch_size :]
    empty = order[:0]
    if rem == 0:
        return batches, empty
    if last_batch == "keep":
        batches.append(tail)
        return batches, empty
    if last_batch == "rollover":
        return batches, tail.copy()
    return batches, empty


class BatchPlanner:
    """Turns the loader's sampling options into :class:`EpochPlan` objects."""

    def __init__(
        self,
        length: int,
        *,
        batch_size: int,
        shuffle: bool,
        sampler: Iterable[int] | None,
        batch_sampler: Iterable[Sequence[int]] | None,
        last_batch: LastBatch,
        seed: int,
        shard: tuple[int, int],
        shard_policy: ShardPolicy,
    ) -> None:
        self.length = length
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.sampler = sampler
        self.batch_sampler = batch_sampler
        self.last_batch = last_batch
        self.seed = seed
        self.rank, self.world_size = shard
        self.shard_policy = shard_policy

    @property
    def custom(self) -> Any:
        """The user's sampler or batch sampler, if any."""
        return self.batch_sampler if self.batch_sampler is not None else self.sampler

    def _order(self, epoch: int) -> np.ndarray:
        if self.sampler is not None:
            _set_epoch(self.sampler, epoch)
            order = np.fromiter((int(i) for i in self.sampler), dtype=np.int64)
        elif self.shuffle:
            order = epoch_permutation(self.length, self.seed, epoch)
        else:
            order = np.arange(self.length, dtype=np.int32 if self.length < 2**31 else np.int64)
        return shard_indices(order, self.rank, self.world_size, self.shard_policy)

    def plan(self, epoch: int, carry_in: np.ndarray | None = None) -> EpochPlan:
        """Build epoch ``epoch``'s batches, prepending ``carry_in`` (rollover only)."""
        if self.batch_sampler is not None:
            _set_epoch(self.batch_sampler, epoch)
            batches = [np.asarray([int(i) for i in b], dtype=np.int64) for b in self.batch_sampler]
            if self.world_size > 1:
                batches = batches[self.rank :: self.world_size]
            empty = np.zeros(0, dtype=np.int64)
            return EpochPlan(epoch, batches, empty, empty)
        order = self._order(epoch)
        carry = np.zeros(0, dtype=order.dtype) if carry_in is None else np.asarray(carry_in)
        if len(carry):
            order = np.concatenate([carry.astype(order.dtype, copy=False), order])
        batches, carry_out = _split(order, self.batch_size, self.last_batch)
        return EpochPlan(epoch, batches, carry, carry_out)

    def num_batches(self, carry: int = 0) -> int:
        """Batches in an epoch entered with ``carry`` rolled-over samples (no sampling done)."""
        if self.batch_sampler is not None:
            n = len(self.batch_sampler)  # type: ignore[arg-type]
            if self.world_size > 1:
                n = len(range(self.rank, n, self.world_size))
            return n
        n = len(self.sampler) if self.sampler is not None else self.length  # type: ignore[arg-type]
        n = len(shard_indices(np.empty(n, dtype=np.int8), self.rank, self.world_size, self.shard_policy))
        n += carry
        full, rem = divmod(n, self.batch_size)
        return full + (1 if rem and self.last_batch == "keep" else 0)


def _set_epoch(obj: object, epoch: int) -> None:
    set_epoch = getattr(obj, "set_epoch", None)
    if callable(set_epoch):
        set_epoch(epoch)


class DistributedSampler:
    """A plain sampler giving one rank its part of every epoch, for use with any loader.

    The order of epoch ``e`` is a pure function of ``(seed, e, length)``; call
    :meth:`set_epoch` before each epoch (aioloader's loader does this itself).
    ``drop_last=False`` pads by repeating from the start so that every rank gets the
    same number of samples (like ``torch.utils.data.DistributedSampler``);
    ``drop_last=True`` drops the tail instead.
    """

    def __init__(
        self,
        length: int,
        rank: int,
        world_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank!r}")
        if length < 0:
            raise ValueError(f"length must be >= 0, got {length!r}")
        self.length = length
        self.rank = rank
        self.world_size = world_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _indices(self) -> np.ndarray:
        if self.shuffle:
            order = epoch_permutation(self.length, self.seed, self.epoch)
        else:
            order = np.arange(self.length)
        return shard_indices(order, self.rank, self.world_size, "drop" if self.drop_last else "pad")

    def __iter__(self) -> Any:
        return iter(self._indices().tolist())

    def __len__(self) -> int:
        n, w = self.length, self.world_size
        return n // w if self.drop_last else -(-n // w)

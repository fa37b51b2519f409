"""Epoch plans: which sample indices go into which batch, epoch by epoch.

Everything here is a pure function of its inputs. With aioloader's own sampling (no
user ``sampler``/``batch_sampler``) the order of epoch ``e`` depends only on
``(seed, e, len(dataset))``, the shard and, for ``last_batch="rollover"``, the samples
carried over from the previous epoch. That is what makes resuming O(1): a plan for any
epoch can be rebuilt and entered at any batch without loading a sample.

No plan holds the epoch's order. A plan's ``batches`` is a lazy sequence that computes
batch ``k`` when asked, from arithmetic on positions: rank ``r`` of ``w`` takes global
positions ``r, r + w, r + 2w, ...`` of the epoch (wrapping around for ``pad``), and a
shuffled epoch maps each global position through :class:`~aioloader._plan.permute.IndexShuffle`.
So building a plan costs the same for ten samples as for ``10**12``. Only a user's own
sampler or batch sampler is iterated in full (once per epoch, and checked as it goes).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeVar, overload

import numpy as np
from numpy.typing import NDArray

from .._validate import check_int
from .indices import batch_sampler_batches, check_length, dataset_length, sampler_keys, sampler_order
from .permute import IndexShuffle

__all__ = [
    "BatchPlanner",
    "DistributedSampler",
    "EpochBatches",
    "EpochPlan",
    "RemainingPositions",
    "dataset_length",
    "epoch_permutation",
    "plan_ahead",
    "shard_count",
    "shard_indices",
]

LastBatch = Literal["keep", "discard", "rollover"]
ShardPolicy = Literal["pad", "drop", "uneven"]
Indices = NDArray[np.signedinteger[Any]]
IndexType = type[np.int32] | type[np.int64]

BLOCK = 8192  # positions computed per call: numpy's per-call cost dominates below this


def _index_dtype(n: int) -> IndexType:
    # int32 halves what every batch task pickles for the datasets almost everyone has.
    return np.int32 if n < 2**31 else np.int64


def epoch_permutation(n: int, seed: int, epoch: int) -> Indices:
    """The whole shuffled order of ``range(n)`` for one epoch, as an array (O(n): for
    tests and small ``n``; the planner itself never builds it)."""
    return IndexShuffle(n, seed, epoch)(np.arange(n, dtype=np.uint64)).astype(_index_dtype(n))


def shard_count(n: int, rank: int, world_size: int, policy: ShardPolicy) -> int:
    """How many of an epoch's ``n`` samples rank ``rank`` gets (see :func:`shard_indices`)."""
    if world_size == 1:
        return n
    if policy == "pad":
        return -(-n // world_size)
    if policy == "drop":
        return n // world_size
    return len(range(rank, n, world_size))


def shard_indices(order: np.ndarray, rank: int, world_size: int, policy: ShardPolicy) -> np.ndarray:
    """This rank's part of ``order`` (strided, so ranks interleave like torch's sampler).

    ``pad`` repeats from the start of ``order`` until every rank has the same count;
    ``drop`` cuts the tail so every rank has the same count; ``uneven`` is an exact
    partition in which ranks may differ by one sample. The planner computes the same
    parts arithmetically; this array form serves user samplers.
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


class _Order(Protocol):
    """One rank's order for one epoch: ``count`` samples, any span computable on demand."""

    count: int
    dtype: IndexType

    def take(self, lo: int, hi: int) -> Indices: ...


class _ArrayOrder:
    """An order that exists as an array (from a user's sampler)."""

    def __init__(self, order: NDArray[Any]) -> None:
        self.order = order
        self.count = len(order)
        self.dtype: IndexType = np.int64 if order.dtype != object else order.dtype.type

    def take(self, lo: int, hi: int) -> Indices:
        return self.order[lo:hi]


class _ComputedOrder:
    """Rank ``rank``'s part of epoch order: global position ``rank + world * p``, taken
    modulo ``n`` (``pad`` wraps to the start) and shuffled when ``shuffle`` is given."""

    def __init__(
        self, n: int, rank: int, world: int, policy: ShardPolicy, shuffle: IndexShuffle | None
    ) -> None:
        self.n, self.rank, self.world = n, rank, world
        self.count = shard_count(n, rank, world, policy)
        self.wraps = world > 1 and policy == "pad" and self.count * world > n
        self.shuffle = shuffle
        self.dtype: IndexType = _index_dtype(n)

    def take(self, lo: int, hi: int) -> Indices:
        pos = np.arange(lo, hi, dtype=np.uint64)
        if self.world > 1:
            pos *= np.uint64(self.world)
            pos += np.uint64(self.rank)
            if self.wraps:
                pos %= np.uint64(self.n)
        if self.shuffle is not None:
            pos = self.shuffle.apply(pos)
        return pos.astype(self.dtype)


T = TypeVar("T")


class _Computed(Sequence[T]):
    """A sequence whose items are computed by ``_item(k)`` for ``0 <= k < len``."""

    _len: int
    _noun, _nouns = "item", "items"

    def __len__(self) -> int:
        return self._len

    def _item(self, k: int) -> T:
        raise NotImplementedError

    @overload
    def __getitem__(self, k: int) -> T: ...
    @overload
    def __getitem__(self, k: slice) -> list[T]: ...
    def __getitem__(self, k: int | slice) -> T | list[T]:
        if isinstance(k, slice):
            return [self._item(i) for i in range(*k.indices(self._len))]
        i = int(k) + (self._len if k < 0 else 0)
        if not 0 <= i < self._len:
            raise IndexError(f"{self._noun} {k} out of range for {self._len} {self._nouns}")
        return self._item(i)


class EpochBatches(_Computed[Indices]):
    """The batches of one epoch, computed when indexed: ``batches[k]`` is a fresh array of
    the sample indices of batch ``k``. The epoch is ``carry`` followed by ``order``; only
    its first ``end`` positions are batched (the rest is rolled over or discarded)."""

    _noun, _nouns = "batch", "batches in the epoch"

    def __init__(self, order: _Order, carry: NDArray[np.int64], batch_size: int, end: int) -> None:
        self._order, self._carry, self._bs, self._end = order, carry, batch_size, end
        self._len = -(-end // batch_size)
        self._block: tuple[int, int, Indices] | None = None  # (start, stop, indices) last computed

    def span(self, start: int, stop: int) -> Indices:
        """The indices at positions ``[start, stop)`` of the epoch (carry first)."""
        c = len(self._carry)
        head = self._carry[start:stop]
        if stop <= c:
            return head.astype(self._order.dtype)
        tail = self._order.take(max(start, c) - c, stop - c)
        return np.concatenate([head.astype(tail.dtype), tail]) if len(head) else tail

    def _item(self, k: int) -> Indices:
        start = k * self._bs
        stop = min(start + self._bs, self._end)
        block = self._block  # one read: another thread may replace it meanwhile
        if block is None or not block[0] <= start < stop <= block[1]:
            # Batches are asked for in order: compute the next few in one numpy pass.
            hi = min(self._end, start + max(self._bs, BLOCK))
            block = (start, hi, self.span(start, hi))
            self._block = block
        return block[2][start - block[0] : stop - block[0]].copy()

    def __iter__(self) -> Iterator[Indices]:
        return (self._item(k) for k in range(self._len))


@dataclass(frozen=True)
class EpochPlan:
    """The batches of one epoch for one rank.

    ``batches[k]`` holds the sample indices of batch ``k``; ``carry_in`` is what the
    previous epoch rolled over into this one and ``carry_out`` what this one rolls over.
    """

    epoch: int
    batches: Sequence[Indices]
    carry_in: NDArray[np.int64]
    carry_out: NDArray[np.int64]
    length: int = 0  # len(dataset) this plan was built for

    def __len__(self) -> int:
        return len(self.batches)


class RemainingPositions(_Computed[int]):
    """The batch positions of ``range(total)`` still to deliver on resume: all but the
    first ``prefix`` and those in ``after`` (each ``> prefix``). Memory is O(len(after)),
    not O(total), so resuming deep into a long epoch costs nothing extra."""

    _noun, _nouns = "position", "remaining batch positions"

    def __init__(self, total: int, prefix: int = 0, after: Iterable[int] = ()) -> None:
        self.total, self.prefix = total, min(prefix, total)
        self.after = sorted({p for p in after if self.prefix <= p < total})
        self._len = total - self.prefix - len(self.after)

    def _item(self, i: int) -> int:
        # The i-th remaining position p satisfies p = prefix + i + #(after <= p).
        p = self.prefix + i
        skipped = 0
        while True:
            now = bisect.bisect_right(self.after, p + skipped)
            if now == skipped:
                return p + skipped
            skipped = now

    def __iter__(self) -> Iterator[int]:
        start = self.prefix
        for skip in self.after:
            yield from range(start, skip)
            start = skip + 1
        yield from range(start, self.total)

    def __contains__(self, p: object) -> bool:
        if not isinstance(p, int) or not self.prefix <= p < self.total:
            return False
        j = bisect.bisect_left(self.after, p)
        return j == len(self.after) or self.after[j] != p


def _set_epoch(obj: object, epoch: int) -> None:
    set_epoch = getattr(obj, "set_epoch", None)
    if callable(set_epoch):
        set_epoch(epoch)


def _len_of(obj: Any, what: str) -> int:
    try:
        return check_length(len(obj), f"len({what})")
    except TypeError as exc:
        raise TypeError(f"{what} {type(obj).__name__} must define __len__ to count batches ({exc})") from None


class BatchPlanner:
    """Turns the loader's sampling options into :class:`EpochPlan` objects.

    ``length`` is the dataset's length (see :func:`dataset_length`); a value that is not
    an int in ``[0, 2**63 - 1]`` raises. Planning with aioloader's own order costs O(1)
    time and memory per epoch; a user ``sampler`` or ``batch_sampler`` is iterated once
    per plan, and each index it yields is checked (an int, not a bool, in
    ``[0, length)``) with an error naming the sampler, the position and the value.
    """

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
        keyed: bool = False,
    ) -> None:
        self.length = check_length(length, "len(dataset)")
        self.keyed = keyed  # batch_size=None: a sampler may yield any key, as in torch
        self.batch_size = check_int("batch_size", batch_size, 1)
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

    def order(self, epoch: int, n: int) -> _Order:
        """This rank's order of epoch ``epoch`` for ``n`` samples (no batching)."""
        if self.sampler is not None:
            _set_epoch(self.sampler, epoch)
            order = sampler_keys(self.sampler, n) if self.keyed else sampler_order(self.sampler, n)
            return _ArrayOrder(shard_indices(order, self.rank, self.world_size, self.shard_policy))
        shuffle = IndexShuffle(n, self.seed, epoch) if self.shuffle else None
        return _ComputedOrder(n, self.rank, self.world_size, self.shard_policy, shuffle)

    def _length(self, length: int | None) -> int:
        return self.length if length is None else check_length(length, "len(dataset)")

    def _carry(self, carry_in: Any, n: int) -> NDArray[np.int64]:
        if carry_in is None:
            return np.zeros(0, dtype=np.int64)
        carry = np.asarray(carry_in)
        if carry.ndim != 1 or (carry.size and carry.dtype.kind not in "iu"):
            raise TypeError(f"rolled-over indices must be a 1-d array of ints, got {carry_in!r}")
        bad = np.flatnonzero((carry < 0) | (carry >= n))
        if bad.size:
            raise ValueError(
                f"rolled-over index {int(carry[bad[0]])} is outside [0, {n}): "
                "the state does not belong to this dataset"
            )
        return carry.astype(np.int64)

    def plan(self, epoch: int, carry_in: Any = None, length: int | None = None) -> EpochPlan:
        """Build epoch ``epoch``'s batches, prepending ``carry_in`` (rollover only), for a
        dataset of ``length`` samples (default: the planner's ``length``)."""
        empty = np.zeros(0, dtype=np.int64)
        n = self._length(length)
        if self.batch_sampler is not None:
            _set_epoch(self.batch_sampler, epoch)
            batches = batch_sampler_batches(self.batch_sampler, n)
            if self.world_size > 1:
                batches = batches[self.rank :: self.world_size]
            return EpochPlan(epoch, batches, empty, empty, n)
        return self._ordered_plan(epoch, carry_in, n)

    def _ordered_plan(self, epoch: int, carry_in: Any, n: int) -> EpochPlan:
        empty = np.zeros(0, dtype=np.int64)
        order = self.order(epoch, n)
        carry = self._carry(carry_in, n)
        total = len(carry) + order.count
        end = total if self.last_batch == "keep" else total - total % self.batch_size
        batches = EpochBatches(order, carry, self.batch_size, end)
        carry_out = empty
        if self.last_batch == "rollover" and end < total:
            carry_out = batches.span(end, total).astype(np.int64)
        return EpochPlan(epoch, batches, carry, carry_out, n)

    def num_batches(self, carry: int = 0, length: int | None = None) -> int:
        """Batches in an epoch entered with ``carry`` rolled-over samples, for a dataset of
        ``length`` samples (default: the planner's ``length``; no sampling done)."""
        if self.batch_sampler is not None:
            n = _len_of(self.batch_sampler, "batch_sampler")
            return len(range(self.rank, n, self.world_size))
        n = _len_of(self.sampler, "sampler") if self.sampler is not None else self._length(length)
        n = shard_count(n, self.rank, self.world_size, self.shard_policy) + carry
        full, rem = divmod(n, self.batch_size)
        return full + (1 if rem and self.last_batch == "keep" else 0)


def plan_ahead(planner: BatchPlanner, dataset: Any, epoch: int, carry: np.ndarray) -> EpochPlan:
    """The next epoch built ahead of time (the loader discards it if ``len(dataset)``
    changed meanwhile)."""
    return planner.plan(epoch, carry, dataset_length(dataset))


class DistributedSampler:
    """A plain sampler giving one rank its part of every epoch, for use with any loader.

    The order of epoch ``e`` is a pure function of ``(seed, e, length)`` (the same order
    the loader's own ``shuffle`` and ``shard`` give), computed as it is iterated, so it
    needs no memory proportional to ``length``. Call :meth:`set_epoch` before each epoch
    (aioloader's loader does this itself). ``drop_last=False`` pads by repeating from the
    start so that every rank gets the same number of samples (like
    ``torch.utils.data.DistributedSampler``); ``drop_last=True`` drops the tail instead.
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
            raise ValueError(
                f"rank must be in [0, world_size={world_size}), got {rank!r}; "
                f"Invalid rank {rank}, rank should be in the interval [0, {world_size - 1}]"
            )
        self.length = check_length(length, "length")
        self.rank = rank
        self.world_size = world_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        shuffle = IndexShuffle(self.length, self.seed, self.epoch) if self.shuffle else None
        policy: ShardPolicy = "drop" if self.drop_last else "pad"
        order = _ComputedOrder(self.length, self.rank, self.world_size, policy, shuffle)
        for lo in range(0, order.count, BLOCK):
            yield from order.take(lo, min(lo + BLOCK, order.count)).tolist()

    def __len__(self) -> int:
        return shard_count(self.length, self.rank, self.world_size, "drop" if self.drop_last else "pad")

"""A loader's ``sampler`` and ``batch_sampler`` as torch's loader has them.

Tools rebuild a torch loader from these attributes (accelerate's
``skip_first_batches`` does). Each view computes the loader's own order for its rank
from the planner, so a torch loader built on it reads the batches this loader would.
A view holds no loader: it outlives the loader it came from.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from .sampler import BatchPlanner, dataset_length, shard_count

__all__ = ["EpochBatchSampler", "EpochCell", "EpochSampler"]


class EpochCell:
    """The epoch the loader runs or will run next; the loader keeps it current."""

    __slots__ = ("epoch",)

    def __init__(self) -> None:
        self.epoch = 0


class _View:
    def __init__(self, planner: BatchPlanner, keys: Any, cell: EpochCell) -> None:
        self._planner, self._keys, self._cell = planner, keys, cell
        self._pinned: int | None = None

    def set_epoch(self, epoch: int) -> None:
        """Pin this view to epoch ``epoch``, as ``DistributedSampler.set_epoch`` does.
        The loader's own epoch is not changed."""
        self._pinned = int(epoch)

    @property
    def epoch(self) -> int:
        """The epoch a pass over this view gives: the pinned one, else the loader's."""
        return self._cell.epoch if self._pinned is None else self._pinned

    def _length(self) -> int:
        return dataset_length(self._keys)


class EpochSampler(_View):
    """The sample indices of one epoch, in the loader's order, for the loader's rank."""

    def __iter__(self) -> Iterator[int]:
        order = self._planner.order(self.epoch, self._length())
        yield from order.take(0, order.count).tolist()

    def __len__(self) -> int:
        p = self._planner
        return shard_count(self._length(), p.rank, p.world_size, p.shard_policy)

    def __repr__(self) -> str:
        return f"<aioloader sampler: epoch {self.epoch}, shuffle={self._planner.shuffle}>"


class EpochBatchSampler(_View):
    """The batches of one epoch as lists of indices, as the loader builds them (a
    rolled-over tail is not carried into the next pass)."""

    def __init__(self, planner: BatchPlanner, keys: Any, cell: EpochCell, sampler: Any) -> None:
        super().__init__(planner, keys, cell)
        self.sampler = sampler
        self.batch_size = planner.batch_size
        self.drop_last = planner.last_batch != "keep"

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        if isinstance(self.sampler, EpochSampler):
            self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[list[int]]:
        for batch in self._planner.plan(self.epoch, None, self._length()).batches:
            yield batch.tolist()

    def __len__(self) -> int:
        return self._planner.num_batches(0, self._length())

    def __repr__(self) -> str:
        return f"<aioloader batch_sampler: epoch {self.epoch}, batch_size={self.batch_size}>"

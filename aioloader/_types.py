"""The contracts of what users pass in, written down once and used in the public
signatures. They are structural (``typing.Protocol``): any object with the methods
qualifies, a torch ``Dataset`` or a plain class alike."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, Iterable, Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

from typing_extensions import TypeVar

__all__ = ["Batch", "BatchSampler", "CollateFn", "MapDataset", "Sample", "Sampler", "StreamSource"]

Sample = TypeVar("Sample", covariant=True)
Batch = TypeVar("Batch", default=Any)  # what a loader yields; Any unless annotated


@runtime_checkable
class MapDataset(Protocol[Sample]):
    """A map-style dataset: ``len(ds)`` samples, ``ds[i]`` for ``0 <= i < len(ds)``.

    With workers it must pickle (it is sent to each worker once, so open files and
    connections are best opened lazily in the worker); ``ds[i]`` must be a pure function
    of ``i`` and the per-sample random state for resume and determinism to hold.
    """

    def __len__(self) -> int: ...

    def __getitem__(self, index: int, /) -> Sample: ...


class Sampler(Protocol):
    """A re-iterable of sample indices (one pass per epoch). Optional methods the loader
    calls when present: ``set_epoch(epoch)`` before each pass, ``__len__``, and
    ``state_dict()``/``load_state_dict(state)`` for exact resume."""

    def __iter__(self) -> Iterator[int]: ...


class CollateFn(Protocol):
    """Turns the list of a batch's samples into one batch; runs in a worker (with
    workers it must pickle; a lambda or closure does, by value)."""

    def __call__(self, samples: list[Any], /) -> Any: ...


#: What a StreamLoader reads: a synchronous iterable, an async iterable, or an
#: ``asyncio.Queue`` (ended by :data:`aioloader.stream.END` or ``queue.shutdown()``).
StreamSource = Iterable[Any] | AsyncIterable[Any] | asyncio.Queue[Any]

#: A batch sampler: a re-iterable of index sequences.
BatchSampler = Iterable[Sequence[int]]

"""The ``for`` face's iterator: a generator wrapped so that a batch's error does not end it.

A generator that raises is over, and torch's iterator goes on after a failed batch. The
face stays a generator (its cleanup runs when it is closed or collected); it yields a
:class:`~aioloader._engine.units.Failed` for a batch that raised, and the wrapper raises
its error. The wrapper drops its own reference before raising, so that the error's
traceback does not keep the iteration alive after a ``for`` loop that it ended.

The ``async for`` face is not wrapped: an error ends it, and its run is finished before
the error reaches the caller (see ``IterableLoader._aiterate``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ._engine.units import Failed

__all__ = ["GoesOn"]


class GoesOn(Iterator[Any]):
    __slots__ = ("_gen",)

    def __init__(self, gen: Iterator[Any]) -> None:
        self._gen = gen

    def __iter__(self) -> GoesOn:
        return self

    def __next__(self) -> Any:
        item = next(self._gen)
        if type(item) is Failed:
            error = item.error
            del self, item
            raise error
        return item

    def close(self) -> None:
        """End the iteration now (as closing a generator does)."""
        close = getattr(self._gen, "close", None)
        if close is not None:
            close()

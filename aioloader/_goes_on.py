"""The faces' iterators: generators wrapped so that a batch's error does not end them.

A generator that raises is over, and torch's iterator goes on after a failed batch. The
faces stay generators (their cleanup runs when they are closed or collected, and an
async one is finalised by its event loop); they yield a
:class:`~aioloader._engine.units.Failed` for a batch that raised, and the wrapper raises
its error. The wrappers drop their own reference before raising, so that the error's
traceback does not keep the iteration alive after a ``for`` loop that it ended.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

from ._engine.units import Failed

__all__ = ["GoesOn", "GoesOnAsync"]


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


class GoesOnAsync(AsyncIterator[Any]):
    __slots__ = ("_agen",)

    def __init__(self, agen: AsyncIterator[Any]) -> None:
        self._agen = agen

    def __aiter__(self) -> GoesOnAsync:
        return self

    async def __anext__(self) -> Any:
        item = await self._agen.__anext__()
        if type(item) is Failed:
            error = item.error
            del self, item
            raise error
        return item

    async def aclose(self) -> None:
        """End the iteration now (as closing an async generator does)."""
        aclose = getattr(self._agen, "aclose", None)
        if aclose is not None:
            await aclose()

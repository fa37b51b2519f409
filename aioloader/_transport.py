"""How a finished batch travels from a worker to the consumer.

``pickle``: the batch is the task's return value; the executor pickles it through its
result pipe. This is the only transport for threads and borrowed executors.
(The shared-memory transport plugs in here: a worker-side ``encode`` that writes
array leaves into shared memory and returns a small descriptor, and a consumer-side
``decode`` that turns the descriptor back into arrays viewing that memory.)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["Transport", "TransportKind", "make_transport"]

TransportKind = Literal["auto", "shm", "pickle"]


@dataclass
class Transport:
    """A pair of functions: ``encode`` runs in the worker (and must pickle), ``decode`` in
    the consumer. ``None`` means identity."""

    kind: Literal["shm", "pickle"]
    encode: Callable[[Any], Any] | None = None
    decode: Callable[[Any], Any] | None = None

    def close(self) -> None:
        """Release what the transport holds (segments, arenas). Idempotent."""


def make_transport(kind: TransportKind, *, pool_kind: str, prefetch: int) -> Transport:
    """Choose the transport for a loader (see the module docstring)."""
    return Transport("pickle")

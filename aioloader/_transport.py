"""How a finished batch travels from a worker to the consumer.

``pickle``: the batch is the task's return value, pickled into the reply (an owned
worker's channel, or a borrowed executor's own way home). The only transport for threads (``num_workers=0``, where nothing is copied
anyway) and, unless asked otherwise, for borrowed executors (they may run elsewhere).

``shm``: array leaves travel through shared memory (see :mod:`aioloader._shm` for the
slabs, and for who creates and who unlinks them). The worker-side ``encode`` (and, with
:func:`~aioloader.default_collate`, the same collate stacking its large arrays and torch
tensors straight into shared memory) returns a small descriptor, whose unpickling in
the consumer builds the arrays that view the memory; the consumer-side ``decode``
returns that batch (or raises what went wrong) and warns once about a fallback. ``transport="shm"`` on a borrowed executor is honoured per worker: a worker
that cannot share memory with the consumer (another host, container or pid namespace)
pickles its batches and the consumer warns once.

``auto``: ``shm`` for the loader's own process pool on Linux, else ``pickle``. Small
batches cost nothing extra either way: leaves under 64 KiB are pickled inline.

Whoever asked for shared memory gets one :class:`~aioloader.ShmFallbackWarning` when it
cannot be used (no ``/dev/shm``, or too little room for the in-flight window).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

from . import _shm
from ._collate import collate_torch, default_collate

__all__ = ["Transport", "TransportKind", "make_transport"]

TransportKind = Literal["auto", "shm", "pickle"]


@dataclass
class Transport:
    """A pair of functions: ``encode`` runs in the worker (and must pickle), ``decode`` in
    the consumer. ``None`` means identity."""

    kind: Literal["shm", "pickle"]
    encode: Callable[[Any], Any] | None = None
    decode: Callable[[Any], Any] | None = None

    def wrap_collate(self, collate_fn: Callable[[list[Any]], Any]) -> Callable[[list[Any]], Any]:
        """The collate function to ship to the workers in place of ``collate_fn``."""
        return collate_fn

    def allow_growth(self, most: int, budget: int) -> None:
        """The loader's window may grow to ``most`` batches within ``budget`` bytes of
        batches: size for that. Before the first run only (workers get it with it)."""

    def close(self) -> None:
        """Release what the transport holds (segments, arenas). Idempotent."""


@dataclass
class ShmTransport(Transport):
    """Shared-memory transport; ``close`` removes what dead workers left in /dev/shm."""

    closed: bool = False

    def wrap_collate(self, collate_fn: Callable[[list[Any]], Any]) -> Callable[[list[Any]], Any]:
        # Only our own collate is replaced: its result is known to be the same, and it
        # writes each byte once, straight into the slab. A user's collate_fn keeps its
        # behaviour; encode copies its large array leaves into the slab afterwards.
        if collate_fn in (default_collate, collate_torch) and isinstance(self.encode, _shm.ShmEncoder):
            return _shm.ShmCollate(self.encode, as_torch=collate_fn is collate_torch)
        return collate_fn

    def allow_growth(self, most: int, budget: int) -> None:
        # Each worker may hold the whole grown window, and as many again held by the
        # consumer; the byte budget bounds what those slabs hold, and the room check.
        if isinstance(self.encode, _shm.ShmEncoder):
            cfg = self.encode.config
            self.encode.config = replace(
                cfg, max_slabs=max(cfg.max_slabs, 2 * most + 2), grown=most, grown_bytes=budget
            )

    def close(self) -> None:
        # Called after the loader's own pool is shut down (its workers are dead), so
        # every name of theirs can go now, in-flight grace or not (rule 6).
        if self.closed:
            return
        self.closed = True
        _shm.sweep(force=True)


def make_transport(kind: TransportKind, *, pool_kind: str, prefetch: int) -> Transport:
    """Choose the transport for a loader (see the module docstring).

    Raises ``ValueError`` if ``AIOLOADER_SHM_CAPACITY`` is set to something that is not
    a size. Emits :class:`~aioloader.ShmFallbackWarning` when ``kind="shm"`` was asked
    for a process pool and this machine has no usable ``/dev/shm``.
    """
    if kind == "pickle" or pool_kind == "thread":
        return Transport("pickle")
    if pool_kind != "process" and kind == "auto":
        return Transport("pickle")  # a borrowed executor may run on other hosts
    reason = _shm.unavailable_reason()
    if reason is not None:
        if kind == "shm":
            warnings.warn(
                _shm.ShmFallbackWarning(f"transport='shm' is not available: {reason}; batches are pickled"),
                stacklevel=3,
            )
        return Transport("pickle")
    config = _shm.ShmConfig(
        consumer_pid=os.getpid(),
        host=_shm.host_key(),
        window=prefetch + 1,
        # The window, plus as many again for batches the consumer is still holding.
        max_slabs=2 * prefetch + 2,
        capacity=_shm.capacity_limit(),
    )
    _shm.sweep()  # leftovers of runs killed together with their workers
    return ShmTransport("shm", encode=_shm.ShmEncoder(config), decode=_shm.ShmDecoder())

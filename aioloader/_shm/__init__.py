"""Zero-copy shared-memory batches: slabs, arenas, descriptors, and who frees what.

Vocabulary
----------
*slab*
    One file in ``/dev/shm`` named ``aioloader_<consumer pid>_<worker pid>_<nonce>_<seq>``,
    mapped by one worker and by the consumer, holding one batch at a time. Its first 4 KiB
    are a header whose int64 *state word* is ``0`` when the slab is free and otherwise the
    *ticket* of the batch occupying it.
*arena*
    A worker's slabs for one consumer process: created lazily, reused for every later
    batch, at most ``max_slabs`` of them (``2 * window + 2``, for the most the window
    may grow to); a slab left unused for ``4 * max_slabs`` batches is dropped, so an
    arena follows its working set.
*descriptor*
    What crosses the executor's pipe instead of the arrays: the batch itself, pickled,
    with every large leaf replaced by a reference to its bytes (offset, shape, dtype) in
    one slab, which the descriptor names (slab name, ticket) once.

Ownership rules
---------------
1. **Workers create.** A worker creates a slab with ``os.open(O_CREAT | O_EXCL, 0o600)``
   on ``/dev/shm``, reserves its pages with ``posix_fallocate`` (so a full ``/dev/shm``
   is an ``ENOSPC`` error at creation, never a ``SIGBUS`` while writing), maps it and
   closes the fd at once (libc ``mmap``: ``mmap.mmap`` would keep a duplicate fd per
   slab). The resource tracker is never involved: in 3.11 it would register the segment
   again in every attaching process and unlink it twice.
2. **The consumer unlinks on arrival.** When a descriptor is unpickled in the consumer
   (in the pool's I/O thread, before anyone awaits it) the consumer maps the
   slab, the first time it sees it, and unlinks its name. From then on the slab has no
   name: it is two mappings and disappears with the last of them. A name therefore
   exists only between a slab's creation and the arrival of the first batch written to
   it (milliseconds, once per slab); reused slabs cross the channel as names already gone.
3. **Occupancy is a state word.** A worker writes only into a slab whose state is 0, and
   stores its ticket there before writing. The consumer stores 0 again when the last
   array viewing the batch is gone: the arrays' ``base`` chain ends in an owner object
   whose ``weakref.finalize`` frees the slab. The arrays are made while the descriptor
   is unpickled, so a batch that arrives but is never taken (an epoch abandoned
   mid-way, a cancelled future) frees its slab when it is garbage-collected, like any
   other. Holding batches therefore only makes the worker use another slab; when it
   has ``max_slabs`` busy it sends that batch pickled (correct, slower, never blocking).
4. **A worker dies mid-write** (a crash, ``SIGKILL``): its newest slab may still have a
   name that no consumer will ever attach. The consumer unlinks every
   ``aioloader_<its pid>_<dead pid>_*`` name when it first hears from a new worker
   (names older than a few seconds) and unconditionally when the loader closes. Its
   mappings of the dead worker's slabs are dropped at the same time (memory returns
   once the consumer's batches from them are gone).
5. **The consumer is killed.** Slabs that already arrived have no name. Each worker
   watches its consumer (a ``pidfd``, else polling) from a daemon thread and unlinks
   every name it created when the consumer exits; the arena then refuses new slabs. A
   worker killed together with its consumer can leave at most its newest name behind;
   the next aioloader transport created on the machine removes ``aioloader_*`` names
   whose consumer and worker processes are both gone (same user, older than a minute).
6. **The loader is closed or garbage-collected.** The loader shuts its own pool down
   first (workers are joined), then closes the transport, which unlinks every remaining
   name of this consumer whose worker is dead. Batches the user still holds stay valid:
   their mappings live as long as their arrays. Workers of a shared pool keep their
   arenas for the next loader (bounded by ``max_slabs`` each).
7. **Too little room.** Before a worker creates a slab larger than any it has, it checks
   ``os.statvfs('/dev/shm')`` for room for the whole window (``(prefetch + 1) x`` the
   slab; a window that grows counts as far as it may grow for batches that large). If it is short, or creation fails, the worker sends that loader's batches
   pickled from then on, and the consumer emits one :class:`ShmFallbackWarning` saying
   how to enlarge ``/dev/shm``. ``AIOLOADER_SHM_CAPACITY`` (bytes, ``K``/``M``/``G``
   suffixes) caps the free space assumed, for tests and for sharing a node politely.

What goes through shared memory: exact ``numpy.ndarray`` leaves of at least 64 KiB
inside dicts, ``OrderedDict``s, lists, tuples and namedtuples. With
:func:`~aioloader.default_collate` the worker stacks samples straight into the slab (one
write per byte), through the collate's own stacking hook, and large stacks of plain CPU
torch tensors go there too (they arrive as ``torch.from_numpy`` views). Everything else
travels pickled inside the descriptor.

Modules: :mod:`._names` (names, capacity, liveness, sweeping names), :mod:`._mapping`
(mappings and the views that keep them alive), :mod:`._arena` (a worker's slabs),
:mod:`._encode` (a worker's batches into slabs), :mod:`._decode` (the consumer's side).
Linux only (``/dev/shm``, ``/proc``); elsewhere ``transport="auto"`` means pickle. The
whole package runs in workers and never imports asyncio.
"""

from __future__ import annotations

import os

from ..errors import SharedMemoryError, ShmFallbackWarning
from ._decode import ShmDecoder, mapped_slabs, sweep
from ._encode import ShmBatch, ShmCollate, ShmEncoder
from ._mapping import _Export

# SHM_DIR below is a copy: code reads _names.SHM_DIR, the one to point elsewhere in a test.
from ._names import (
    CAPACITY_ENV,
    FOREIGN_GRACE_S,
    PREFIX,
    SHM_DIR,
    ShmConfig,
    _parse_name,
    _pid_alive,
    _unlink,
    host_key,
    parse_capacity,
    unavailable_reason,
)

__all__ = [
    "CAPACITY_ENV",
    "FOREIGN_GRACE_S",
    "PREFIX",
    "SHM_DIR",
    "SharedMemoryError",
    "ShmBatch",
    "ShmCollate",
    "ShmConfig",
    "ShmDecoder",
    "ShmEncoder",
    "ShmFallbackWarning",
    "_Export",
    "_parse_name",
    "_pid_alive",
    "_unlink",
    "capacity_limit",
    "capacity_override",
    "host_key",
    "mapped_slabs",
    "sweep",
    "unavailable_reason",
]

#: Tests may set this (bytes) instead of the environment variable; read by the consumer
#: when a transport is made, and shipped to the workers with the encoder. It lives in the
#: package itself so that assigning ``aioloader._shm.capacity_override`` takes effect.
capacity_override: int | None = None


def capacity_limit() -> int | None:
    """The injected cap on free ``/dev/shm`` bytes (module hook, else environment).
    Raises ``ValueError`` naming the variable when it is not a size."""
    if capacity_override is not None:
        return int(capacity_override)
    return parse_capacity(os.environ.get(CAPACITY_ENV, ""))

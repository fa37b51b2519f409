"""A worker's ring of spilled replies: one shared mapping instead of a file per reply.

A reply too large for one atomic pipe write is spilled beside the pipe
(:mod:`aioloader._reply`). A file per reply costs a create, a write and a close in the
worker and an open, an unlink, a read and a close in the consumer: about 80 us on each
side for a 4 KiB reply, as much as building a batch of 256 ints. Small spills (up to a
quarter of the ring) go instead into a ring that each worker maps once:

* The worker creates it (``<prefix><consumer>_<worker>_spill<nonce>_ring`` in
  ``/dev/shm``, its space reserved up front, so that a full ``/dev/shm`` is an error at
  creation and never a SIGBUS later), writes each reply at the next free offset, then
  sends through the pipe a reply that names the ring, the offset and the length.
* The consumer maps the ring on its first reply and unlinks the name at once (both
  mappings stay valid); the executor's result thread copies each reply out as it
  arrives and then stores, in the ring's header, how far it has read.
* A worker's replies arrive in the order it wrote them, so the consumer's position only
  grows, and the worker reuses space up to it. A reply that does not fit (the consumer
  is behind, or the reply is large) is spilled to a file as before.

A worker killed while it writes into the ring has sent nothing for that reply, so no one
reads the half-written bytes. Its ring, if the consumer never mapped it, is a spill
file of a dead worker, and the consumer's sweep removes it like the others; the worker
removes it itself if its consumer dies first.

This module never imports asyncio.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import numpy as np

from . import _orphan
from ._shm import _parse_name, _pid_alive

__all__ = ["ALIGN", "SIZE", "SPILL_TAG", "aligned", "copy_out", "drop", "put", "sweep", "write"]

SIZE = 1 << 20  # bytes a worker reserves for its ring
HEADER = 64  # the consumer's read position (int64), alone on its cache line
REPLY_MAX = (SIZE - HEADER) // 4  # larger replies go to files, leaving the ring to small ones
MAPPED_MAX = 64  # rings a consumer keeps mapped (one per live worker is what it needs)
_POS = struct.Struct("<q")
T = TypeVar("T")
ALIGN = 64  # every part of a spilled reply starts at a multiple of this
SPILL_TAG = "spill"  # in the names of spill files and rings
SWEEP_GRACE_S = 5.0  # a dead worker's spill file younger than this may still be in flight
FOREIGN_GRACE_S = 60.0


class _Ring:
    """The worker's side."""

    def __init__(self, path: str) -> None:
        def reserve(fd: int) -> mmap.mmap:
            fallocate = getattr(os, "posix_fallocate", None)  # not on macOS: files, then
            if fallocate is None:
                raise OSError("no posix_fallocate here: the ring's space cannot be reserved")
            fallocate(fd, 0, SIZE)  # ENOSPC now, not SIGBUS on a later write
            return mmap.mmap(fd, SIZE)

        self.map = _create(path, os.O_RDWR, reserve)
        self.path = path
        self.pid = os.getpid()
        self.head = 0  # where the next reply goes, counted from the ring's creation

    def put(self, parts: list[Any], sizes: list[int], need: int) -> int | None:
        cap = SIZE - HEADER
        if need > REPLY_MAX:
            return None
        (consumed,) = _POS.unpack_from(self.map, 0)
        pos = self.head
        off = pos % cap
        if off + need > cap:  # a reply is never split: start it at the beginning
            pos += cap - off
            off = 0
        if pos + need - consumed > cap:
            return None  # the consumer has not read far enough yet
        at = HEADER + off
        for part, size in zip(parts, sizes, strict=True):
            self.map[at : at + size] = memoryview(part).cast("B")
            at += aligned(size)
        self.head = pos + need
        return pos


_ring: _Ring | None = None


def aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def put(directory: str, prefix: str, parts: list[Any], sizes: list[int], need: int) -> tuple[str, int] | None:
    """In a worker: write ``parts`` (of ``sizes`` bytes, each padded to :data:`ALIGN`,
    ``need`` in all) into this worker's ring, created in ``directory`` as
    ``<prefix>ring`` on first use; the ring's path and the reply's offset, or ``None``
    to spill to a file instead."""
    global _ring
    if need > REPLY_MAX:
        return None  # before the ring exists: one that no reply names would keep its name
    ring = _ring
    if ring is None or ring.pid != os.getpid():
        try:
            ring = _ring = _Ring(os.path.join(directory, prefix + "ring"))
        except OSError:
            return None
        _orphan.on_orphaned(_remove)
    pos = ring.put(parts, sizes, need)
    return None if pos is None else (ring.path, pos)


def _remove() -> None:
    ring = _ring
    if ring is not None:
        with contextlib.suppress(OSError):
            os.unlink(ring.path)


# ---------------------------------------------------------------------- consumer side
_mapped: OrderedDict[str, tuple[int, mmap.mmap]] = OrderedDict()  # path -> (worker pid, map)
_lock = threading.Lock()  # several pools' result threads may read at once


def copy_out(path: str, pos: int, need: int, pid: int) -> np.ndarray:
    """In the consumer: a copy of the reply at ``pos``; then the worker may reuse its
    space. Raises ``OSError`` if the ring is gone."""
    with _lock:
        entry = _mapped.get(path)
        if entry is None:
            fd = os.open(path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0))
            try:
                entry = (pid, mmap.mmap(fd, SIZE))
            finally:
                os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(path)  # both mappings outlive the name
            _mapped[path] = entry
            while len(_mapped) > MAPPED_MAX:
                _mapped.popitem(last=False)[1][1].close()
        else:
            _mapped.move_to_end(path)
        ring = entry[1]
        off = HEADER + pos % (SIZE - HEADER)
        data = np.frombuffer(ring, dtype=np.uint8, count=need, offset=off).copy()
        _POS.pack_into(ring, 0, pos + need)
        return data


def drop(dead: set[int]) -> None:
    """In the consumer: unmap the rings of workers that are gone."""
    with _lock:
        for path in [p for p, (pid, _) in _mapped.items() if pid in dead]:
            ring = _mapped.pop(path)[1]
            with contextlib.suppress(BufferError):
                ring.close()


# ---------------------------------------------------------------------- spill files
def write(path: str, parts: list[Any]) -> None:
    """Write ``parts``, each padded to :data:`ALIGN`, with as few system calls as the
    kernel allows (one ``writev`` as a rule)."""
    iov: list[memoryview] = []
    for part in parts:
        view = memoryview(part).cast("B")
        iov.append(view)
        if aligned(view.nbytes) > view.nbytes:
            iov.append(memoryview(bytes(aligned(view.nbytes) - view.nbytes)))

    def fill(fd: int) -> None:
        while iov:
            n = os.writev(fd, iov[:1024])  # IOV_MAX
            while iov and n >= iov[0].nbytes:
                n -= iov.pop(0).nbytes
            if n:
                iov[0] = iov[0][n:]

    _create(path, os.O_WRONLY, fill)


def _create(path: str, access: int, fill: Callable[[int], T]) -> T:
    """Create ``path`` (mode 0600, never one that exists or a link), and return what
    ``fill`` makes of its descriptor; if ``fill`` fails, the file is removed."""
    flags = access | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(path, flags, 0o600)
    try:
        return fill(fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise
    finally:
        os.close(fd)


def sweep(dirs: tuple[str, ...], dead: Iterable[int] = ()) -> int:
    """Remove spill files in ``dirs`` nobody will read; returns how many.

    This consumer's files written by a pid in ``dead`` go at once (their generation is
    retired: nothing reads its replies any more), those of other dead workers once they
    are a few seconds old. Other consumers' files go when both their processes are
    gone, they belong to this user and are over a minute old."""
    gone = set(dead)
    drop(gone)
    removed = 0
    for directory in dict.fromkeys(dirs):
        with contextlib.suppress(OSError):
            for entry in os.scandir(directory):
                with contextlib.suppress(OSError):
                    if _stale(entry.name, entry.stat(follow_symlinks=False), gone):
                        os.unlink(entry.path)
                        removed += 1
    return removed


def _stale(name: str, st: os.stat_result, gone: set[int]) -> bool:
    pids = _parse_name(name)
    if pids is None or not name.split("_")[3].startswith(SPILL_TAG):
        return False  # not ours, or a shared-memory slab (aioloader._shm's business)
    consumer, worker = pids
    age = time.time() - st.st_mtime
    if consumer == os.getpid():
        return worker in gone or (age >= SWEEP_GRACE_S and not _pid_alive(worker))
    return (
        st.st_uid == os.getuid()
        and age >= FOREIGN_GRACE_S
        and not (_pid_alive(consumer) or _pid_alive(worker))
    )

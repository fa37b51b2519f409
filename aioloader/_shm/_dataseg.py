"""Large arrays of a loader's payload, in one shared-memory segment mapped by every worker.

A payload (dataset, ``collate_fn``, ``worker_init_fn``, a stream's ``fn``) is pickled once
in the consumer. With protocol 5, numpy hands the pickler each contiguous array's memory
as a :class:`pickle.PickleBuffer` instead of copying it into the pickle; the buffers of at
least :data:`MIN_SHARED_BYTES` go *out of band*: the consumer writes them once into a
*data segment* ``aioloader_<pid>_<pid>_<nonce>_d<seq>`` (the worker field is the
consumer's own pid, so the sweeps of :mod:`._names` treat it as the consumer's), and the
payload becomes a small :class:`SharedPayload` envelope: the in-band pickle and where
each buffer lies in the segment.

A worker maps the segment copy-on-write (``MAP_PRIVATE``) and unpickles the in-band part
over views of it: the arrays are the segment's page-cache pages, shared by every worker
and every respawned worker, and a worker that writes into one gets a private copy of the
pages it touches (the semantics of ``fork``), never a change the others see. Mapping is
lazy, so a worker's start-up does not grow with the data.

Who unlinks the name: the loader when it closes (or is collected, or at interpreter
exit); if the consumer is killed, every worker that mapped the segment, from its orphan
watch; if nobody is left, the next transport's sweep of names whose processes are all
gone. Worker side and consumer side both; never imports asyncio.
"""

from __future__ import annotations

import os
import pickle
import secrets
import threading
import warnings
import weakref
from collections.abc import Callable
from itertools import count
from typing import Any, NamedTuple

from ..errors import ShmFallbackWarning
from . import _names
from ._mapping import _Mapping, bytes_at
from ._names import PREFIX, _unlink, enlarge_advice

__all__ = ["MIN_SHARED_BYTES", "SHARE_ENV", "DataSegment", "SharedPayload", "collector", "share", "sharing_enabled"]

MIN_SHARED_BYTES = 1 << 20  # smaller arrays cost less pickled than a page-aligned span
SHARE_ENV = "AIOLOADER_SHARE_ARRAYS"  # "0" turns sharing off (the copy-per-worker of before)
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_nonce = secrets.token_hex(4)
_seq = count()


def sharing_enabled() -> bool:
    """May payload arrays go through a data segment in this process?"""
    return os.environ.get(SHARE_ENV, "1").strip() != "0" and _names.unavailable_reason() is None


def collector(into: list[pickle.PickleBuffer]) -> Callable[[pickle.PickleBuffer], bool]:
    """A ``buffer_callback`` that keeps buffers of at least :data:`MIN_SHARED_BYTES` out of
    band (appending them to ``into``) and lets smaller ones be pickled in band."""

    def callback(buf: pickle.PickleBuffer) -> bool:
        try:
            n = buf.raw().nbytes
        except BufferError:  # not contiguous: pickle it in band
            return True
        if n < MIN_SHARED_BYTES:
            return True
        into.append(buf)
        return False

    return callback


class SharedPayload(NamedTuple):
    """What a worker receives instead of a payload whose arrays live in a data segment."""

    name: str
    size: int
    spans: tuple[tuple[int, int], ...]  # (offset, nbytes) of each out-of-band buffer
    inband: bytes

    def load(self) -> Any:
        """Map the segment (copy-on-write) and unpickle the payload over it (worker side)."""
        fd = os.open(_names.path(self.name), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            mapping = _Mapping(fd, self.size, populate=False, private=True)
        finally:
            os.close(fd)
        _unlink_if_orphaned(self.name)
        views = [bytes_at(mapping.addr + off, n, mapping) for off, n in self.spans]
        return pickle.loads(self.inband, buffers=views)


def _unlink_if_orphaned(name: str) -> None:
    # An owned worker runs its hooks when the consumer dies; a worker without an orphan
    # watch (a borrowed executor never gets a segment) never registers one that fires.
    from .. import _orphan

    _orphan.on_orphaned(lambda: _unlink(name))


class DataSegment:
    """The consumer's handle on one data segment: written once, unlinked by :meth:`unlink`
    (idempotent), by garbage collection, or at interpreter exit."""

    def __init__(self, buffers: list[pickle.PickleBuffer]) -> None:
        spans: list[tuple[int, int]] = []
        size = 0
        for buf in buffers:
            n = buf.raw().nbytes
            spans.append((size, n))
            size += (n + _PAGE - 1) // _PAGE * _PAGE  # each array on its own pages
        self.size = max(size, _PAGE)
        self.spans = tuple(spans)
        self.name = f"{PREFIX}{os.getpid()}_{os.getpid()}_{_nonce}_d{next(_seq)}"
        self._check_room()
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
        fd = os.open(_names.path(self.name), flags, 0o600)
        self._finalizer = weakref.finalize(self, _unlink, self.name)
        try:
            # Reserved first: a tmpfs that runs out while being written is a SIGBUS in
            # whoever maps it later; ENOSPC here is an error we fall back from.
            os.posix_fallocate(fd, 0, self.size)
            for buf, (offset, n) in zip(buffers, spans, strict=True):
                _write_all(fd, buf.raw(), offset, n)
        except BaseException:
            self._finalizer()
            raise
        finally:
            os.close(fd)

    def _check_room(self) -> None:
        from . import capacity_limit

        st = os.statvfs(_names.SHM_DIR)
        avail = st.f_bavail * st.f_frsize
        cap = capacity_limit()
        if cap is not None:
            avail = min(avail, cap)
        if self.size > avail:
            raise OSError(
                f"{_names.SHM_DIR} has {avail / 2**20:.0f} MiB free, the dataset's arrays need "
                f"{self.size / 2**20:.0f} MiB"
            )

    def envelope(self, inband: bytes) -> bytes:
        return pickle.dumps(SharedPayload(self.name, self.size, self.spans, inband), protocol=pickle.HIGHEST_PROTOCOL)

    def unlink(self) -> None:
        self._finalizer()

    @property
    def linked(self) -> bool:
        return self._finalizer.alive


def _write_all(fd: int, data: memoryview, offset: int, n: int) -> None:
    done = 0
    while done < n:
        done += os.pwrite(fd, data[done : done + (1 << 30)], offset + done)


_warned = threading.Event()


def share(inband: bytes, buffers: list[pickle.PickleBuffer], owner: str) -> tuple[bytes, DataSegment] | None:
    """Write ``buffers`` to a new data segment; the envelope to send and the segment, or
    ``None`` (after one :class:`~aioloader.ShmFallbackWarning` per process) if it could
    not be made: the caller then pickles everything in band, as without sharing."""
    try:
        segment = DataSegment(buffers)
    except OSError as exc:
        if not _warned.is_set():
            _warned.set()
            warnings.warn(
                ShmFallbackWarning(
                    f"the {owner}'s large arrays could not be put in shared memory ({exc}); every "
                    f"worker gets its own copy instead. {enlarge_advice()}"
                ),
                stacklevel=4,
            )
        return None
    return segment.envelope(inband), segment

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

The consumer's own copy goes too, where that is safe: an array that owns its memory,
of at least :data:`MIN_ADOPTED_BYTES`, allocated by numpy's default allocator as a glibc
``mmap`` chunk (checked from ``/proc/self/maps`` and the chunk header), is *adopted*: it
is placed in the segment at the same offset within a page as in memory, and its whole
pages are replaced in place (``MAP_FIXED``) by a copy-on-write mapping of the segment.
The array object, its address and its contents stay the same; its pages are now the
segment's, shared with the workers, and a later write in the consumer copies only the
page it touches, which the workers never see. When numpy frees the array, glibc unmaps
the chunk, our pages included. Writes made by another thread *while* the loader starts
may be lost; the first iteration is the moment that starts it.

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
from ._mapping import _lib, _Mapping, bytes_at
from ._names import PREFIX, _unlink, enlarge_advice

__all__ = [
    "MIN_SHARED_BYTES",
    "SHARE_ENV",
    "DataSegment",
    "SharedPayload",
    "collector",
    "share",
    "sharing_enabled",
]

MIN_SHARED_BYTES = 1 << 20  # smaller arrays cost less pickled than a page-aligned span
# glibc serves allocations this large with mmap whatever its dynamic threshold has grown
# to (at most 32 MiB on 64-bit), and frees them with munmap.
MIN_ADOPTED_BYTES = 32 << 20
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
    from .._worker import orphan as _orphan

    _orphan.on_orphaned(lambda: _unlink(name))


class DataSegment:
    """The consumer's handle on one data segment: written once, unlinked by :meth:`unlink`
    (idempotent), by garbage collection, or at interpreter exit."""

    def __init__(self, buffers: list[pickle.PickleBuffer], *, adopt: bool = True) -> None:
        spans: list[tuple[int, int]] = []
        adopted: list[tuple[int, int, int]] = []  # (address, nbytes, offset in the segment)
        size = 0
        for buf in buffers:
            raw = buf.raw()
            n = raw.nbytes
            size = (size + _PAGE - 1) // _PAGE * _PAGE  # each array on its own pages
            addr = _adoptable(raw) if adopt else None
            if addr is not None:
                size += addr % _PAGE  # the same place within a page as in memory
                adopted.append((addr, n, size))
            spans.append((size, n))
            size += n
        self.size = max(size, _PAGE)
        self.adopted = len(adopted)
        self.spans = tuple(spans)
        self.name = f"{PREFIX}{os.getpid()}_{os.getpid()}_{_nonce}_d{next(_seq)}"
        self._check_room()
        flags = (
            os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
        )
        fd = os.open(_names.path(self.name), flags, 0o600)
        self._finalizer = weakref.finalize(self, _unlink, self.name)
        try:
            # Written with pwrite, not through a mapping: a full tmpfs is an ENOSPC here,
            # which we fall back from, not a SIGBUS; and no page is zeroed first.
            os.ftruncate(fd, self.size)
            for buf, (offset, n) in zip(buffers, spans, strict=True):
                _write_all(fd, buf.raw(), offset, n)
            for addr, n, offset in adopted:
                _adopt(fd, addr, n, offset)
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
        return pickle.dumps(
            SharedPayload(self.name, self.size, self.spans, inband), protocol=pickle.HIGHEST_PROTOCOL
        )

    def unlink(self) -> None:
        self._finalizer()


def _adoptable(raw: memoryview) -> int | None:
    """The address of ``raw``'s memory if it belongs to an array whose pages may be
    replaced in place (see the module docstring), else ``None``."""
    import ctypes
    import importlib

    import numpy as np

    arr: Any = raw.obj
    if not (
        type(arr) is np.ndarray
        and arr.base is None
        and arr.flags.owndata
        and arr.flags.c_contiguous
        and raw.nbytes >= MIN_ADOPTED_BYTES
    ):
        return None
    try:
        multiarray: Any = importlib.import_module("numpy._core.multiarray")
    except ImportError:  # numpy 1.x
        multiarray = importlib.import_module("numpy.core.multiarray")
    if getattr(multiarray, "get_handler_name", lambda a: None)(arr) != "default_allocator":
        return None
    addr = int(arr.ctypes.data)
    chunk = addr - 16  # glibc: two size words before the user pointer, page-aligned if mmapped
    if chunk % _PAGE:
        return None
    try:
        with open("/proc/self/maps") as f:
            regions = [line.split() for line in f]
    except OSError:
        return None
    # the header's page first (it is read just below), then the whole chunk it describes
    word = ctypes.c_size_t.from_address(addr - 8).value if _anonymous(regions, chunk, chunk + _PAGE) else 0
    length = word & ~0x7
    # IS_MMAPPED set, and the chunk holds the array, all of it in anonymous memory
    if not word & 0x2 or length < raw.nbytes + 16 or not _anonymous(regions, chunk, chunk + length):
        return None
    return addr


def _anonymous(regions: list[list[str]], lo: int, hi: int) -> bool:
    """Is ``[lo, hi)`` covered by anonymous private mappings among ``regions`` (the lines
    of ``/proc/self/maps``, split)? (numpy's huge-page advice splits one chunk in several.)"""
    at = lo
    for fields in regions:
        start, end = (int(x, 16) for x in fields[0].split("-"))
        if start <= at < end:
            if len(fields) > 5 or not fields[1].endswith("p"):  # a file, or shared
                return False
            at = end
            if at >= hi:
                return True
    return False


_MAP_FIXED = 0x10  # Linux; the mmap module does not export it


def _adopt(fd: int, addr: int, n: int, offset: int) -> None:
    """Replace the whole pages of ``[addr, addr + n)`` by a private mapping of the same
    bytes at ``offset`` of the segment ``fd``."""
    import ctypes
    import mmap

    skip = -addr % _PAGE
    start, stop = addr + skip, (addr + n) // _PAGE * _PAGE
    if stop <= start:
        return
    got = _lib().mmap(
        start,
        stop - start,
        mmap.PROT_READ | mmap.PROT_WRITE,
        mmap.MAP_PRIVATE | _MAP_FIXED,
        fd,
        offset + skip,
    )
    if got != start:  # never seen: MAP_FIXED either maps there or fails with ENOMEM
        err = ctypes.get_errno()
        raise OSError(err, f"remapping an array onto its shared copy failed: {os.strerror(err)}")


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

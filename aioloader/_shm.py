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
    batch, at most ``max_slabs`` of them (``2 * prefetch + 2``); a slab left unused for
    ``4 * max_slabs`` batches is dropped, so an arena follows its working set.
*descriptor*
    What crosses the executor's pipe instead of the arrays: slab name, ticket, and the
    batch's structure with a placeholder for every array leaf (offset, shape, dtype).

Ownership rules
---------------
1. **Workers create.** A worker creates a slab with ``os.open(O_CREAT | O_EXCL, 0o600)``
   on ``/dev/shm``, reserves its pages with ``posix_fallocate`` (so a full ``/dev/shm``
   is an ``ENOSPC`` error at creation, never a ``SIGBUS`` while writing), maps it and
   closes the fd at once (libc ``mmap``: ``mmap.mmap`` would keep a duplicate fd per
   slab). The resource tracker is never involved: in 3.11 it would register the segment
   again in every attaching process and unlink it twice.
2. **The consumer unlinks on arrival.** When a descriptor is unpickled in the consumer
   (in the executor's result thread, before anyone awaits it) the consumer maps the
   slab, the first time it sees it, and unlinks its name. From then on the slab has no
   name: it is two mappings and disappears with the last of them. A name therefore
   exists only between a slab's creation and the arrival of the first batch written to
   it (milliseconds, once per slab); reused slabs cross the pipe as names already gone.
3. **Occupancy is a state word.** A worker writes only into a slab whose state is 0, and
   stores its ticket there before writing. The consumer stores 0 again when the last
   array viewing the batch is gone: the arrays' ``base`` chain ends in an owner object
   whose ``weakref.finalize`` frees the slab. A batch that arrives but is never decoded
   (an epoch abandoned mid-way, a cancelled future) is freed by the descriptor's own
   finalizer. Holding batches therefore only makes the worker use another slab; when it
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
   slab). If it is short, or creation fails, the worker sends that loader's batches
   pickled from then on, and the consumer emits one :class:`ShmFallbackWarning` saying
   how to enlarge ``/dev/shm``. ``AIOLOADER_SHM_CAPACITY`` (bytes, ``K``/``M``/``G``
   suffixes) caps the free space assumed, for tests and for sharing a node politely.

Only ``numpy.ndarray`` leaves (exact type) of at least 64 KiB, inside dicts,
``OrderedDict``s, lists, tuples and namedtuples, go through shared memory; everything
else travels pickled inside the descriptor. With :func:`~aioloader.default_collate`
the worker stacks samples straight into the slab (one write per byte).

Linux only (``/dev/shm``, ``/proc``); elsewhere ``transport="auto"`` means pickle.
This module runs in workers and never imports asyncio.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import math
import mmap
import os
import secrets
import threading
import time
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from ._collate import default_collate
from .errors import CollateError, SharedMemoryError, ShmFallbackWarning

__all__ = [
    "CAPACITY_ENV",
    "PREFIX",
    "SHM_DIR",
    "SharedMemoryError",
    "ShmCollate",
    "ShmConfig",
    "ShmDecoder",
    "ShmEncoder",
    "ShmFallbackWarning",
    "capacity_limit",
    "host_key",
    "sweep",
    "unavailable_reason",
]

PREFIX = "aioloader_"
SHM_DIR = "/dev/shm"
CAPACITY_ENV = "AIOLOADER_SHM_CAPACITY"
HEADER = 4096  # one page: keeps the data page-aligned
ALIGN = 64  # every leaf starts on a cache line
MIN_LEAF_BYTES = 64 * 1024  # smaller leaves cost less pickled than a slab's bookkeeping
MIN_SLAB = 1 << 20
SWEEP_GRACE_S = 5.0  # a dead worker's name younger than this may still be in flight
FOREIGN_GRACE_S = 60.0

#: Tests may set this (bytes) instead of the environment variable; read by the consumer
#: when a transport is made, and shipped to the workers with the encoder.
capacity_override: int | None = None



def _enlarge_advice() -> str:
    return (
        "Enlarge /dev/shm (docker run --shm-size=8g ..., Kubernetes: an emptyDir with "
        "medium: Memory mounted at /dev/shm, or `mount -o remount,size=8G /dev/shm`), lower "
        "prefetch or the batch size, or pass transport='pickle' to silence this warning."
    )


def unavailable_reason() -> str | None:
    """Why shared memory cannot be used in this process at all, or ``None``."""
    if not os.path.isdir(SHM_DIR):
        return f"{SHM_DIR} does not exist on this platform"
    if not os.access(SHM_DIR, os.W_OK | os.X_OK):
        return f"{SHM_DIR} is not writable by this user"
    return None


def capacity_limit() -> int | None:
    """The injected cap on free ``/dev/shm`` bytes (module hook, else environment)."""
    if capacity_override is not None:
        return int(capacity_override)
    raw = os.environ.get(CAPACITY_ENV, "").strip()
    if not raw:
        return None
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    scale = 1
    text = raw.upper().removesuffix("B")
    if text and text[-1] in units:
        scale, text = units[text[-1]], text[:-1]
    try:
        value = int(float(text) * scale)
    except ValueError:
        raise ValueError(
            f"{CAPACITY_ENV} must be a number of bytes (suffix K, M or G allowed), got {raw!r}"
        ) from None
    if value < 0:
        raise ValueError(f"{CAPACITY_ENV} must be >= 0, got {raw!r}")
    return value


_host: tuple[str, int, int, int] | None = None


def host_key() -> tuple[str, int, int, int]:
    """Identifies "this kernel, this /dev/shm, this pid namespace".

    A worker uses shared memory only when its key equals the consumer's: a remote or
    containerised worker (dask) could not attach the slab, and pids (which the cleanup
    rules rely on) would mean other processes there.
    """
    global _host
    if _host is None:
        try:
            with open("/proc/sys/kernel/random/boot_id") as f:
                boot = f.read().strip()
        except OSError:
            boot = ""
        try:
            st = os.stat(SHM_DIR)
            dev, ino = st.st_dev, st.st_ino
        except OSError:
            dev = ino = -1
        try:
            ns = os.stat("/proc/self/ns/pid").st_ino
        except OSError:
            ns = -1
        _host = (boot, dev, ino, ns)
    return _host


def _pid_alive(pid: int) -> bool:
    """True unless ``pid`` has exited (a zombie counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    close = stat.rfind(b")")
    state = stat[close + 2 : close + 3]
    return state not in (b"Z", b"X", b"x")


def _parse_name(name: str) -> tuple[int, int] | None:
    """``(consumer pid, worker pid)`` of one of our names, or ``None``."""
    if not name.startswith(PREFIX):
        return None
    parts = name[len(PREFIX) :].split("_")
    if len(parts) != 4:
        return None
    try:
        return int(parts[0]), int(parts[1])
    except ValueError:
        return None


def _unlink(name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(SHM_DIR, name))


def _size_class(n: int) -> int:
    """Round up to 1/16 of the next power of two (at most 6.25% waste), at least 1 MiB,
    so that a slightly smaller or larger batch (the last of an epoch) reuses a slab."""
    n = max(n, MIN_SLAB)
    step = 1 << max((n - 1).bit_length() - 4, 12)
    return (n + step - 1) // step * step


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


# ------------------------------------------------------------------------------- mappings
# Slabs are mapped with libc's mmap rather than mmap.mmap: before 3.13, mmap.mmap keeps
# a dup() of the file descriptor for every mapping, so a consumer with many workers
# would hold one fd per slab and run into the fd limit (torch's "too many open files").
# A raw mapping needs no fd once made; numpy sees it through __array_interface__.
_libc: Any = None


def _lib() -> Any:
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.mmap.restype = ctypes.c_void_p
        lib.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int64,
        ]
        lib.munmap.restype = ctypes.c_int
        lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        _libc = lib
    return _libc


def _munmap(addr: int, size: int) -> None:
    _lib().munmap(addr, size)


class _Mapping:
    """A shared read-write mapping of a whole file; unmapped when this object dies.

    Everything that reads or writes the memory holds this object (directly or through
    a numpy ``base`` chain), so the memory cannot be unmapped under an array.
    """

    __slots__ = ("__weakref__", "addr", "size")

    def __init__(self, fd: int, size: int, *, populate: bool) -> None:
        flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
        addr = _lib().mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, flags, fd, 0)
        if addr is None or addr == ctypes.c_void_p(-1).value:
            err = ctypes.get_errno()
            raise OSError(err, f"mmap of {size} bytes failed: {os.strerror(err)}")
        self.addr: int = addr
        self.size = size
        # Not at interpreter exit: arrays may still be read while it shuts down, and
        # the process's mappings die with it anyway.
        weakref.finalize(self, _munmap, addr, size).atexit = False


class _Export:
    """Exports ``nbytes`` at ``addr`` to numpy and keeps ``owner`` (the mapping, or the
    consumer's slab) alive for as long as any array derived from it lives. The consumer
    creates one per batch and frees the slab in its finalizer (rule 3)."""

    __slots__ = ("__array_interface__", "__weakref__", "owner")

    def __init__(self, addr: int, nbytes: int, owner: object) -> None:
        self.owner = owner
        self.__array_interface__ = {"data": (addr, False), "shape": (nbytes,), "typestr": "|u1", "version": 3}


def _bytes_at(addr: int, nbytes: int, owner: object) -> npt.NDArray[np.uint8]:
    return np.asarray(_Export(addr, nbytes, owner))


def _map_file(fd: int, *, populate: bool) -> tuple[_Mapping, npt.NDArray[np.int64]]:
    """Map an open slab file; returns the mapping and its header's state words."""
    size = os.fstat(fd).st_size
    m = _Mapping(fd, size, populate=populate)
    return m, _bytes_at(m.addr, 64, m).view(np.int64)


# --------------------------------------------------------------------------- configuration
@dataclass(frozen=True)
class ShmConfig:
    """Fixed when the loader is built; travels to every worker inside the encoder."""

    consumer_pid: int
    host: tuple[str, int, int, int]
    window: int  # batches that may occupy slabs at once when nobody holds any (prefetch + 1)
    max_slabs: int  # per worker arena
    min_leaf_bytes: int = MIN_LEAF_BYTES
    capacity: int | None = None  # cap on the free /dev/shm bytes assumed


# ------------------------------------------------------------------------ tree placeholders
class _Leaf:
    """Stands for the ``i``-th shared-memory array of a batch."""

    __slots__ = ("i",)

    def __init__(self, i: int) -> None:
        self.i = i

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Leaf, (self.i,))


class _Node:
    """A container holding at least one :class:`_Leaf`, rebuilt by the consumer.

    Containers without leaves travel as themselves, so the consumer's work grows with
    the number of array leaves, not with the size of the batch.
    """

    __slots__ = ("cls", "keys", "values")

    def __init__(self, cls: type, keys: tuple[Any, ...] | None, values: list[Any]) -> None:
        self.cls = cls
        self.keys = keys
        self.values = values

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Node, (self.cls, self.keys, self.values))


def _is_namedtuple(obj: object) -> bool:
    # Namedtuples without a __dict__ only: their state is exactly their fields.
    return isinstance(obj, tuple) and hasattr(obj, "_fields") and not hasattr(obj, "__dict__")


def _build(obj: Any, views: Sequence[np.ndarray]) -> Any:
    t = type(obj)
    if t is _Leaf:
        return views[obj.i]
    if t is not _Node:
        return obj
    values = [_build(v, views) for v in obj.values]
    cls = obj.cls
    if obj.keys is not None:
        return cls(zip(obj.keys, values, strict=True))
    if cls is list:
        return values
    if cls is tuple:
        return tuple(values)
    return cls(*values)  # namedtuple, built the way default_collate builds it


def _node(obj: Any, values: list[Any]) -> Any:
    """The :class:`_Node` for container ``obj`` with new ``values``, or ``obj`` itself
    when no value changed (no leaf below)."""
    if isinstance(obj, Mapping):
        if all(v is o for v, o in zip(values, obj.values(), strict=True)):
            return obj
        return _Node(type(obj), tuple(obj.keys()), values)
    if all(v is o for v, o in zip(values, obj, strict=True)):
        return obj
    return _Node(type(obj), None, values)


def _extract(obj: Any, leaves: list[np.ndarray], min_bytes: int) -> Any:
    """Replace large array leaves of a finished batch with placeholders."""
    t = type(obj)
    if t is np.ndarray:
        if obj.nbytes >= min_bytes and not obj.dtype.hasobject:
            leaves.append(obj)
            return _Leaf(len(leaves) - 1)
        return obj
    if t is dict or t is OrderedDict:
        return _node(obj, [_extract(v, leaves, min_bytes) for v in obj.values()])
    if t is list or t is tuple or _is_namedtuple(obj):
        return _node(obj, [_extract(v, leaves, min_bytes) for v in obj])
    return obj


# --------------------------------------------------------------------------- worker side
class _WSlab:
    """A worker's mapping of one slab."""

    __slots__ = ("capacity", "last", "mapping", "name", "state")

    def __init__(self, name: str, mapping: _Mapping, state: npt.NDArray[np.int64]) -> None:
        self.name = name
        self.mapping = mapping
        self.capacity = mapping.size
        self.state = state
        self.last = 0  # ticket of the last batch written here (idle trimming)

    def free(self) -> bool:
        return int(self.state[0]) == 0

    def array(self, offset: int, shape: tuple[int, ...], dtype: np.dtype[Any], fortran: bool) -> np.ndarray:
        nbytes = math.prod(shape) * dtype.itemsize
        raw = _bytes_at(self.mapping.addr + HEADER + offset, nbytes, self.mapping)
        return raw.view(dtype).reshape(shape, order="F" if fortran else "C")


class _Arena:
    """One worker's slabs for one consumer process (see rules 1, 3 and 5)."""

    def __init__(self, consumer_pid: int) -> None:
        self.consumer_pid = consumer_pid
        self.nonce = secrets.token_hex(4)
        self.seq = itertools.count()
        self.tickets = itertools.count(1)
        self.slabs: list[_WSlab] = []
        self.names: set[str] = set()  # names of our slabs; most already unlinked by the consumer
        self.retired: list[str] = []  # slabs dropped here; the consumer should drop its mapping too
        self.lock = threading.Lock()
        self.dead = False
        self._watcher: threading.Thread | None = None

    def bytes(self) -> int:
        return sum(s.capacity for s in self.slabs)

    # -- consumer death (rule 5)
    def watch(self) -> None:
        if self._watcher is None:
            self._watcher = threading.Thread(target=self._watch, name="aioloader-shm-watch", daemon=True)
            self._watcher.start()
            # A worker that exits normally after its consumer died cleans up too.
            from multiprocessing import util

            util.Finalize(None, self._at_exit, exitpriority=10)
            # An owned worker exits when its consumer dies: clean up before that.
            from . import _worker

            _worker.on_orphaned(self.consumer_died)

    def _watch(self) -> None:
        from ._worker import wait_for_exit

        wait_for_exit(self.consumer_pid)
        self.consumer_died()

    def consumer_died(self) -> None:
        with self.lock:
            self.dead = True
            names = list(self.names)
        for name in names:
            _unlink(name)

    def _at_exit(self) -> None:
        if not _pid_alive(self.consumer_pid):
            self.consumer_died()

    # -- allocation
    def acquire(self, need: int, cfg: ShmConfig) -> tuple[_WSlab | None, str | None]:
        """A slab with room for ``need`` data bytes, marked busy; or ``(None, reason)``:
        no reason means "all slabs busy, pickle this batch", a reason disables shm."""
        with self.lock:
            if self.dead:
                return None, None
            ticket = next(self.tickets)
            slab = self._pick(need, cfg)
            if slab is None or isinstance(slab, str):
                return None, slab
            slab.state[0] = slab.last = ticket
            self._trim(ticket, 4 * cfg.max_slabs)
            return slab, None

    def _pick(self, need: int, cfg: ShmConfig) -> _WSlab | str | None:
        best: _WSlab | None = None
        for s in self.slabs:
            if s.capacity - HEADER >= need and s.free() and (best is None or s.capacity < best.capacity):
                best = s
        if best is not None:
            return best
        cap = _size_class(need + HEADER)
        victim: _WSlab | None = None
        if len(self.slabs) >= cfg.max_slabs:
            free = [s for s in self.slabs if s.free()]
            if not free:
                return None  # everything is in flight or held: pickle this one batch
            victim = min(free, key=lambda s: s.capacity)
        reason = self._room(cap, cfg, victim)
        if reason is not None:
            return reason
        if victim is not None:
            self._retire(victim)
        try:
            slab = self._create(cap)
        except OSError as exc:
            return (
                f"could not create a {cap / 2**20:.0f} MiB shared-memory segment in {SHM_DIR}: "
                f"{exc}. {_enlarge_advice()}"
            )
        self.slabs.append(slab)
        self.watch()
        return slab

    def _trim(self, ticket: int, idle: int) -> None:
        # Arenas grow to their worker's peak (an epoch boundary, a consumer holding
        # batches); slabs unused for many batches since go back, so memory follows the
        # working set rather than the worst moment of the run.
        for s in list(self.slabs):
            if ticket - s.last > idle and s.free():
                self._retire(s)

    def _retire(self, slab: _WSlab) -> None:
        self.slabs.remove(slab)
        self.retired.append(slab.name)  # the consumer drops its mapping with the next batch
        _unlink(slab.name)  # long gone unless it never reached the consumer
        self.names.discard(slab.name)

    def _room(self, cap: int, cfg: ShmConfig, victim: _WSlab | None) -> str | None:
        st = os.statvfs(SHM_DIR)
        avail = st.f_bavail * st.f_frsize
        if cfg.capacity is not None:
            avail = min(avail, cfg.capacity)
        mine = self.bytes() - (victim.capacity if victim is not None else 0)
        largest = max((s.capacity for s in self.slabs if s is not victim), default=0)
        # Room for the whole window at the largest size seen, counting what we already hold.
        if cap > largest and cap * cfg.window > avail + mine:
            return (
                f"{SHM_DIR} has {avail / 2**20:.0f} MiB free but the loader's window needs "
                f"{cap * cfg.window / 2**20:.0f} MiB ({cfg.window} batches of up to "
                f"{cap / 2**20:.0f} MiB); batches are pickled through the pipe instead, which is "
                f"several times slower for large arrays. {_enlarge_advice()}"
            )
        if cap > avail:
            return f"{SHM_DIR} is full ({avail / 2**20:.0f} MiB free). {_enlarge_advice()}"
        return None

    def _create(self, cap: int) -> _WSlab:
        name = f"{PREFIX}{self.consumer_pid}_{os.getpid()}_{self.nonce}_{next(self.seq)}"
        path = os.path.join(SHM_DIR, name)
        flags = (
            os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
        )
        fd = os.open(path, flags, 0o600)
        self.names.add(name)
        try:
            # Reserve the pages now: writing to a sparse tmpfs file that runs out of
            # room is a SIGBUS, an ENOSPC here is an exception we can fall back from.
            os.posix_fallocate(fd, 0, cap)
            mapping, state = _map_file(fd, populate=True)
        except BaseException:
            _unlink(name)
            self.names.discard(name)
            raise
        finally:
            os.close(fd)
        return _WSlab(name, mapping, state)

    def take_retired(self) -> tuple[str, ...]:
        with self.lock:
            out = tuple(self.retired)
            self.retired.clear()
        return out


_arenas: dict[int, _Arena] = {}
_arenas_lock = threading.Lock()


def _arena(consumer_pid: int) -> _Arena:
    with _arenas_lock:
        arena = _arenas.get(consumer_pid)
        if arena is None:
            arena = _arenas[consumer_pid] = _Arena(consumer_pid)
        return arena


class ShmBatch:
    """The descriptor a worker returns; unpickles as an :class:`_Arrived` in the consumer."""

    __slots__ = ("name", "note", "pid", "retired", "specs", "ticket", "tree", "used")

    def __init__(
        self,
        name: str | None,
        ticket: int,
        used: int,
        tree: Any,
        specs: tuple[tuple[int, tuple[int, ...], np.dtype[Any], bool], ...],
        retired: tuple[str, ...],
        note: str | None,
    ) -> None:
        self.name = name
        self.ticket = ticket
        self.used = used
        self.tree = tree
        self.specs = specs
        self.retired = retired
        self.note = note
        self.pid = os.getpid()

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            _arrive,
            (self.name, self.ticket, self.used, self.tree, self.specs, self.retired, self.note, self.pid),
        )


def _layout(
    metas: Sequence[tuple[tuple[int, ...], np.dtype[Any], bool]],
) -> tuple[tuple[tuple[int, tuple[int, ...], np.dtype[Any], bool], ...], int]:
    specs = []
    off = 0
    for shape, dtype, fortran in metas:
        off = _align(off)
        specs.append((off, shape, dtype, fortran))
        off += math.prod(shape) * dtype.itemsize
    return tuple(specs), off


class ShmEncoder:
    """Worker side: turns a batch into a :class:`ShmBatch` (or leaves it to pickle)."""

    def __init__(self, config: ShmConfig) -> None:
        self.config = config
        self._off: str | None = None  # why this loader's batches are pickled here ("" = in-process)
        self._checked = False

    def __getstate__(self) -> dict[str, Any]:
        return {"config": self.config}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.config = state["config"]
        self._off = None
        self._checked = False

    def _disabled(self) -> str | None:
        if not self._checked:
            self._checked = True
            cfg = self.config
            if os.getpid() == cfg.consumer_pid:
                self._off = ""  # same process: the batch is not copied anyway
            elif unavailable_reason() is not None or host_key() != cfg.host:
                self._off = (
                    "this worker cannot share memory with the consumer (another host, container "
                    f"or pid namespace, or no usable {SHM_DIR}); its batches are pickled"
                )
        return self._off

    def acquire(self, need: int) -> _WSlab | None:
        if self._disabled() is not None:
            return None
        slab, reason = _arena(self.config.consumer_pid).acquire(need, self.config)
        if reason is not None:
            self._off = reason
        return slab

    def fallback(self, batch: Any) -> Any:
        """The batch to return when shared memory is not used for it."""
        if self._off:
            return ShmBatch(None, 0, 0, batch, (), (), self._off)
        return batch

    def describe(self, slab: _WSlab, tree: Any, specs: Any, used: int) -> ShmBatch:
        retired = _arena(self.config.consumer_pid).take_retired()
        return ShmBatch(slab.name, int(slab.state[0]), used, tree, specs, retired, None)

    def __call__(self, batch: Any) -> Any:
        if type(batch) is ShmBatch:  # collated straight into shared memory already
            return batch
        if self._disabled() is not None:
            return self.fallback(batch)
        leaves: list[np.ndarray] = []
        tree = _extract(batch, leaves, self.config.min_leaf_bytes)
        if not leaves:
            return batch
        metas = [(a.shape, a.dtype, bool(a.flags.f_contiguous and not a.flags.c_contiguous)) for a in leaves]
        specs, used = _layout(metas)
        slab = self.acquire(used)
        if slab is None:
            return self.fallback(batch)
        for (off, shape, dtype, fortran), a in zip(specs, leaves, strict=True):
            np.copyto(slab.array(off, shape, dtype, fortran), a, casting="no")
        return self.describe(slab, tree, specs, used)


class _Delegate(Exception):
    """The samples do not fit the fast path; let default_collate decide (and explain)."""


class ShmCollate:
    """``default_collate`` that stacks large array leaves straight into a slab.

    Same result as :func:`~aioloader.default_collate` (it delegates every case it does
    not handle itself, and every error), but each byte of a large leaf is written once,
    into memory the consumer will view.
    """

    def __init__(self, encoder: ShmEncoder) -> None:
        self.encoder = encoder

    def __call__(self, samples: Sequence[Any]) -> Any:
        enc = self.encoder
        if len(samples) == 0 or enc._disabled() is not None:
            return default_collate(samples)
        pending: list[tuple[Sequence[np.ndarray], tuple[int, ...], np.dtype[Any]]] = []
        try:
            tree = self._plan(samples, pending)
        except (_Delegate, CollateError):
            return default_collate(samples)  # raises the precise CollateError, or agrees
        if not pending:
            return tree
        specs, used = _layout([(shape, dtype, False) for _, shape, dtype in pending])
        slab = enc.acquire(used)
        if slab is None:
            return _build(tree, [default_collate(list(arrays)) for arrays, _, _ in pending])
        for (off, shape, dtype, _), (arrays, _, _) in zip(specs, pending, strict=True):
            out = slab.array(off, shape, dtype, False)
            for k, a in enumerate(arrays):
                out[k] = a
        return enc.describe(slab, tree, specs, used)

    def _plan(self, samples: Sequence[Any], pending: list[Any]) -> Any:
        """Mirror of ``_collate``'s dispatch for arrays and containers; large stacks are
        left as placeholders to be written into the slab."""
        elem = samples[0]
        if (
            hasattr(elem, "__array_interface__")
            and hasattr(elem, "mode")
            and not isinstance(elem, np.ndarray)
        ):
            samples = [np.asarray(s) for s in samples]  # PIL images, as default_collate does
            elem = samples[0]
        if isinstance(elem, np.ndarray):
            shape = elem.shape
            for s in samples:
                if not isinstance(s, np.ndarray) or s.shape != shape:
                    raise _Delegate
            dtype = np.result_type(*samples)
            nbytes = len(samples) * math.prod(shape) * dtype.itemsize
            if dtype.hasobject or nbytes < self.encoder.config.min_leaf_bytes:
                return default_collate(samples)
            pending.append((samples, (len(samples), *shape), dtype))
            return _Leaf(len(pending) - 1)
        t = type(elem)
        if t is dict or t is OrderedDict:
            keys = list(elem.keys())
            for s in samples:
                if not isinstance(s, Mapping) or list(s.keys()) != keys:
                    raise _Delegate
            values = [self._plan([s[k] for s in samples], pending) for k in keys]
            if any(type(v) in (_Leaf, _Node) for v in values):
                return _Node(t, tuple(keys), values)
            return t(zip(keys, values, strict=True))
        if t is tuple or t is list or _is_namedtuple(elem):
            size = len(elem)
            for s in samples:
                if not isinstance(s, (tuple, list)) or len(s) != size:
                    raise _Delegate
            values = [self._plan([s[k] for s in samples], pending) for k in range(size)]
            if any(type(v) in (_Leaf, _Node) for v in values):
                return _Node(t, None, values)
            if t is list:
                return values
            return tuple(values) if t is tuple else t(*values)
        # Numbers, strings, tensors, other containers: exactly default_collate's answer.
        return default_collate(samples)


# ------------------------------------------------------------------------- consumer side
class _CSlab:
    """The consumer's mapping of one slab (kept while its worker lives, rule 2)."""

    __slots__ = ("__weakref__", "addr", "mapping", "name", "owner_pid", "state", "worker_pid")

    def __init__(self, name: str, mapping: _Mapping, state: npt.NDArray[np.int64], worker_pid: int) -> None:
        self.name = name
        self.mapping = mapping
        self.addr = mapping.addr
        self.state = state
        self.worker_pid = worker_pid
        self.owner_pid = os.getpid()

    def release(self, ticket: int) -> None:
        # Only the consumer writes 0 and only for the ticket it holds, so a late or
        # duplicate release can never free a slab that was handed out again. A process
        # forked from the consumer (mp_context="fork" workers) inherits its batches and
        # may drop them; that must not free the consumer's slabs.
        if int(self.state[0]) == ticket and os.getpid() == self.owner_pid:
            self.state[0] = 0


_slabs: dict[str, _CSlab] = {}
_slabs_lock = threading.Lock()


def _attach(name: str, worker_pid: int) -> _CSlab:
    with _slabs_lock:
        slab = _slabs.get(name)
        if slab is not None:
            return slab
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0))
        try:
            mapping, state = _map_file(fd, populate=False)
        finally:
            os.close(fd)
        _unlink(name)  # rule 2: both sides have it mapped, the name has done its job
        slab = _slabs[name] = _CSlab(name, mapping, state, worker_pid)
        return slab


def _forget(names: Sequence[str]) -> None:
    with _slabs_lock:
        for name in names:
            _slabs.pop(name, None)


class _Arrived:
    """A descriptor as the consumer holds it: mapped, not yet turned into arrays."""

    __slots__ = ("__weakref__", "error", "fin", "note", "pid", "slab", "specs", "ticket", "tree", "used")

    def __init__(self, ticket: int, used: int, tree: Any, specs: Any, note: str | None, pid: int) -> None:
        self.ticket = ticket
        self.used = used
        self.tree = tree
        self.specs: tuple[tuple[int, tuple[int, ...], np.dtype[Any], bool], ...] = specs
        self.note = note
        self.pid = pid
        self.slab: _CSlab | None = None
        self.fin: Any = None  # weakref.finalize freeing the slab if nobody decodes this
        self.error: BaseException | None = None

    def open(self) -> Any:
        if self.error is not None:
            raise self.error
        slab = self.slab
        if slab is None:
            return self.tree
        export = _Export(slab.addr + HEADER, self.used, slab)
        fin = weakref.finalize(export, slab.release, self.ticket)
        fin.atexit = False
        self.fin.detach()  # the arrays own the slab now
        self.slab = None
        raw = np.asarray(export)
        views = []
        for off, shape, dtype, fortran in self.specs:
            n = math.prod(shape) * dtype.itemsize
            views.append(raw[off : off + n].view(dtype).reshape(shape, order="F" if fortran else "C"))
        self.tree = batch = _build(self.tree, views)  # a second open() returns the same arrays
        return batch


def _arrive(
    name: str | None,
    ticket: int,
    used: int,
    tree: Any,
    specs: Any,
    retired: tuple[str, ...],
    note: str | None,
    pid: int,
) -> _Arrived:
    """Unpickling a :class:`ShmBatch`. Runs in the executor's result thread, so it must
    never raise (an exception there would break the whole pool): errors are kept and
    raised by the decoder."""
    a = _Arrived(ticket, used, tree, specs, note, pid)
    try:
        if retired:
            _forget(retired)
        if name is not None:
            slab = _attach(name, pid)
            state = int(slab.state[0])
            if state != ticket:
                raise SharedMemoryError(
                    f"shared-memory slab {name} holds ticket {state}, expected {ticket}: it was "
                    "reused while a batch was in flight"
                )
            a.slab = slab
            a.fin = weakref.finalize(a, slab.release, ticket)  # freed if nobody decodes it
            a.fin.atexit = False
    except Exception as exc:
        if isinstance(exc, OSError):
            exc = SharedMemoryError(f"cannot map shared-memory slab {name} of worker pid {pid}: {exc}")
        a.error = exc
    return a


class ShmDecoder:
    """Consumer side: turns an arrived descriptor into the batch, warns once on fallback."""

    def __init__(self) -> None:
        self.warned = False
        self.seen: set[int] = set()

    def __call__(self, data: Any) -> Any:
        if type(data) is not _Arrived:
            return data
        if data.pid not in self.seen:
            self.seen.add(data.pid)
            sweep()  # a new worker: an old one may have died mid-write (rule 4)
        if data.note and not self.warned:
            self.warned = True
            warnings.warn(ShmFallbackWarning(data.note), stacklevel=2)
        return data.open()


def sweep(*, force: bool = False) -> int:
    """Unlink names a dead worker left behind and forget its slabs; returns how many
    names were removed. ``force`` skips the in-flight grace period (the loader's pool
    is shut down). Names of other consumers are removed only when both their processes
    are gone, they belong to this user, and they are over a minute old (rule 5)."""
    me = os.getpid()
    now = time.time()
    removed = 0
    try:
        entries = list(os.scandir(SHM_DIR))
    except OSError:
        return 0
    uid = os.getuid()
    for entry in entries:
        pids = _parse_name(entry.name)
        if pids is None:
            continue
        consumer, worker = pids
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        age = now - st.st_mtime
        if consumer == me:
            if _pid_alive(worker) or (not force and age < SWEEP_GRACE_S):
                continue
        elif st.st_uid != uid or age < FOREIGN_GRACE_S or _pid_alive(consumer) or _pid_alive(worker):
            continue
        _unlink(entry.name)
        removed += 1
    with _slabs_lock:
        dead = [n for n, s in _slabs.items() if not _pid_alive(s.worker_pid)]
        for n in dead:
            del _slabs[n]
    return removed


def mapped_slabs() -> int:
    """How many slabs this consumer process keeps mapped for live workers (for tests)."""
    with _slabs_lock:
        return len(_slabs)

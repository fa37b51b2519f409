"""Worker side: one arena of slabs per consumer process (rules 1, 3, 5 and 7).

Runs in workers; never imports asyncio.
"""

from __future__ import annotations

import itertools
import os
import secrets
import threading
from typing import Any

import numpy as np
import numpy.typing as npt

from . import _names
from ._mapping import HEADER, _Mapping, bytes_at, map_file, typed
from ._names import PREFIX, ShmConfig, _pid_alive, _unlink, enlarge_advice

MIN_SLAB = 1 << 20


def _size_class(n: int) -> int:
    """Round up to 1/16 of the next power of two (at most 6.25% waste), at least 1 MiB,
    so that a slightly smaller or larger batch (the last of an epoch) reuses a slab."""
    n = max(n, MIN_SLAB)
    step = 1 << max((n - 1).bit_length() - 4, 12)
    return (n + step - 1) // step * step


class _WSlab:
    """A worker's mapping of one slab."""

    __slots__ = ("capacity", "data", "last", "mapping", "name", "state")

    def __init__(self, name: str, mapping: _Mapping, state: npt.NDArray[np.int64]) -> None:
        self.name = name
        self.mapping = mapping
        self.capacity = mapping.size
        self.state = state
        self.data = bytes_at(mapping.addr + HEADER, mapping.size - HEADER, mapping)
        self.last = 0  # ticket of the last batch written here (idle trimming)

    def free(self) -> bool:
        return int(self.state[0]) == 0

    def array(self, offset: int, shape: tuple[int, ...], dtype: np.dtype[Any], fortran: bool) -> Any:
        return typed(self.data, offset, shape, dtype, fortran)


class _Arena:
    """One worker's slabs for one consumer process."""

    def __init__(self, consumer_pid: int) -> None:
        self.consumer_pid = consumer_pid
        self.nonce = secrets.token_hex(4)
        self.seq = itertools.count()
        self.tickets = itertools.count(1)
        self.slabs: list[_WSlab] = []
        self.names: set[str] = set()  # names of our slabs; most already unlinked by the consumer
        self.retired: list[str] = []  # slabs dropped here; the consumer should drop its mapping too
        # Reentrant: a worker already orphaned runs consumer_died from watch() at once.
        self.lock = threading.RLock()
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
            from .._worker import orphan as _orphan

            _orphan.on_orphaned(self.consumer_died)

    def _watch(self) -> None:
        from .._worker.orphan import wait_for_exit

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
            # Watch before the first slab exists, so no name can be created after (or
            # while) the orphan watch runs its cleanup and ends the process.
            self.watch()
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
                f"could not create a {cap / 2**20:.0f} MiB shared-memory segment in {_names.SHM_DIR}: "
                f"{exc}. {enlarge_advice()}"
            )
        self.slabs.append(slab)
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
        shm_dir = _names.SHM_DIR
        st = os.statvfs(shm_dir)
        avail = st.f_bavail * st.f_frsize
        if cfg.capacity is not None:
            avail = min(avail, cfg.capacity)
        mine = self.bytes() - (victim.capacity if victim is not None else 0)
        largest = max((s.capacity for s in self.slabs if s is not victim), default=0)
        # Room for the whole window at the largest size seen, counting what we already hold.
        window = cfg.window_for(cap)
        if cap > largest and cap * window > avail + mine:
            return (
                f"{shm_dir} has {avail / 2**20:.0f} MiB free but the loader's window needs "
                f"{cap * window / 2**20:.0f} MiB ({window} batches of up to "
                f"{cap / 2**20:.0f} MiB); batches are pickled through the pipe instead, which is "
                f"several times slower for large arrays. {enlarge_advice()}"
            )
        if cap > avail:
            return f"{shm_dir} is full ({avail / 2**20:.0f} MiB free). {enlarge_advice()}"
        return None

    def _create(self, cap: int) -> _WSlab:
        name = f"{PREFIX}{self.consumer_pid}_{os.getpid()}_{self.nonce}_{next(self.seq)}"
        flags = (
            os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
        )
        fd = os.open(_names.path(name), flags, 0o600)
        self.names.add(name)
        try:
            # Reserve the pages now: writing to a sparse tmpfs file that runs out of
            # room is a SIGBUS, an ENOSPC here is an exception we can fall back from.
            os.posix_fallocate(fd, 0, cap)
            mapping, state = map_file(fd, populate=True)
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


def arena(consumer_pid: int) -> _Arena:
    """This worker's arena for ``consumer_pid``, created on first use."""
    with _arenas_lock:
        found = _arenas.get(consumer_pid)
        if found is None:
            found = _arenas[consumer_pid] = _Arena(consumer_pid)
        return found

"""Consumer side: attach a slab when its descriptor is unpickled, view its leaves, free
it when the batch's last array is gone, sweep what dead workers left (rules 2, 3, 4, 6).

Everything here up to :class:`ShmDecoder` runs inside unpickling, in the executor's
result thread: it must never raise (an exception there breaks the whole pool), so errors
are kept on the batch and raised by the decoder.
"""

from __future__ import annotations

import os
import threading
import warnings
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from ..errors import SharedMemoryError, ShmFallbackWarning
from . import _names
from ._mapping import HEADER, _Export, _Mapping, map_file, typed
from ._names import _pid_alive, _unlink


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
# The export of every batch still viewed, by (slab, ticket): should one batch's
# descriptor be unpickled in pieces, all of them share one export and one release.
_exports: weakref.WeakValueDictionary[tuple[str, int], _Export] = weakref.WeakValueDictionary()


def _attach(name: str, worker_pid: int) -> _CSlab:
    with _slabs_lock:
        slab = _slabs.get(name)
        if slab is not None:
            return slab
        fd = os.open(
            _names.path(name), os.O_RDWR | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
        )
        try:
            mapping, state = map_file(fd, populate=False)
        finally:
            os.close(fd)
        _unlink(name)  # rule 2: both sides have it mapped, the name has done its job
        slab = _slabs[name] = _CSlab(name, mapping, state, worker_pid)
        return slab


def _forget(names: Sequence[str]) -> None:
    with _slabs_lock:
        for name in names:
            _slabs.pop(name, None)


class _Landing:
    """One batch's slab as the consumer sees it while the descriptor is unpickled."""

    __slots__ = ("error", "raw")

    def __init__(self) -> None:
        self.raw: npt.NDArray[np.uint8] | None = None  # the batch's bytes; owns the export
        self.error: BaseException | None = None


def land(name: str, ticket: int, used: int, retired: tuple[str, ...], pid: int) -> _Landing:
    """Unpickles a worker's slab reference: maps the slab (unlinking its name the first
    time), checks that it holds ``ticket``, and exports its ``used`` bytes; the export's
    finalizer frees the slab once the last array viewing them is gone (rule 3)."""
    landing = _Landing()
    try:
        if retired:
            _forget(retired)
        slab = _attach(name, pid)
        state = int(slab.state[0])
        if state != ticket:
            raise SharedMemoryError(
                f"shared-memory slab {name} holds ticket {state}, expected {ticket}: it was "
                "reused while a batch was in flight"
            )
        with _slabs_lock:
            export = _exports.get((name, ticket))
            if export is None:
                export = _exports[(name, ticket)] = _Export(slab.addr + HEADER, used, slab)
                weakref.finalize(export, slab.release, ticket).atexit = False
        landing.raw = np.asarray(export)
    except Exception as exc:
        if isinstance(exc, OSError):
            exc = SharedMemoryError(f"cannot map shared-memory slab {name} of worker pid {pid}: {exc}")
        landing.error = exc
    return landing


def view(
    landing: _Landing, offset: int, shape: tuple[int, ...], dtype: np.dtype[Any], fortran: bool, tensor: bool
) -> Any:
    """Unpickles one leaf: the array (or, for a torch leaf, the tensor) viewing the slab.
    ``None`` if the slab could not be had; the decoder raises why."""
    if landing.raw is None:
        return None
    try:
        out = typed(landing.raw, offset, shape, dtype, fortran)
        if tensor:
            import torch

            out = torch.from_numpy(out)
        return out
    except Exception as exc:  # torch missing here, a corrupt descriptor
        landing.error = SharedMemoryError(f"cannot view a leaf of a shared-memory batch: {exc!r}")
        return None


def unplaced(value: Any) -> Any:
    """Unpickles a leaf that got no slab: its value travelled pickled, as it is."""
    return value


class _Arrived:
    """A descriptor as the consumer holds it: the batch (viewing its slab), or the error."""

    __slots__ = ("batch", "error", "note", "pid")

    def __init__(self, batch: Any, error: BaseException | None, note: str | None, pid: int) -> None:
        self.batch = batch
        self.error = error
        self.note = note
        self.pid = pid


def arrive(pid: int, landing: _Landing | None, tree: Any, note: str | None) -> _Arrived:
    """Unpickles a whole descriptor; ``tree`` is the batch, already viewing the slab."""
    error = landing.error if landing is not None else None
    return _Arrived(None if error is not None else tree, error, note, pid)


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
        if data.error is not None:
            raise data.error
        return data.batch


def sweep(*, force: bool = False) -> int:
    """Unlink names a dead worker left behind and forget its slabs; returns how many
    names were removed. ``force`` skips the in-flight grace period (the loader's pool
    is shut down). Names of other consumers are removed only when both their processes
    are gone, they belong to this user, and they are over a minute old (rule 5)."""
    removed = _names.remove_stale(force=force)
    with _slabs_lock:
        dead = [n for n, s in _slabs.items() if not _pid_alive(s.worker_pid)]
        for n in dead:
            del _slabs[n]
    return removed


def mapped_slabs() -> int:
    """How many slabs this consumer process keeps mapped for live workers (for tests)."""
    with _slabs_lock:
        return len(_slabs)

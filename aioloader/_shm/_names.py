"""Names in ``/dev/shm``, whether this process may use it, and who is still alive.

Both sides use these: workers to create and to clean up after a dead consumer, the
consumer to attach and to sweep what dead workers left (rules 1, 4 and 5 of
:mod:`aioloader._shm`). Other modules read :data:`SHM_DIR` through this module at call
time, so that a test may point it elsewhere.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass

PREFIX = "aioloader_"
SHM_DIR = "/dev/shm"
CAPACITY_ENV = "AIOLOADER_SHM_CAPACITY"
MIN_LEAF_BYTES = 64 * 1024  # smaller leaves cost less pickled than a slab's bookkeeping
SWEEP_GRACE_S = 5.0  # a dead worker's name younger than this may still be in flight
FOREIGN_GRACE_S = 60.0


@dataclass(frozen=True)
class ShmConfig:
    """Fixed when the loader is built; travels to every worker inside the encoder."""

    consumer_pid: int
    host: tuple[str, int, int, int]
    window: int  # batches that may occupy slabs at once when nobody holds any (prefetch + 1)
    max_slabs: int  # per worker arena
    min_leaf_bytes: int = MIN_LEAF_BYTES
    capacity: int | None = None  # cap on the free /dev/shm bytes assumed
    grown: int = 0  # a window that grows: at most this many batches (0: it does not grow)
    grown_bytes: int = 0  # ... and at most this many bytes of batches

    def window_for(self, cap: int) -> int:
        """Batches of ``cap`` bytes that may occupy slabs at once when nobody holds any:
        the window, or, where it grows, as far as it may grow for batches that large."""
        if not self.grown:
            return self.window
        return max(self.window, min(self.grown, self.grown_bytes // max(1, cap)) + 1)


def path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


def enlarge_advice() -> str:
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


def parse_capacity(raw: str) -> int | None:
    """Bytes from ``AIOLOADER_SHM_CAPACITY``'s text (``K``/``M``/``G``/``T`` suffixes, an
    optional ``B``); ``None`` for an empty value. Raises ``ValueError`` naming the variable."""
    raw = raw.strip()
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


_PF_EXITING = 0x4  # linux/sched.h


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
    # After the command name: state, ppid, pgrp, session, tty_nr, tpgid, flags, ...
    fields = stat[stat.rfind(b")") + 2 :].split()
    if fields[:1] in ([b"Z"], [b"X"], [b"x"]):
        return False
    # A process being killed closes its files (so its pipes read EOF in our workers)
    # before it becomes a zombie; the kernel flags it as exiting first (PF_EXITING).
    return len(fields) < 7 or not int(fields[6]) & _PF_EXITING


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
        os.unlink(path(name))


def remove_stale(*, force: bool) -> int:
    """Unlink this consumer's names whose worker is dead (older than the in-flight grace
    unless ``force``), and other consumers' names whose two processes are both gone,
    that belong to this user and are over a minute old. Returns how many were removed."""
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
    return removed

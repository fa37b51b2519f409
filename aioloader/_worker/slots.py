"""The slot table: which task each owned worker holds, and since when.

Crash attribution and timeouts need it. Each worker of an owned process pool claims one
row of a small shared int64 table: ``pid, phase, seq, start_ns, ready_ns``. ``seq``
numbers the tasks of the worker's channel (0, 1, ...). The phase goes ``STARTING`` →
``READY`` (``ready_ns`` set) → for each task ``ACCEPTED`` (received) → ``LOADING`` and
``INITIALIZING`` (only the first task of a loader whose payload came with it: unpickling
the payload, then its ``worker_init_fn``) → ``RUNNING`` (building; ``start_ns`` set) →
``HOLDING`` (the reply is on its way). So a worker that died holding a task names it;
one that died ``READY`` held none; one that died ``STARTING`` never finished starting.
While it starts, ``seq`` and ``start_ns`` say which payload it loads and at what step
(:func:`starting`). A timeout's message says which phase hung.

Where there is no table (the loader's own thread, a borrowed executor), the marks do
nothing: those backends time a task from when they hand it over.

Also here, for the consumer: how an exit code reads in a message.

Worker side: never imports asyncio.
"""

from __future__ import annotations

import mmap
import signal
import time
from multiprocessing import reduction
from typing import Any

import numpy as np

__all__ = [
    "SharedTable", "Slots", "accepted", "claim", "describe_exit", "holding", "mark", "starting", "torch_crash_words",
]  # fmt: skip

def describe_exit(code: int | None) -> str:
    """An exit code for a message: ``-9, killed by SIGKILL``."""
    if code is None:
        return "unknown"
    if code < 0:
        try:
            return f"{code}, killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"{code}, killed by signal {-code}"
    return str(code)


def torch_crash_words(pid: int | None, code: int | None) -> str:
    """What torch says of a dead worker, which users and tools match on:
    ``DataLoader worker (pid 12) is killed by signal: Killed.``"""
    who = f"DataLoader worker (pid {pid if pid is not None else 'unknown'})"
    if code is not None and code < 0:
        try:
            name = signal.strsignal(-code) or f"signal {-code}"
        except ValueError:
            name = f"signal {-code}"
        return f"{who} is killed by signal: {name}."
    return f"{who} exited unexpectedly with exit code {describe_exit(code)}."


class Slots:
    """One row per worker of an owned process pool: ``pid, phase, seq, start_ns, ready_ns``."""

    WIDTH = 5
    STARTING, READY, ACCEPTED, LOADING, INITIALIZING, RUNNING, HOLDING = range(7)

    def __init__(self, raw: Any) -> None:
        self.rows = np.frombuffer(raw, dtype=np.int64).reshape(-1, self.WIDTH)

    def row(self, slot: int) -> tuple[int, int, int, int, int]:
        """``(pid, phase, seq, start_ns, ready_ns)`` of row ``slot``, as of now."""
        r = self.rows[slot].copy()
        return int(r[0]), int(r[1]), int(r[2]), int(r[3]), int(r[4])


class SharedTable:
    """A pool's slot table as a ``multiprocessing`` process argument: the descriptor of
    its memfd, duplicated into the child as it starts (``reduction.DupFd``), mapped
    there. A forked child inherits the descriptor itself."""

    def __init__(self, fd: int, size: int) -> None:
        self.fd = fd
        self.size = size

    def __reduce__(self) -> tuple[Any, ...]:
        return (_reopen, (reduction.DupFd(self.fd), self.size))

    def buffer(self) -> mmap.mmap:
        return mmap.mmap(self.fd, self.size)


def _reopen(dup: Any, size: int) -> SharedTable:
    return SharedTable(dup.detach(), size)


_row: Any = None  # this worker's row of its pool's table


def claim(table: Any, slot: int, pid: int) -> None:
    """Take row ``slot`` of ``table`` for this worker (phase ``STARTING``)."""
    global _row
    if isinstance(table, SharedTable):
        table = table.buffer()
    _row = Slots(table).rows[slot]
    _row[4] = 0
    _row[2] = -1
    _row[1] = Slots.STARTING
    _row[0] = pid


def accepted(seq: int) -> None:
    """An owned worker took task ``seq`` of its channel (0, 1, ...) and sets it up."""
    row = _row
    row[3] = 0
    row[2] = seq
    row[1] = Slots.ACCEPTED


def holding() -> None:
    """An owned worker's task is done: its reply is on the way (the number stays)."""
    _row[1] = Slots.HOLDING


def mark(phase: int, start: int = 0) -> None:
    """Record this worker's phase (see the module docstring): ``READY``, ``LOADING``,
    ``INITIALIZING`` or ``RUNNING`` (with its ``start``). The channel's loop marks
    ``ACCEPTED`` and ``HOLDING`` (:func:`accepted`, :func:`holding`). Without a table
    (a thread, a borrowed executor) it does nothing."""
    row = _row
    if row is None:
        return
    if phase == Slots.RUNNING:
        row[3] = start
    elif phase == Slots.READY:
        row[2] = -1
        row[3] = 0
        row[4] = time.monotonic_ns()  # the pool times a task sent while it started from here
    row[1] = phase


def starting(k: int, step: int) -> None:
    """While the worker starts (its phase stays ``STARTING``): it is at payload ``k`` of
    those it was given, unpickling it (``step`` ``LOADING``) or running its loader's
    ``worker_init_fn`` (``INITIALIZING``). A start killed for hanging names them."""
    row = _row
    if row is None:
        return
    row[3] = step
    row[2] = k

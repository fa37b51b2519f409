"""The slot table: which worker holds which task, and since when.

Crash attribution and timeouts need it. Each worker of an owned process pool claims one
row of a small shared int64 table: ``pid, phase, task_id, start_ns``. The phase goes
``STARTING`` (the initializer runs) → ``READY`` → for each task ``ACCEPTED`` (received,
setting up) → ``RUNNING`` (building; ``start_ns`` set) → ``HOLDING`` (the outcome is on
its way back; the task id stays until the next task). So a worker that died holding a
task names it; one that died ``READY``, or ``HOLDING`` a task already delivered, was
idle; one that died ``STARTING`` (or before it claimed a row) never finished starting.

Where there is no table (the loader's own thread, a borrowed executor), the marks go to
:data:`local_starts` of the process that runs the task.

Also here, for the consumer: what the pool concludes from the table when a generation
breaks (:class:`CrashInfo`), and how an exit code reads in a message.

Worker side: never imports asyncio.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["CrashInfo", "Rows", "Slots", "claim", "describe_exit", "local_starts", "mark", "torch_crash_words"]

Rows = dict[int, tuple[int, int, int]]  # pid -> (phase, task_id, start_ns)


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


@dataclass
class CrashInfo:
    """How a generation ended, as far as its tasks are concerned (the pool's verdict)."""

    charged: dict[int, int | None]  # task id -> exit code of the worker that died holding it
    startup: bool = False  # no worker of the generation ever became ready
    fatal: Exception | None = None  # raised to every task that asks
    pids: dict[int, int] = field(default_factory=dict)  # task id -> pid of the worker that died holding it


class Slots:
    """One row per worker of an owned process pool: ``pid, phase, task_id, start_ns``."""

    WIDTH = 4
    STARTING, READY, ACCEPTED, RUNNING, HOLDING = range(5)

    def __init__(self, raw: Any) -> None:
        self.rows = np.frombuffer(raw, dtype=np.int64).reshape(-1, self.WIDTH)

    def snapshot(self) -> Rows:
        """pid -> (phase, task_id, start_ns) of every claimed row, as of now."""
        return {int(r[0]): (int(r[1]), int(r[2]), int(r[3])) for r in self.rows.copy() if r[0] > 0}

    def running(self, task_id: int) -> tuple[int, int] | None:
        """(pid, start_ns) of the worker building ``task_id``, or ``None``."""
        for pid, (phase, tid, start) in self.snapshot().items():
            if tid == task_id and phase == self.RUNNING:
                return pid, start
        return None


_row: Any = None  # this worker's row of its pool's table
local_starts: dict[int, int] = {}  # task_id -> start_ns, for tasks run without a table


def claim(table: Any, slot: int, pid: int) -> None:
    """Take row ``slot`` of ``table`` for this worker (phase ``STARTING``)."""
    global _row
    _row = Slots(table).rows[slot]
    _row[2] = -1
    _row[1] = Slots.STARTING
    _row[0] = pid


def mark(phase: int, task_id: int = -1, start: int = 0) -> None:
    """Record this worker's phase (see the module docstring)."""
    row = _row
    if row is None:
        if phase == Slots.RUNNING:
            local_starts[task_id] = start
        elif phase == Slots.HOLDING:
            local_starts.pop(task_id, None)
        return
    if phase == Slots.ACCEPTED:
        row[3] = 0
        row[2] = task_id
    elif phase == Slots.RUNNING:
        row[3] = start
    row[1] = phase

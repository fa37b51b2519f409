"""Datasets for tests/test_owned_pool.py (importable by workers)."""

from __future__ import annotations

import os
import signal
from typing import Any


class GatedLog:
    """Sample ``i`` appends ``"<pid> <i>"`` to ``log``; a sample in ``gated`` then waits
    until someone opens the FIFO ``gate`` for writing (an event, not a sleep)."""

    def __init__(self, n: int, log: str, gate: str, gated: frozenset[int]) -> None:
        self.n, self.log, self.gate, self.gated = n, log, gate, gated

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        fd = os.open(self.log, os.O_WRONLY | os.O_APPEND)
        try:
            os.write(fd, f"{os.getpid()} {i}\n".encode())
        finally:
            os.close(fd)
        if i in self.gated:
            os.close(os.open(self.gate, os.O_RDONLY))
        return i


def loads(log: str) -> list[tuple[int, int]]:
    with open(log) as f:
        return [(int(p), int(i)) for p, i in (line.split() for line in f if line.strip())]


class KilledAtBirth:
    """Kills the worker that unpickles it, with SIGKILL, as something outside would."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> int:
        return i

    def __reduce__(self) -> Any:
        return (_die, ())


def _die() -> KilledAtBirth:
    if os.environ.get("AIOLOADER_TEST_CONSUMER") != str(os.getpid()):
        os.kill(os.getpid(), signal.SIGKILL)
    return KilledAtBirth()


def triple(x: int) -> int:
    return 3 * x


def pid_after(path: str) -> int:
    """Waits until ``path`` (a FIFO) is opened for writing, then returns this pid."""
    os.close(os.open(path, os.O_RDONLY))
    return os.getpid()


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def note(path: str, x: int) -> int:
    """Appends ``x`` to the file ``path``, a line: which functions ran, in order."""
    with open(path, "a") as f:
        f.write(f"{x}\n")
    return x

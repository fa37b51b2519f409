"""Workers' side of tests/test_timeouts.py (importable by workers)."""

from __future__ import annotations

import os
from typing import NamedTuple

from ._datasets import first_to_claim, wait_to_be_killed


def init_never_returns(worker_id: int) -> None:
    """A worker_init_fn that waits on an event nobody sets: only a kill ends it."""
    wait_to_be_killed(120)


class AtGate(NamedTuple):
    """A pool task: waits at the FIFO ``gate`` until someone opens it for writing."""

    task_id: int
    gate: str


def pass_gate(task: AtGate) -> int:
    os.close(os.open(task.gate, os.O_RDONLY))
    return os.getpid()


class UnpicklesSlowlyOnce:
    """A map-style dataset whose first unpickling in a worker (an ``O_EXCL`` marker
    decides which) never returns; every other one returns at once."""

    def __init__(self, n: int, marker: str) -> None:
        self.n, self.marker = n, marker

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        if os.getpid() != state.get("consumer") and first_to_claim(self.marker):
            wait_to_be_killed(120)

    def __getstate__(self) -> dict[str, object]:
        return {**self.__dict__, "consumer": os.getpid()}

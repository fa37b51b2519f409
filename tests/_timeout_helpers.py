"""Workers' side of tests/test_timeouts.py (importable by workers)."""

from __future__ import annotations

import os
from typing import NamedTuple

from ._datasets import wait_to_be_killed


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

"""Datasets for the engine tests (module level: workers import them)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from ._datasets import RangeDataset


class RendezvousDataset(RangeDataset):
    """Sample ``wait_at`` blocks on its first load until sample ``release_at`` is loaded
    for the second time (in the next epoch), which writes the file ``release``.

    With ``ordered=False`` this makes a unit of epoch 1 finish before the last unit of
    epoch 0: the engine must keep it for epoch 1's consumer.
    """

    def __init__(self, n: int, wait_at: int, release_at: int, folder: str) -> None:
        super().__init__(n)
        self.wait_at = wait_at
        self.release_at = release_at
        self.folder = folder

    def _calls(self, i: int) -> int:
        with open(os.path.join(self.folder, f"calls-{i}"), "a+") as f:
            f.write("x")
            f.seek(0)
            return len(f.read())

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        release = Path(self.folder, "release")
        calls = self._calls(i)
        if i == self.release_at and calls == 2:
            release.touch()
        if i == self.wait_at and calls == 1:
            deadline = time.monotonic() + 60
            while not release.exists() and time.monotonic() < deadline:
                time.sleep(0.002)  # waiting on a file another worker writes
        return super().__getitem__(i)


class ExitingDataset(RangeDataset):
    """``__getitem__(bad)`` raises SystemExit, as a script's ``sys.exit()`` would."""

    def __init__(self, n: int, bad: int) -> None:
        super().__init__(n)
        self.bad = bad

    def __getitem__(self, i: int) -> Any:
        if i == self.bad:
            raise SystemExit(f"sample {i} called sys.exit")
        return super().__getitem__(i)

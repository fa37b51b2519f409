"""Progress bars for the commands and the synthetic-data writer (always on stderr)."""

from __future__ import annotations

import sys
from typing import Any

from tqdm import tqdm  # type: ignore[import-untyped,unused-ignore]  # (no stubs; users run mypy too)

__all__ = ["progress_bar"]


class _Bar(tqdm):  # type: ignore[misc]
    # No monitor thread: every user updates the bar after each batch, and a monitor
    # thread could outlive the command that made it.
    monitor_interval = 0


def progress_bar(total: int, desc: str, *, unit: str = "img", disable: bool = False) -> Any:
    """A ``tqdm`` bar of ``total`` steps on stderr (stdout stays free for results)."""
    return _Bar(total=total, desc=desc, unit=unit, file=sys.stderr, disable=disable)

"""Argument checks shared by the facades: each error names the parameter and the value."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["check_bool", "check_choice", "check_int", "check_seconds", "check_unbatched"]


def check_int(name: str, value: Any, minimum: int) -> int:
    """``value`` as an int >= ``minimum``, or a ValueError naming ``name`` and the value."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def check_bool(name: str, value: Any) -> bool:
    """``value`` if it is a bool (numpy's too); strings like ``"false"`` are refused,
    because ``bool("false")`` is true."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {value!r} ({type(value).__name__})")
    return bool(value)


def check_choice(name: str, value: Any, choices: Sequence[str]) -> Any:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}")
    return value


def check_seconds(name: str, value: Any, *, allow_zero: bool) -> float | None:
    """A finite, non-negative (or positive) number of seconds, or ``None``."""
    if value is None:
        return None
    ok = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))
    if not ok or not math.isfinite(value) or not (value >= 0 if allow_zero else value > 0):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be a finite number of seconds {bound}, or None; got {value!r}")
    return float(value)


def check_unbatched(batch_sampler: object, drop_last: bool | None, last_batch: str) -> None:
    """``batch_size=None`` turns batching off; the arguments that shape batches conflict."""
    conflicts = [
        name
        for name, given in (
            ("batch_sampler", batch_sampler is not None),
            ("drop_last=True", drop_last is True),
            (f"last_batch={last_batch!r}", last_batch != "keep"),
        )
        if given
    ]
    if conflicts:
        raise ValueError(f"batch_size=None (no automatic batching) is mutually exclusive with {', '.join(conflicts)}")

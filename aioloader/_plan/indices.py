"""Checks on what users hand the planner: dataset lengths, samplers, batch samplers.

Every error names the culprit (the dataset's type, or the sampler), the position of the bad
item and its value, so that a mistake in a sampler is found where it was made rather than
as an ``IndexError`` deep inside a worker.
"""

from __future__ import annotations

import operator
import reprlib
from collections.abc import Iterable
from typing import Any

import numpy as np
from numpy.typing import NDArray

from .permute import MAX_LENGTH

__all__ = ["batch_sampler_batches", "check_length", "dataset_length", "sampler_keys", "sampler_order"]

_repr = reprlib.Repr()
_repr.maxstring = 40
_repr.maxother = 60


def _show(value: Any) -> str:
    return f"{_repr.repr(value)} ({type(value).__name__})"


def check_length(length: Any, what: str) -> int:
    """``length`` as an int in ``[0, 2**63 - 1]``; ``what`` names its source in errors."""
    if isinstance(length, (bool, np.bool_)):
        raise TypeError(f"{what} must be an int, got {_show(length)}")
    try:
        n = operator.index(length)
    except TypeError:
        raise TypeError(f"{what} must be an int, got {_show(length)}") from None
    if n < 0:
        raise ValueError(f"{what} must be >= 0, got {n}")
    if n > MAX_LENGTH:
        raise ValueError(f"{what} is {n}, more than the 2**63 - 1 samples aioloader can index")
    return n


def dataset_length(dataset: Any) -> int:
    """``len(dataset)``, with errors that name the dataset when ``__len__`` returns
    something that is not a usable length (``len()`` itself would only say "'float' object
    cannot be interpreted as an integer" or "cannot fit 'int' into an index-sized integer")."""
    method = getattr(type(dataset), "__len__", None)
    if method is None:
        raise TypeError(f"dataset {type(dataset).__name__} has no __len__")
    return check_length(method(dataset), f"len(dataset) (from {type(dataset).__name__}.__len__)")


def _bad_index(value: Any) -> bool:
    """Would ``value`` be silently misread as an index (a bool, a bool tensor)?"""
    if isinstance(value, (bool, np.bool_)):
        return True
    dtype = getattr(value, "dtype", None)
    return dtype is not None and "bool" in str(dtype)


def _as_index(value: Any, where: str) -> int:
    if not _bad_index(value):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise TypeError(
        f"{where} is {_show(value)}: sample indices must be ints "
        "(numpy integers are fine; bools and floats are not indices)"
    )


def _indices(items: Iterable[Any], where: str) -> NDArray[np.int64]:
    """The items as int64, checked one by one; ``where`` is formatted with the position."""
    if isinstance(items, np.ndarray) and items.ndim == 1 and items.dtype.kind in "iu":
        return items.astype(np.int64)  # already integers: no per-item check needed
    out: list[int] = []
    append = out.append
    for pos, value in enumerate(items):
        # type() first: the common case (plain ints) skips the slower checks.
        append(value if type(value) is int else _as_index(value, where.format(pos=pos)))
    try:
        return np.asarray(out, dtype=np.int64)
    except OverflowError:
        big = next(i for i in out if not -(2**63) <= i < 2**63)
        raise ValueError(f"{where.format(pos=out.index(big))} is {big}, not a sample index") from None


def _check_range(indices: NDArray[np.int64], length: int, where: str) -> None:
    bad = np.flatnonzero((indices < 0) | (indices >= length))
    if bad.size:
        pos = int(bad[0])
        raise ValueError(
            f"{where.format(pos=pos)} is index {int(indices[pos])}, outside [0, {length}): "
            f"the dataset has length {length}"
        )


def _name(obj: Any) -> str:
    return _repr.repr(obj)


def sampler_order(sampler: Iterable[Any], length: int) -> NDArray[np.int64]:
    """One pass over ``sampler``, checked: every item an int (not a bool) in ``[0, length)``."""
    where = f"sampler {_name(sampler)}: item {{pos}}"
    order = _indices(sampler, where)
    _check_range(order, length, where)
    return order


def sampler_keys(sampler: Iterable[Any], length: int) -> NDArray[Any]:
    """One pass over the sampler of a loader without automatic batching
    (``batch_size=None``): as torch does then, any key it yields is passed to
    ``dataset[key]`` (a list of indices for a dataset that loads a whole batch at once).
    Ints only are checked as :func:`sampler_order` checks them (an int64 array); a
    sampler that yields anything else gives an object array of its keys, unchecked."""
    keys = list(sampler)
    if all(type(k) is int or (not _bad_index(k) and isinstance(k, np.integer)) for k in keys):
        return sampler_order(keys, length)
    out = np.empty(len(keys), dtype=object)
    for pos, key in enumerate(keys):  # one by one: numpy would turn equal-length lists into rows
        out[pos] = key
    return out


def batch_sampler_batches(batch_sampler: Iterable[Any], length: int) -> list[NDArray[np.int64]]:
    """One pass over ``batch_sampler``, checked like :func:`sampler_order`, batch by batch."""
    name = _name(batch_sampler)
    batches = []
    for k, batch in enumerate(batch_sampler):
        if isinstance(batch, (str, bytes)) or not isinstance(batch, Iterable):
            raise TypeError(
                f"batch_sampler {name}: batch {k} is {_show(batch)}; each batch must be a sequence of ints"
            )
        where = f"batch_sampler {name}: batch {k}, item {{pos}}"
        indices = _indices(batch, where)
        if not len(indices):
            raise ValueError(f"batch_sampler {name}: batch {k} is empty")
        _check_range(indices, length, where)
        batches.append(indices)
    return batches

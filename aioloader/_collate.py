"""``default_collate``: turn a list of samples into one batch, numpy first.

Runs inside workers; free of asyncio.
"""

from __future__ import annotations

import numbers
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .errors import CollateError

__all__ = ["default_collate"]


def _is_namedtuple(obj: object) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "_fields")


def _describe(x: Any) -> str:
    shape = getattr(x, "shape", None)
    if shape is not None:
        return f"{type(x).__name__} of shape {tuple(shape)} and dtype {getattr(x, 'dtype', '?')}"
    size = getattr(x, "size", None)
    if size is not None and hasattr(x, "mode"):
        return f"PIL image of size {size} and mode {x.mode}"
    return type(x).__name__


def _mismatch(samples: Sequence[Any], what: str, path: str, key: Any) -> CollateError:
    first = key(samples[0])
    for pos, s in enumerate(samples):
        if key(s) != first:
            where = f" at {path}" if path else ""
            return CollateError(
                f"cannot collate samples with different {what}{where}: batch position 0 is "
                f"{_describe(samples[0])}, batch position {pos} is {_describe(s)}",
                positions=[0, pos],
            )
    return CollateError(f"cannot collate samples{(' at ' + path) if path else ''}", positions=[])


def _stack_arrays(samples: Sequence[Any], path: str) -> np.ndarray:
    first = samples[0]
    for s in samples:
        if not isinstance(s, np.ndarray) or s.shape != first.shape:
            raise _mismatch(samples, "shapes", path, lambda a: (type(a), getattr(a, "shape", None)))
    out = np.empty((len(samples), *first.shape), dtype=np.result_type(*samples))
    for k, s in enumerate(samples):
        out[k] = s
    return out


def _collate(samples: Sequence[Any], path: str) -> Any:
    elem = samples[0]
    if isinstance(elem, np.ndarray):
        return _stack_arrays(samples, path)
    if isinstance(elem, (bool, np.bool_)) or isinstance(elem, (numbers.Number, np.generic)):
        if not all(isinstance(s, (numbers.Number, np.generic)) for s in samples):
            raise _mismatch(samples, "types", path, type)
        return np.asarray(samples)
    if isinstance(elem, (str, bytes)) or elem is None:
        return list(samples)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(elem, torch.Tensor):
        if any(not isinstance(s, torch.Tensor) or s.shape != elem.shape for s in samples):
            raise _mismatch(samples, "shapes", path, lambda a: (type(a), getattr(a, "shape", None)))
        return torch.stack(list(samples))
    if hasattr(elem, "__array_interface__") and hasattr(elem, "mode"):  # PIL image
        return _stack_arrays([np.asarray(s) for s in samples], path)
    if isinstance(elem, Mapping):
        keys = list(elem.keys())
        for pos, s in enumerate(samples):
            if not isinstance(s, Mapping) or list(s.keys()) != keys:
                raise CollateError(
                    f"cannot collate mappings with different keys{(' at ' + path) if path else ''}: "
                    f"batch position 0 has {keys}, batch position {pos} has "
                    f"{list(s.keys()) if isinstance(s, Mapping) else type(s).__name__}",
                    positions=[0, pos],
                )
        out = {k: _collate([s[k] for s in samples], f"{path}[{k!r}]") for k in keys}
        try:
            return type(elem)(out)  # type: ignore[call-arg]  # keeps OrderedDict and friends
        except TypeError:
            return out
    if isinstance(elem, (tuple, list)):
        size = len(elem)
        for pos, s in enumerate(samples):
            if not isinstance(s, (tuple, list)) or len(s) != size:
                raise CollateError(
                    f"cannot collate sequences of different lengths{(' at ' + path) if path else ''}: "
                    f"batch position 0 has {size} elements, batch position {pos} has "
                    f"{len(s) if isinstance(s, (tuple, list)) else type(s).__name__}",
                    positions=[0, pos],
                )
        fields = [_collate([s[k] for s in samples], f"{path}[{k}]") for k in range(size)]
        if _is_namedtuple(elem):
            return type(elem)(*fields)
        return tuple(fields) if isinstance(elem, tuple) else fields
    return list(samples)


def default_collate(samples: Sequence[Any]) -> Any:
    """Combine ``samples`` into a batch.

    - numpy arrays of one shape → one array with a leading batch axis;
    - Python and numpy numbers → a 1-d numpy array;
    - PIL images of one size → a ``uint8`` array ``(N, H, W[, C])``;
    - torch tensors (when torch is imported) → ``torch.stack``;
    - tuples, lists, namedtuples and mappings → the same structure, collated field by field;
    - strings, bytes, ``None`` and anything else → a list.

    Raises :class:`~aioloader.CollateError` naming the mismatching batch positions and
    their shapes when samples do not fit together (the loader adds the sample indices).
    """
    if len(samples) == 0:
        raise CollateError("cannot collate an empty batch", positions=[])
    return _collate(samples, "")

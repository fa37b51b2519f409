"""``default_collate``: turn a list of samples into one batch, numpy first.

The dispatch (which kind of sample becomes which kind of batch, and which mismatches are
errors) is written once, here. Where the stacked arrays live is a :class:`Stacker`'s
choice: the default allocates fresh memory; the shared-memory transport passes one that
defers large stacks and later writes them straight into a slab (``aioloader._shm``).

Runs inside workers; free of asyncio.
"""

from __future__ import annotations

import numbers
import sys
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .errors import CollateError

__all__ = ["Stacker", "collate_with", "constructs_plainly", "default_collate", "fill_rows"]


class Stacker:
    """Where :func:`collate_with` puts what it stacks.

    ``arrays`` receives numpy arrays already checked to share one shape, with ``dtype``
    their common type, and returns the batch's value for them; ``tensors`` does the same
    for torch tensors of one shape. The default returns a fresh array (``torch.stack``).
    A subclass may return a placeholder instead (the shared-memory stacker does), so the
    result of :func:`collate_with` is only guaranteed to be real arrays with this class.
    """

    def arrays(self, samples: Sequence[np.ndarray], shape: tuple[int, ...], dtype: np.dtype[Any]) -> Any:
        out = np.empty((len(samples), *shape), dtype=dtype)
        fill_rows(out, samples)
        return out

    def tensors(self, samples: Sequence[Any]) -> Any:
        return sys.modules["torch"].stack(list(samples))


FRESH = Stacker()


def fill_rows(out: Any, samples: Sequence[Any]) -> None:
    """Write sample ``k`` into ``out[k]`` (numpy casts to ``out``'s dtype)."""
    for k, s in enumerate(samples):
        out[k] = s


def _is_namedtuple(obj: object) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "_fields")


def constructs_plainly(cls: type) -> bool:
    """Whether building a ``cls`` from collated values runs none of the user's code: an
    exact ``dict`` or ``OrderedDict``, or a namedtuple class (or subclass) that keeps the
    ``__new__`` written by :func:`collections.namedtuple` and defines no ``__init__``.
    Only such containers may be built around a stacker's placeholders."""
    if cls is dict or cls is OrderedDict:
        return True
    if not (issubclass(cls, tuple) and hasattr(cls, "_fields")):
        return False
    new_globals = getattr(cls.__new__, "__globals__", {})
    return new_globals.get("_tuple_new") is tuple.__new__ and cls.__init__ is object.__init__


def _describe(x: Any) -> str:
    shape = getattr(x, "shape", None)
    if shape is not None:
        return f"{type(x).__name__} of shape {tuple(shape)} and dtype {getattr(x, 'dtype', '?')}"
    size = getattr(x, "size", None)
    if size is not None and hasattr(x, "mode"):
        return f"PIL image of size {size} and mode {x.mode}"
    return type(x).__name__


def _at(path: str) -> str:
    return f" at {path}" if path else ""


def _mismatch(samples: Sequence[Any], what: str, path: str, key: Any) -> CollateError:
    first = key(samples[0])
    for pos, s in enumerate(samples):
        if key(s) != first:
            return CollateError(
                f"cannot collate samples with different {what}{_at(path)}: batch position 0 is "
                f"{_describe(samples[0])}, batch position {pos} is {_describe(s)}",
                positions=[0, pos],
            )
    return CollateError(f"cannot collate samples{_at(path)}", positions=[])


def _type_and_shape(a: Any) -> tuple[type, Any]:
    return type(a), getattr(a, "shape", None)


def _stack_arrays(samples: Sequence[Any], path: str, stack: Stacker) -> Any:
    first = samples[0]
    for s in samples:
        if not isinstance(s, np.ndarray) or s.shape != first.shape:
            raise _mismatch(samples, "shapes", path, _type_and_shape)
    return stack.arrays(samples, first.shape, np.result_type(*samples))


def _collate(samples: Sequence[Any], path: str, stack: Stacker) -> Any:
    elem = samples[0]
    if isinstance(elem, np.ndarray):
        return _stack_arrays(samples, path, stack)
    if isinstance(elem, (bool, np.bool_)) or isinstance(elem, (numbers.Number, np.generic)):
        if not all(isinstance(s, (numbers.Number, np.generic)) for s in samples):
            raise _mismatch(samples, "types", path, type)
        return np.asarray(samples)
    if isinstance(elem, (str, bytes)) or elem is None:
        return list(samples)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(elem, torch.Tensor):
        if any(not isinstance(s, torch.Tensor) or s.shape != elem.shape for s in samples):
            raise _mismatch(samples, "shapes", path, _type_and_shape)
        return stack.tensors(samples)
    if hasattr(elem, "__array_interface__") and hasattr(elem, "mode"):  # PIL image
        return _stack_arrays([np.asarray(s) for s in samples], path, stack)
    # The user's container classes must see real arrays when they are built.
    inner = stack if constructs_plainly(type(elem)) else FRESH
    if isinstance(elem, Mapping):
        keys = list(elem.keys())
        for pos, s in enumerate(samples):
            if not isinstance(s, Mapping) or list(s.keys()) != keys:
                raise CollateError(
                    f"cannot collate mappings with different keys{_at(path)}: "
                    f"batch position 0 has {keys}, batch position {pos} has "
                    f"{list(s.keys()) if isinstance(s, Mapping) else type(s).__name__}",
                    positions=[0, pos],
                )
        out = {k: _collate([s[k] for s in samples], f"{path}[{k!r}]", inner) for k in keys}
        try:
            return type(elem)(out)  # type: ignore[call-arg]  # keeps OrderedDict and friends
        except TypeError:
            return out
    if isinstance(elem, (tuple, list)):
        size = len(elem)
        for pos, s in enumerate(samples):
            if not isinstance(s, (tuple, list)) or len(s) != size:
                raise CollateError(
                    f"cannot collate sequences of different lengths{_at(path)}: "
                    f"batch position 0 has {size} elements, batch position {pos} has "
                    f"{len(s) if isinstance(s, (tuple, list)) else type(s).__name__}",
                    positions=[0, pos],
                )
        if not _is_namedtuple(elem):
            inner = stack  # the batch is a builtin tuple or list, whatever the sample's class
        fields = [_collate([s[k] for s in samples], f"{path}[{k}]", inner) for k in range(size)]
        if _is_namedtuple(elem):
            return type(elem)(*fields)
        return tuple(fields) if isinstance(elem, tuple) else fields
    return list(samples)


def collate_with(samples: Sequence[Any], stack: Stacker) -> Any:
    """:func:`default_collate`, with ``stack`` deciding where stacked arrays and tensors
    live: the same dispatch and the same errors, whatever ``stack`` does."""
    if len(samples) == 0:
        raise CollateError("cannot collate an empty batch", positions=[])
    return _collate(samples, "", stack)


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
    return collate_with(samples, FRESH)

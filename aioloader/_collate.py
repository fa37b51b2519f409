"""``default_collate``: turn a list of samples into one batch, numpy first.

*Torch mode.* A batch is collated the way ``torch.utils.data.default_collate`` does
(every number and numpy leaf becomes a tensor) when its first sample holds a torch
tensor anywhere in its structure, or when the loader forces it because its dataset is a
``torch.utils.data.Dataset`` (:func:`collate_torch`). Otherwise numbers and arrays stay
numpy. The choice is made per batch from the samples alone, so it costs nothing when
torch is not imported in the worker (no tensor can exist there).

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

__all__ = [
    "Stacker",
    "collate_torch",
    "collate_with",
    "constructs_plainly",
    "convert_torch",
    "default_collate",
    "default_convert",
    "fill_rows",
    "has_tensor",
    "is_torch_dataset",
]


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

    def array_tensor(
        self, samples: Sequence[np.ndarray], shape: tuple[int, ...], dtype: np.dtype[Any]
    ) -> Any:
        """Torch mode: numpy samples checked as for ``arrays``, stacked into one tensor."""
        return _torch().from_numpy(self.arrays(samples, shape, dtype))


FRESH = Stacker()


def fill_rows(out: Any, samples: Sequence[Any]) -> None:
    """Write sample ``k`` into ``out[k]`` (numpy casts to ``out``'s dtype)."""
    for k, s in enumerate(samples):
        out[k] = s


def _torch() -> Any:
    torch = sys.modules.get("torch")
    if torch is None:  # torch mode forced by a torch dataset, in a worker that has not imported it
        import torch
    return torch


def has_tensor(obj: Any) -> bool:
    """Whether a torch tensor is a leaf of ``obj`` (inside mappings, tuples and lists);
    ``False`` at once when torch is not imported."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    tensor = torch.Tensor
    stack = [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, tensor):
            return True
        if isinstance(x, Mapping):
            stack.extend(x.values())
        elif isinstance(x, (tuple, list)):
            stack.extend(x)
    return False


# numpy dtype kinds torch.from_numpy cannot hold: torch's own collate refuses these too.
_NOT_TENSOR_KINDS = frozenset("OSUVMm")


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


def _stack_arrays(samples: Sequence[Any], path: str, stack: Stacker, as_torch: bool) -> Any:
    first = samples[0]
    for s in samples:
        if not isinstance(s, np.ndarray) or s.shape != first.shape:
            raise _mismatch(samples, "shapes", path, _type_and_shape)
    dtype = np.result_type(*samples)
    if as_torch and dtype.kind not in _NOT_TENSOR_KINDS:
        return stack.array_tensor(samples, first.shape, dtype)
    return stack.arrays(samples, first.shape, dtype)


def _numbers(samples: Sequence[Any], as_torch: bool) -> Any:
    if not as_torch:
        return np.asarray(samples)
    torch = _torch()
    elem = samples[0]
    # torch's rules: the first sample's type decides; Python floats give float64, Python
    # ints int64 (bools bool), numpy scalars keep their dtype.
    if isinstance(elem, float) and not isinstance(elem, np.generic):
        return torch.tensor(samples, dtype=torch.float64)
    if isinstance(elem, int) and not isinstance(elem, np.generic):
        return torch.tensor(samples)
    arr = np.asarray(samples)
    return arr if arr.dtype.kind in _NOT_TENSOR_KINDS else torch.from_numpy(arr)


def _collate(samples: Sequence[Any], path: str, stack: Stacker, as_torch: bool = False) -> Any:
    elem = samples[0]
    if isinstance(elem, np.ndarray):
        return _stack_arrays(samples, path, stack, as_torch)
    if isinstance(elem, (str, bytes)):  # numpy's str_ and bytes_ too, as torch: a list
        return list(samples)
    if isinstance(elem, (bool, np.bool_)) or isinstance(elem, (numbers.Number, np.generic)):
        # Samples of one type need no per-sample ABC check (set(map(type)) runs in C).
        if len(set(map(type, samples))) != 1 and not all(
            isinstance(s, (numbers.Number, np.generic)) for s in samples
        ):
            raise _mismatch(samples, "types", path, type)
        return _numbers(samples, as_torch)
    if elem is None:
        return list(samples)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(elem, torch.Tensor):
        nested = [pos for pos, s in enumerate(samples) if getattr(s, "is_nested", False)]
        if nested:  # torch's stack would fail with an internal error: say what it is
            raise CollateError(
                f"cannot collate nested tensors{_at(path)} (batch positions {nested}): Batches of nested "
                "tensors are not currently supported by the default collate_fn; please provide a "
                "custom collate_fn to handle them appropriately",
                positions=nested,
            )
        if any(not isinstance(s, torch.Tensor) or s.shape != elem.shape for s in samples):
            raise _mismatch(samples, "shapes", path, _type_and_shape)
        return stack.tensors(samples)
    if hasattr(elem, "__array_interface__") and hasattr(elem, "mode"):  # PIL image
        return _stack_arrays([np.asarray(s) for s in samples], path, stack, as_torch)
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
        out = {k: _collate([s[k] for s in samples], f"{path}[{k!r}]", inner, as_torch) for k in keys}
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
        fields = [_collate([s[k] for s in samples], f"{path}[{k}]", inner, as_torch) for k in range(size)]
        if _is_namedtuple(elem):
            return type(elem)(*fields)
        return tuple(fields) if isinstance(elem, tuple) else fields
    return list(samples)


def collate_with(samples: Sequence[Any], stack: Stacker, as_torch: bool = False) -> Any:
    """:func:`default_collate`, with ``stack`` deciding where stacked arrays and tensors
    live: the same dispatch and the same errors, whatever ``stack`` does. ``as_torch``
    forces torch mode; without it, torch mode is on when the first sample holds a tensor
    (as in torch, the first sample decides; the others must match it)."""
    if len(samples) == 0:
        raise CollateError("cannot collate an empty batch", positions=[])
    return _collate(samples, "", stack, as_torch or has_tensor(samples[0]))


def default_collate(samples: Sequence[Any]) -> Any:
    """Combine ``samples`` into a batch.

    - numpy arrays of one shape → one array with a leading batch axis;
    - Python and numpy numbers → a 1-d numpy array;
    - PIL images of one size → a ``uint8`` array ``(N, H, W[, C])``;
    - torch tensors (when torch is imported) → ``torch.stack``;
    - in torch mode (the first sample holds a tensor; see the module docstring) numbers
      and numpy arrays become tensors as ``torch.utils.data.default_collate`` makes them
      (Python ints → int64, Python floats → float64, numpy keeps its dtype); numpy
      arrays of strings or objects stay numpy;
    - tuples, lists, namedtuples and mappings → the same structure, collated field by field;
    - strings, bytes, ``None`` and anything else → a list.

    Raises :class:`~aioloader.CollateError` naming the mismatching batch positions and
    their shapes when samples do not fit together (the loader adds the sample indices).
    """
    return collate_with(samples, FRESH)


def collate_torch(samples: Sequence[Any]) -> Any:
    """:func:`default_collate` in torch mode whatever the samples hold: what a
    :class:`~aioloader.DataLoader` over a ``torch.utils.data.Dataset`` uses by default."""
    return collate_with(samples, FRESH, as_torch=True)


def is_torch_dataset(dataset: object) -> bool:
    """Whether ``dataset`` is a ``torch.utils.data.Dataset`` (never imports torch)."""
    data = sys.modules.get("torch.utils.data")
    return data is not None and isinstance(dataset, data.Dataset)


def _convert(sample: Any, torch: Any) -> Any:
    if isinstance(sample, torch.Tensor):
        return sample
    if isinstance(sample, (np.ndarray, np.generic)):
        if sample.dtype.kind in _NOT_TENSOR_KINDS:
            return sample
        return torch.as_tensor(sample)
    if isinstance(sample, (str, bytes)):
        return sample
    if isinstance(sample, Mapping):
        out = {k: _convert(v, torch) for k, v in sample.items()}
        try:
            return type(sample)(out)  # type: ignore[call-arg]
        except TypeError:
            return out
    if isinstance(sample, (tuple, list)):
        fields = [_convert(v, torch) for v in sample]
        if _is_namedtuple(sample):
            return type(sample)(*fields)
        return tuple(fields) if isinstance(sample, tuple) else fields
    return sample


def default_convert(sample: Any) -> Any:
    """The default ``collate_fn`` of ``batch_size=None`` (no automatic batching), applied
    to each sample alone. In torch mode (the sample holds a tensor) numpy arrays and
    scalars become tensors as ``torch.utils.data.default_convert`` makes them (numbers,
    strings and other leaves stay as they are); otherwise the sample is returned as is."""
    return _convert(sample, _torch()) if has_tensor(sample) else sample


def convert_torch(sample: Any) -> Any:
    """:func:`default_convert` in torch mode whatever the sample holds (a torch dataset's)."""
    return _convert(sample, _torch())

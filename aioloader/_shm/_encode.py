"""Worker side: batches whose large leaves are written into a slab.

A large leaf becomes a :class:`_Leaf` in the batch: ``default_collate``'s own dispatch
puts them there (through :class:`_Deferring`, its stacking hook), or :func:`_extract`
swaps them in for the large arrays of a user's ``collate_fn`` output. Once the batch's
size is known, one slab is acquired and every leaf is written into it; the batch then
travels as itself, pickled, with each leaf pickling as a reference to its bytes. The
slab's reference is the descriptor's first argument, so pickle's memo sends it once and
the consumer has mapped the slab before the first leaf is unpickled.

Runs in workers; never imports asyncio.
"""

from __future__ import annotations

import functools
import math
import os
import sys
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np

from .._collate import FRESH, Stacker, collate_with, constructs_plainly, fill_rows
from . import _decode, _names
from ._arena import _WSlab, arena
from ._mapping import align
from ._names import ShmConfig, host_key, unavailable_reason


class _SlabRef:
    """The slab a batch was written into; unpickles as the consumer's landing."""

    __slots__ = ("name", "pid", "retired", "ticket", "used")

    def __init__(self, name: str, ticket: int, used: int, retired: tuple[str, ...]) -> None:
        self.name = name
        self.ticket = ticket
        self.used = used
        self.retired = retired
        self.pid = os.getpid()

    def __reduce__(self) -> tuple[Any, ...]:
        return (_decode.land, (self.name, self.ticket, self.used, self.retired, self.pid))


class _Leaf:
    """A large array (or tensor) of a batch, ``shape`` and ``dtype`` as it will arrive.

    Placed in a slab (``ref`` set, bytes written), it pickles as a view of that slab.
    Never placed (no slab to be had), it pickles as the value it stands for.
    """

    __slots__ = ("dtype", "fortran", "offset", "ref", "shape", "source")
    tensor = False

    def __init__(
        self, source: Any, shape: tuple[int, ...], dtype: np.dtype[Any], fortran: bool = False
    ) -> None:
        self.source = source
        self.shape = shape
        self.dtype = dtype
        self.fortran = fortran
        self.offset = 0
        self.ref: _SlabRef | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def write(self, out: np.ndarray) -> None:
        """Fill ``out`` (the leaf's place in the slab) from ``source``."""
        np.copyto(out, self.source, casting="no")

    def value(self) -> Any:
        """What the leaf stands for, in memory of its own."""
        return self.source

    def __reduce__(self) -> tuple[Any, ...]:
        if self.ref is None:
            return (_decode.unplaced, (self.value(),))
        return (_decode.view, (self.ref, self.offset, self.shape, self.dtype, self.fortran, self.tensor))


class _Rows(_Leaf):
    """Samples of one shape, to be stacked the way ``default_collate`` stacks them."""

    __slots__ = ()

    def write(self, out: np.ndarray) -> None:
        fill_rows(out, self.source)

    def value(self) -> Any:
        return FRESH.arrays(self.source, self.shape[1:], self.dtype)


class _ArrayTensorRows(_Rows):
    """Torch mode: numpy samples stacked into the slab, arriving as a tensor viewing it."""

    __slots__ = ()
    tensor = True

    def value(self) -> Any:
        return FRESH.array_tensor(self.source, self.shape[1:], self.dtype)


class _TensorRows(_Leaf):
    """CPU tensors of one shape and dtype, stacked by ``torch.stack`` into the slab; they
    arrive as ``torch.from_numpy`` of the slab's bytes."""

    __slots__ = ()
    tensor = True

    def write(self, out: np.ndarray) -> None:
        torch = sys.modules["torch"]
        torch.stack(list(self.source), out=torch.from_numpy(out))

    def value(self) -> Any:
        return FRESH.tensors(self.source)


_numpy_dtypes: dict[Any, np.dtype[Any] | None] = {}


def _numpy_dtype(torch: Any, dtype: Any) -> np.dtype[Any] | None:
    """numpy's equivalent of a torch dtype, or ``None`` (bfloat16, quantized types)."""
    if dtype not in _numpy_dtypes:
        try:
            _numpy_dtypes[dtype] = torch.empty((), dtype=dtype).numpy().dtype
        except (TypeError, RuntimeError):
            _numpy_dtypes[dtype] = None
    return _numpy_dtypes[dtype]


class _Deferring(Stacker):
    """Stacks small results at once and defers large ones to :class:`_Leaf` placeholders."""

    def __init__(self, min_bytes: int) -> None:
        self.min_bytes = min_bytes
        self.leaves: list[_Leaf] = []

    def _large(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> bool:
        return math.prod(shape) * dtype.itemsize >= self.min_bytes

    def arrays(self, samples: Sequence[np.ndarray], shape: tuple[int, ...], dtype: np.dtype[Any]) -> Any:
        full = (len(samples), *shape)
        if dtype.hasobject or not self._large(full, dtype):
            return super().arrays(samples, shape, dtype)
        self.leaves.append(_Rows(samples, full, dtype))
        return self.leaves[-1]

    def array_tensor(
        self, samples: Sequence[np.ndarray], shape: tuple[int, ...], dtype: np.dtype[Any]
    ) -> Any:
        full = (len(samples), *shape)
        if not self._large(full, dtype):
            return super().array_tensor(samples, shape, dtype)
        self.leaves.append(_ArrayTensorRows(samples, full, dtype))
        return self.leaves[-1]

    def tensors(self, samples: Sequence[Any]) -> Any:
        torch = sys.modules["torch"]
        first = samples[0]
        full = (len(samples), *first.shape)
        # torch.stack promotes mixed dtypes (float32 with float64 gives float64); the
        # slab is laid out for the dtype it will produce.
        dtype = _numpy_dtype(torch, functools.reduce(torch.promote_types, (s.dtype for s in samples)))
        # Only what torch.stack turns into a plain, contiguous CPU tensor equal to its
        # own bytes; anything else (autograd, other devices, subclasses) is stacked here.
        if (
            dtype is None
            or not self._large(full, dtype)
            or not all(
                type(s) is torch.Tensor
                and s.device.type == "cpu"
                and s.layout == torch.strided
                and not s.requires_grad
                and s.is_contiguous()
                for s in samples
            )
        ):
            return super().tensors(samples)
        self.leaves.append(_TensorRows(samples, full, dtype))
        return self.leaves[-1]


def _extract(obj: Any, leaves: dict[int, _Leaf], min_bytes: int) -> Any:
    """``obj`` with each large exact-``ndarray`` leaf replaced by a :class:`_Leaf`, inside
    containers that can be rebuilt exactly (their instances carry no state of their own:
    no namedtuple with a ``__dict__``); ``obj`` itself where nothing was replaced. An
    array found twice is one leaf (``leaves`` is keyed by ``id``), so that it arrives as
    one array, as pickle would deliver it."""
    t = type(obj)
    if t is np.ndarray:
        if obj.nbytes < min_bytes or obj.dtype.hasobject:
            return obj
        leaf = leaves.get(id(obj))
        if leaf is None:
            fortran = bool(obj.flags.f_contiguous and not obj.flags.c_contiguous)
            leaf = leaves[id(obj)] = _Leaf(obj, obj.shape, obj.dtype, fortran)
        return leaf
    if t is dict or t is OrderedDict:
        values = [_extract(v, leaves, min_bytes) for v in obj.values()]
        changed = any(v is not o for v, o in zip(values, obj.values(), strict=True))
        return t(zip(obj.keys(), values, strict=True)) if changed else obj
    if t is list or t is tuple or (constructs_plainly(t) and not hasattr(obj, "__dict__")):
        values = [_extract(v, leaves, min_bytes) for v in obj]
        if all(v is o for v, o in zip(values, obj, strict=True)):
            return obj
        if t is list:
            return values
        return tuple(values) if t is tuple else t(*values)
    return obj


class ShmBatch:
    """The descriptor a worker returns: the batch, its leaves naming the slab they are in
    (``ref``), or, without a slab, the batch as is with the reason (``note``) the consumer
    should warn about. Unpickles as the consumer's arrived batch."""

    __slots__ = ("note", "pid", "ref", "tree")

    def __init__(self, ref: _SlabRef | None, tree: Any, note: str | None) -> None:
        self.ref = ref
        self.tree = tree
        self.note = note
        self.pid = os.getpid()

    def __reduce__(self) -> tuple[Any, ...]:
        return (_decode.arrive, (self.pid, self.ref, self.tree, self.note))


class ShmEncoder:
    """Worker side: turns a batch into a :class:`ShmBatch` (or leaves it to pickle)."""

    def __init__(self, config: ShmConfig) -> None:
        self.config = config
        self._off: str | None = None  # why this loader's batches are pickled here ("" = in-process)
        self._checked = False

    def __getstate__(self) -> dict[str, Any]:
        return {"config": self.config}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.config = state["config"]
        self._off = None
        self._checked = False

    def _disabled(self) -> str | None:
        if not self._checked:
            self._checked = True
            cfg = self.config
            if os.getpid() == cfg.consumer_pid:
                self._off = ""  # same process: the batch is not copied anyway
            elif unavailable_reason() is not None or host_key() != cfg.host:
                self._off = (
                    "this worker cannot share memory with the consumer (another host, container "
                    f"or pid namespace, or no usable {_names.SHM_DIR}); its batches are pickled"
                )
        return self._off

    def _acquire(self, need: int) -> _WSlab | None:
        slab, reason = arena(self.config.consumer_pid).acquire(need, self.config)
        if reason is not None:
            self._off = reason
        return slab

    def fallback(self, batch: Any) -> Any:
        """The batch to return when shared memory is not used for it."""
        if self._off:
            return ShmBatch(None, batch, self._off)
        return batch

    def place(self, tree: Any, leaves: Sequence[_Leaf], otherwise: Any) -> Any:
        """Write ``leaves`` (the placeholders in ``tree``) into one slab and describe the
        batch; ``otherwise`` is the batch to send pickled when no slab can be had."""
        used = 0
        for leaf in leaves:
            leaf.offset = align(used)
            used = leaf.offset + leaf.nbytes
        slab = self._acquire(used)
        if slab is None:
            return self.fallback(otherwise)
        ref = _SlabRef(slab.name, int(slab.state[0]), used, arena(self.config.consumer_pid).take_retired())
        for leaf in leaves:
            leaf.write(slab.array(leaf.offset, leaf.shape, leaf.dtype, leaf.fortran))
            leaf.ref, leaf.source = ref, None
        return ShmBatch(ref, tree, None)

    def __call__(self, batch: Any) -> Any:
        if type(batch) is ShmBatch:  # collated straight into shared memory already
            return batch
        if self._disabled() is not None:
            return self.fallback(batch)
        leaves: dict[int, _Leaf] = {}
        tree = _extract(batch, leaves, self.config.min_leaf_bytes)
        return self.place(tree, list(leaves.values()), batch) if leaves else batch


class ShmCollate:
    """:func:`~aioloader.default_collate` whose large stacks are written straight into a
    slab: the same dispatch, the same errors, the same result once it has travelled;
    each byte of a large leaf is written once, into memory the consumer will view."""

    def __init__(self, encoder: ShmEncoder, as_torch: bool = False) -> None:
        self.encoder = encoder
        self.as_torch = as_torch  # torch mode forced (the loader's dataset is a torch one)

    def __call__(self, samples: Sequence[Any]) -> Any:
        enc = self.encoder
        if enc._disabled() is not None:
            return collate_with(samples, FRESH, self.as_torch)
        stack = _Deferring(enc.config.min_leaf_bytes)
        batch = collate_with(samples, stack, self.as_torch)
        # Without a slab the placeholders stay in the batch and pickle as their values.
        return enc.place(batch, stack.leaves, batch) if stack.leaves else batch

"""Small adapters for training frameworks (see :doc:`training-frameworks`).

Lightning and accelerate need none to split the data: a loader shards by rank under
``torch.distributed`` on its own. These two helpers cover what their own loaders do
besides: move batches to a device, and skip the first batches of an epoch on resume.
Nothing here imports a framework; torch is used only where it is already imported.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Iterator
from typing import Any

from ._validate import check_int
from .loader import DataLoader

__all__ = ["DeviceLoader", "skip_first_batches", "to_device"]


def _move(batch: Any, device: Any, non_blocking: bool) -> Any:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, dict):
        return type(batch)({k: _move(v, device, non_blocking) for k, v in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a named tuple
        return type(batch)(*(_move(v, device, non_blocking) for v in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(_move(v, device, non_blocking) for v in batch)
    return batch


class DeviceLoader:
    """A loader whose batches arrive on ``device`` (every torch tensor in them, through
    tuples, lists and dicts), as accelerate's prepared loaders give them.

    Everything else is the wrapped loader's: ``len``, ``state_dict``, ``set_epoch``,
    ``sampler``, ``close``... Tensors of a pinned batch move with ``non_blocking=True``.
    """

    def __init__(self, loader: Any, device: Any) -> None:
        self.loader = loader
        self.device = device

    def __iter__(self) -> Iterator[Any]:
        pinned = bool(getattr(self.loader, "pin_memory", False))
        for batch in self.loader:
            yield _move(batch, self.device, pinned)

    async def __aiter__(self) -> AsyncIterator[Any]:
        pinned = bool(getattr(self.loader, "pin_memory", False))
        async for batch in self.loader:
            yield _move(batch, self.device, pinned)

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)

    def __enter__(self) -> DeviceLoader:
        self.loader.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.loader.__exit__(*exc)

    def __repr__(self) -> str:
        return f"<aioloader.integrations.DeviceLoader device={self.device!r} of {self.loader!r}>"


def to_device(loader: Any, device: Any) -> DeviceLoader:
    """``loader`` with its batches moved to ``device`` (``accelerator.device``, say)."""
    return DeviceLoader(loader, device)


def skip_first_batches(loader: Any, num_batches: int = 0) -> Any:
    """``loader`` itself, set so that its next pass gives the epoch it would run next
    without its first ``num_batches`` batches, which are never read.

    accelerate's function of that name builds a torch loader from the loader's
    ``batch_sampler`` (which works too); this one keeps aioloader's loader, its workers
    and its batches. Raises ``ValueError`` for a loader already part-way through an epoch.
    """
    num_batches = check_int("num_batches", num_batches, 0)
    inner = loader.loader if isinstance(loader, DeviceLoader) else loader
    if not isinstance(inner, DataLoader):
        raise TypeError(f"loader must be an aioloader.DataLoader, got {type(inner).__name__}")
    state = inner.state_dict()
    if "next_position" not in state:
        raise TypeError("skip_first_batches needs a map-style dataset's loader (an iterable one has no positions)")
    if state.get("batches_delivered"):
        raise ValueError(
            f"the loader is {state['batches_delivered']} batches into epoch {state['epoch']}; "
            "skip_first_batches starts from the beginning of an epoch"
        )
    if num_batches:
        state["next_position"] = min(num_batches, len(inner))
        inner.load_state_dict(state)
    return loader

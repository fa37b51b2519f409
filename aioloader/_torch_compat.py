"""torch's ``DataLoader`` argument spellings, translated into aioloader's own.

:func:`resolve_torch_args` checks the torch-only keywords (and the pairs that would say
the same thing twice) and returns aioloader's values; :class:`PinningPass` pins the
tensors of each batch when ``pin_memory=True``. torch is imported only when a torch-only
argument needs it, so a loader that uses none of them never imports torch.
"""

from __future__ import annotations

import concurrent.futures as cf
import inspect
import os
import secrets
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.context import BaseContext
from typing import Any

from ._cpus import available_cpus
from ._pool import concurrency_of
from ._validate import check_bool, check_int, check_num_workers, resolve_context
from .errors import OversubscribedWarning

__all__ = [
    "PinningPass",
    "TorchArgs",
    "default_seed",
    "distributed_world",
    "pin_tensors",
    "rank_aware",
    "resolve_torch_args",
    "seed_from_generator",
    "warn_if_oversubscribed",
    "warn_unsharded",
    "workers_of",
]

_SEED_MASK = (1 << 63) - 1


@dataclass(frozen=True)
class TorchArgs:
    """aioloader's values once the torch spellings were folded in."""

    prefetch: int | None
    ordered: bool
    mp_context: str | BaseContext | None
    seed: int | None
    pin: Callable[[Any], Any] | None  # applied to every batch, or None


def seed_from_generator(generator: Any) -> int:
    """A seed drawn from a ``torch.Generator`` the way torch draws its base seed (this
    advances the generator once, as constructing a torch iterator does)."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(generator, torch.Generator):
        raise TypeError(
            f"generator must be a torch.Generator, got {generator!r} ({type(generator).__name__})"
        )
    drawn = torch.empty((), dtype=torch.int64).random_(generator=generator).item()
    return int(drawn) & _SEED_MASK


def default_seed() -> int:
    """The seed of a loader built with ``seed=None``.

    Where torch is imported it is drawn from torch's global generator, as torch's
    ``RandomSampler`` draws its own, so ``torch.manual_seed`` fixes the order. Elsewhere
    it is random."""
    torch = sys.modules.get("torch")
    if torch is None or not callable(getattr(torch, "empty", None)):  # absent, or half imported
        return secrets.randbits(63)
    return int(torch.empty((), dtype=torch.int64).random_().item()) & _SEED_MASK


def distributed_world() -> tuple[int, int] | None:
    """``(rank, world_size)`` of the default ``torch.distributed`` process group, or
    ``None`` when none is initialized. It never imports torch."""
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return None
    try:
        if not dist.is_available() or not dist.is_initialized():
            return None
        return int(dist.get_rank()), int(dist.get_world_size())
    except (RuntimeError, ValueError):  # a group torn down meanwhile
        return None


_RANK_FIELDS = ("num_replicas", "world_size", "num_processes")


def rank_aware(sampler: Any) -> bool:
    """Whether ``sampler`` (or the sampler a batch sampler wraps) splits its indices by
    rank: torch's ``DistributedSampler`` and its kin, aioloader's, accelerate's shards."""
    for obj in (sampler, getattr(sampler, "sampler", None)):
        if obj is not None and any(isinstance(getattr(obj, f, None), int) for f in _RANK_FIELDS):
            return True
    return False


def _user_stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the user's call, past aioloader's own
    frames (those of this folder)."""
    level, frame = 2, inspect.currentframe()
    frame = frame.f_back if frame is not None else None  # the caller of this helper
    here = os.path.dirname(__file__)
    while frame is not None and os.path.dirname(frame.f_code.co_filename) == here:
        level, frame = level + 1, frame.f_back
    return level - 1


def warn_unsharded(rank: int, world: int, why: str, fix: str) -> None:
    """The warning for a loader that gives every rank the whole dataset."""
    warnings.warn(
        f"aioloader: torch.distributed runs with {world} ranks (this is rank {rank}) and {why}, "
        f"so every rank may read the whole dataset. {fix}. Pass shard=(0, 1) to keep the "
        "whole dataset on every rank and silence this warning",
        UserWarning,
        stacklevel=_user_stacklevel(),
    )


def pin_tensors(batch: Any, device: str) -> Any:
    """``batch`` with every torch tensor in it (through tuples, lists and dicts) pinned;
    numpy arrays and other leaves are returned as they are."""
    torch = sys.modules["torch"]
    if isinstance(batch, torch.Tensor):
        return batch.pin_memory(device) if device else batch.pin_memory()
    if isinstance(batch, dict):
        return type(batch)({k: pin_tensors(v, device) for k, v in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a named tuple
        return type(batch)(*(pin_tensors(v, device) for v in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(pin_tensors(v, device) for v in batch)
    return batch


def _pinner(pin_memory: bool, device: str) -> Callable[[Any], Any] | None:
    if not pin_memory:
        if device:
            warnings.warn(
                f"pin_memory_device={device!r} has no effect without pin_memory=True",
                UserWarning,
                stacklevel=4,
            )
        return None
    try:
        import torch
    except ImportError:
        reason = "torch is not installed"
    else:
        if device and not device.startswith("cuda"):
            return lambda batch: pin_tensors(batch, device)
        if torch.cuda.is_available():
            return lambda batch: pin_tensors(batch, device)
        reason = "CUDA is not available (torch.cuda.is_available() is False)"
    warnings.warn(f"pin_memory=True is ignored: {reason}; batches are not pinned", UserWarning, stacklevel=4)
    return None


def resolve_torch_args(
    *,
    num_workers: Any,
    prefetch: Any,
    prefetch_factor: Any,
    ordered: Any,
    in_order: Any,
    mp_context: str | BaseContext | None,
    multiprocessing_context: str | BaseContext | None,
    seed: Any,
    generator: Any,
    persistent_workers: Any,
    pin_memory: Any,
    pin_memory_device: Any,
) -> TorchArgs:
    """Fold torch's keywords into aioloader's; a ValueError names both parameters of a
    conflicting pair, and a bad value raises an error naming its parameter."""
    if check_bool("persistent_workers", persistent_workers) and check_num_workers(num_workers) == 0:
        # torch refuses it too; accepting it would hide a setting that does nothing here
        raise ValueError(
            "persistent_workers=True needs num_workers > 0 (as in torch); aioloader's workers "
            "persist anyway, so it can simply be left out"
        )
    if prefetch_factor is not None:
        if prefetch is not None:
            raise ValueError(
                "pass prefetch or prefetch_factor, not both (prefetch = prefetch_factor * num_workers)"
            )
        prefetch_factor = check_int("prefetch_factor", prefetch_factor, 1)
        workers = check_num_workers(num_workers)
        if workers == 0:
            raise ValueError(
                f"prefetch_factor={prefetch_factor} needs num_workers > 0 (as in torch); with "
                "num_workers=0 leave prefetch_factor as None, or pass prefetch="
            )
        prefetch = prefetch_factor * workers
    if in_order is not None:
        if ordered is not None:
            raise ValueError("pass ordered or in_order, not both (in_order is torch's name for ordered)")
        ordered = check_bool("in_order", in_order)
    ordered = True if ordered is None else check_bool("ordered", ordered)
    if multiprocessing_context is not None:
        if mp_context is not None:
            raise ValueError(
                "pass mp_context or multiprocessing_context, not both (multiprocessing_context is torch's name)"
            )
        mp_context = resolve_context(multiprocessing_context, "multiprocessing_context")
    if generator is not None:
        if seed is not None:
            raise ValueError("pass seed or generator, not both (the generator only draws the seed)")
        seed = seed_from_generator(generator)
    pin_memory = check_bool("pin_memory", pin_memory)
    if not isinstance(pin_memory_device, str):
        raise TypeError(f"pin_memory_device must be a str, got {pin_memory_device!r}")
    return TorchArgs(prefetch, ordered, mp_context, seed, _pinner(pin_memory, pin_memory_device))


def warn_if_oversubscribed(num_workers: Any) -> None:
    """torch's warning for more workers than the CPUs this process may use (its
    affinity mask and cgroup quota): they would only take turns on them."""
    if isinstance(num_workers, str) and num_workers == "auto":
        return
    workers = check_num_workers(num_workers)
    cpus, why = available_cpus()
    if workers <= cpus:
        return
    warnings.warn(
        f"This DataLoader will create {workers} worker processes in total, more than the {cpus} CPUs "
        f"this process may use ({why}): the workers would take turns on them, which makes loading "
        "slower. Lower num_workers, or pass num_workers='auto' for one per CPU",
        OversubscribedWarning,
        stacklevel=_user_stacklevel(),
    )


class PinningPass:
    """A pass whose batches go through ``pin`` when the run hands them over (on the
    loop, ahead of the consumer, as torch's pinning thread does)."""

    def __init__(self, inner: Any, pin: Callable[[Any], Any]) -> None:
        self.inner = inner
        self.pin = pin

    async def take(self) -> Any:
        d = await self.inner.take()
        return d if d.data is None else d._replace(data=self.pin(d.data))

    def accept(self, d: Any, waited_ns: int | None = None) -> Any:
        return self.inner.accept(d, waited_ns)

    async def finish(self) -> None:
        await self.inner.finish()


def workers_of(num_workers: Any, pool: Any, executor: Any) -> Any:
    """The worker count torch's keywords are checked against: a shared pool's or a
    borrowed executor's, when one is given (``num_workers`` is ignored then)."""
    if pool is not None:
        return pool.concurrency if pool.kind != "thread" else 0
    if isinstance(executor, cf.Executor):
        return concurrency_of(executor)
    return num_workers

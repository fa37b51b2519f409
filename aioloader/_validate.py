"""Argument checks shared by the facades: each error names the parameter and the value."""

from __future__ import annotations

import math
import multiprocessing as mp
import sys
from collections.abc import Iterable, Sequence
from multiprocessing.context import BaseContext
from typing import Any, Literal

import numpy as np

__all__ = [
    "check_bool",
    "check_choice",
    "check_int",
    "check_map_dataset",
    "check_num_workers",
    "check_sampling",
    "check_seconds",
    "check_seed_samples",
    "check_shard",
    "check_unbatched",
]


def check_int(name: str, value: Any, minimum: int) -> int:
    """``value`` as an int >= ``minimum``, or a ValueError naming ``name`` and the value."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def check_num_workers(value: Any) -> int:
    """``num_workers`` as an int >= 0; the error carries torch's phrase too, which
    users and tools match on."""
    try:
        return check_int("num_workers", value, 0)
    except ValueError:
        raise ValueError(
            f"num_workers must be an int >= 0 or 'auto', got {value!r} (num_workers option should be "
            "non-negative; num_workers=0 builds batches in one background thread)"
        ) from None


def check_bool(name: str, value: Any) -> bool:
    """``value`` if it is a bool (numpy's too); strings like ``"false"`` are refused,
    because ``bool("false")`` is true."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {value!r} ({type(value).__name__})")
    return bool(value)


def check_seed_samples(value: Any) -> Literal["batch", "sample", False]:
    """``seed_samples`` normalised: ``"batch"``, ``"sample"`` (also spelt ``True``) or ``False``."""
    if isinstance(value, str):
        mode: Literal["batch", "sample"] = check_choice("seed_samples", value, ("batch", "sample"))
        return mode
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(
            f"seed_samples must be 'batch', 'sample' or a bool, got {value!r} ({type(value).__name__})"
        )
    return "sample" if value else False


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


def check_sampling(
    batch_size_given: bool, shuffle: bool, sampler: Any, batch_sampler: Any, last_batch: Any, drop_last: Any
) -> Any:
    """The DataLoader's sampling options checked together; returns ``last_batch`` with
    ``drop_last`` (torch's spelling) folded in."""
    check_choice("last_batch", last_batch, ("keep", "discard", "rollover"))
    last_batch_given = last_batch != "keep"  # before drop_last=True is folded into it
    if drop_last is not None:
        drop_last = check_bool("drop_last", drop_last)
        if drop_last and last_batch not in ("keep", "discard"):
            raise ValueError(f"drop_last=True conflicts with last_batch={last_batch!r}")
        if drop_last:
            last_batch = "discard"
    if batch_sampler is not None:
        conflicts = [
            name
            for name, given in (
                ("batch_size", batch_size_given),
                ("shuffle", shuffle),
                ("sampler", sampler is not None),
                ("last_batch", last_batch_given),
                ("drop_last=True", drop_last is True),
            )
            if given
        ]
        if conflicts:
            them = "it" if len(conflicts) == 1 else "them"
            why = f"the batch sampler makes every batch itself, so leave {them} out"
            raise ValueError(f"batch_sampler is mutually exclusive with {', '.join(conflicts)}: {why}")
        if not isinstance(batch_sampler, Iterable):
            raise TypeError(f"batch_sampler must be a re-iterable of index sequences, got {batch_sampler!r}")
    if sampler is not None:
        if shuffle:
            raise ValueError("sampler is mutually exclusive with shuffle=True")
        if not isinstance(sampler, Iterable):
            raise TypeError(f"sampler must be a re-iterable of ints, got {sampler!r}")
    return last_batch


def check_shard(shard: Any) -> tuple[int, int]:
    """``shard`` as ``(rank, world_size)`` (default ``(0, 1)``)."""
    if shard is None:
        return (0, 1)
    if (
        not isinstance(shard, (tuple, list))
        or len(shard) != 2
        or not all(isinstance(x, int) and not isinstance(x, bool) for x in shard)
        or shard[1] < 1
        or not 0 <= shard[0] < shard[1]
    ):
        rank_range = ""
        if isinstance(shard, (tuple, list)) and len(shard) == 2 and all(type(x) is int for x in shard):
            if shard[1] >= 1:  # the rank is the culprit: torch's words for it too
                rank_range = f"; Invalid rank {shard[0]}, rank should be in the interval [0, {shard[1] - 1}]"
        raise ValueError(
            f"shard must be (rank, world_size) with 0 <= rank < world_size, got {shard!r}{rank_range}"
        )
    return (int(shard[0]), int(shard[1]))


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
        raise ValueError(
            f"batch_size=None (no automatic batching) is mutually exclusive with {', '.join(conflicts)}"
        )


def is_iterable_dataset(dataset: object) -> bool:
    """A torch ``IterableDataset`` (only if torch is imported: nothing else can be one)."""
    data = sys.modules.get("torch.utils.data")
    return data is not None and isinstance(dataset, data.IterableDataset)


def check_map_dataset(dataset: Any) -> int:
    """The length of a map-style ``dataset``; a clear ``TypeError`` for anything else."""
    if is_iterable_dataset(dataset):
        # It inherits a __getitem__ that raises NotImplementedError: refuse it here, with
        # its own name, rather than at sample 0 (a __len__ would let it through).
        raise TypeError(
            f"dataset is a torch IterableDataset ({type(dataset).__name__}): only DataLoader(dataset) "
            "iterates one (in its workers); here the items must be indexable"
        )
    if not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
        raise TypeError(
            f"dataset must be map-style (define __len__ and __getitem__), got {type(dataset).__name__}"
        )
    from ._plan.indices import dataset_length

    return dataset_length(dataset)


def default_mp_context() -> BaseContext:
    """forkserver where the platform has it, else spawn (never fork: see module doc)."""
    methods = mp.get_all_start_methods()
    ctx = mp.get_context("forkserver" if "forkserver" in methods else "spawn")
    return ctx


def resolve_context(mp_context: str | BaseContext | None, name: str = "mp_context") -> BaseContext:
    """The multiprocessing context that ``mp_context`` names (the default if ``None``);
    errors name the parameter ``name`` (torch spells it ``multiprocessing_context``)."""
    if mp_context is None:
        return default_mp_context()
    if isinstance(mp_context, str):
        methods = mp.get_all_start_methods()
        if mp_context not in methods:
            raise ValueError(f"{name}: unknown start method {mp_context!r}; this platform has {methods}")
        return mp.get_context(mp_context)
    if isinstance(mp_context, BaseContext):
        return mp_context
    raise TypeError(f"{name} must be a start method name or a multiprocessing context, got {mp_context!r}")

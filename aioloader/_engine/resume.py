"""``state_dict()`` and ``load_state_dict()``: a :class:`~.epochs.Cursor` written out as a
small JSON-serialisable dict, and read back with every field checked.

A state dict names where the loader stands (epoch, delivered positions, rolled-over
samples, the user sampler's own state, the ``len(dataset)`` its epoch was planned for)
and what it must agree on with the loader it is loaded into (its *identity*: batch size,
last-batch policy, shuffle, shard). A state taken mid-epoch resumes that epoch with its
recorded length, so the dataset may have grown since, not shrunk below it; a state taken
between epochs reads the length again when the next epoch begins, as any epoch does.
Both directions cost O(delivered out of order), never O(epoch length).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from .._plan.sampler import BatchPlanner, dataset_length
from ..errors import StateDictError
from .epochs import Cursor

__all__ = ["STATE_VERSION", "Resumable", "cursor_from_state", "state_from_cursor"]

STATE_VERSION = 2  # 2: epoch orders come from the index shuffle (_permute.py)


def state_from_cursor(cur: Cursor, seed: int, identity: dict[str, Any], length_now: int) -> dict[str, Any]:
    return {
        "length": int(cur.length if cur.length is not None else length_now),
        "version": STATE_VERSION,
        "seed": seed,
        "epoch": int(cur.epoch),
        "batches_delivered": cur.delivered,
        "next_position": cur.prefix,
        "delivered_after": sorted(cur.after),
        "rollover": [int(i) for i in cur.carry],
        **identity,
        "sampler": cur.sampler_state,
    }


def cursor_from_state(
    state: Any,
    identity: dict[str, Any],
    *,
    sampler: Any,
    length_now: int,
    num_batches: Callable[[int, int], int],
) -> tuple[int, Cursor]:
    """``(seed, cursor)`` from ``state``; :class:`~aioloader.StateDictError` naming the
    first field that is missing, malformed, out of range or disagrees with ``identity``."""
    if not isinstance(state, dict):
        raise StateDictError(f"state must be a dict from DataLoader.state_dict(), got {type(state).__name__}")
    if state.get("version") != STATE_VERSION:
        raise StateDictError(
            f"state version {state.get('version')!r} is not supported (expected {STATE_VERSION})"
        )
    for key, value in identity.items():
        if key == "shard" and _another_rank(state, value):
            continue
        if state.get(key) != value:
            raise StateDictError(
                f"state dict does not match this loader: {key} is {state.get(key)!r} in the state "
                f"but {value!r} here"
            )
    sampler_state = state.get("sampler")
    if sampler_state is not None and not callable(getattr(sampler, "load_state_dict", None)):
        raise StateDictError(
            "state dict holds a sampler state but this loader's sampler has no load_state_dict"
        )
    try:
        seed, epoch = int(state["seed"]), int(state["epoch"])
        prefix = int(state["next_position"])
        after = [int(p) for p in state.get("delivered_after", [])]
        rollover = [int(i) for i in state.get("rollover", [])]
        length = int(state["length"])
    except KeyError as exc:
        raise StateDictError(f"state dict lacks the key {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:
        raise StateDictError(f"state dict holds a malformed value: {exc}") from None
    begun = prefix > 0 or bool(after)
    if begun and not 0 <= length <= length_now:
        raise StateDictError(
            f"state dict does not match this loader: its epoch was planned for length {length} "
            f"(len(dataset)) but this dataset has {length_now} samples"
        )
    n_batches = num_batches(len(rollover), length if begun else length_now)
    if (
        seed < 0
        or epoch < 0
        or not 0 <= prefix <= n_batches
        or any(not prefix < p < n_batches for p in after)
    ):
        raise StateDictError(
            f"state dict positions are out of range: seed={seed}, epoch={epoch}, "
            f"next_position={prefix}, delivered_after={after} for {n_batches} batches"
        )
    carry = np.asarray(rollover, dtype=np.int64)
    # An epoch that had not begun reads len(dataset) when it begins, like any other.
    return seed, Cursor(epoch, carry, prefix, frozenset(after), sampler_state, length if begun else None)


def _another_rank(state: dict[str, Any], shard: list[int]) -> bool:
    """A state from another rank of the same world, which this rank may load: ranks
    step in lockstep, and a framework saves rank 0's state for all (Lightning does).
    Rolled-over samples belong to one rank, so such a state must have none."""
    theirs = state.get("shard")
    return (
        isinstance(theirs, list)
        and len(theirs) == 2
        and theirs[1] == shard[1]
        and theirs[0] != shard[0]
        and not state.get("rollover")
    )


class Resumable:
    """The DataLoader's ``state_dict()`` and ``load_state_dict()`` (a mixin; the fields
    of the facade it reads are declared here)."""

    _lock: threading.RLock
    _active: Any  # the newest EpochPass, or None
    _next: Cursor
    _keys: Any  # what the loader indexes (the dataset, or a remote dataset's items)
    _planner: BatchPlanner
    seed: int
    batch_size: int | None
    last_batch: str
    shuffle: bool
    shard: tuple[int, int]
    shard_policy: str

    def _forget_runs(self) -> None:
        raise NotImplementedError

    def _settle_ranks(self, *, final: bool = False) -> None:
        """Decide the shard by rank before the state is read or written."""

    def _epoch_changed(self, epoch: int) -> None:
        """Told the epoch the next iteration runs, after a state was loaded."""

    def _check_open(self) -> None:
        raise NotImplementedError

    def _sampler_state(self) -> Any:
        getter = getattr(self._planner.custom, "state_dict", None)
        return getter() if callable(getter) else None

    def state_dict(self) -> dict[str, Any]:
        """A small JSON-serialisable snapshot: loading it into a new loader with the same
        dataset and arguments makes its next batch the one this loader would yield next."""
        self._settle_ranks()
        with self._lock:
            p = self._active
            if p is not None and p.cursor.delivered < p.n:
                cur = p.cursor
            else:
                cur = self._next
                if cur.sampler_state is None:
                    cur = dataclasses.replace(cur, sampler_state=self._sampler_state())
            return state_from_cursor(cur, self.seed, self._identity(), dataset_length(self._keys))

    def _identity(self) -> dict[str, Any]:
        """What a state dict must agree on with the loader it is loaded into."""
        return {
            "batch_size": self.batch_size,
            "last_batch": self.last_batch,
            "shuffle": self.shuffle,
            "shard": list(self.shard),
            "shard_policy": self.shard_policy,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (see :meth:`state_dict`). Costs no sample loads.

        Raises :class:`~aioloader.StateDictError` naming the first mismatch when the
        state comes from an incompatible loader.
        """
        self._settle_ranks()
        seed, cursor = cursor_from_state(
            state,
            self._identity(),
            sampler=self._planner.custom,
            length_now=dataset_length(self._keys),
            num_batches=self._planner.num_batches,
        )
        with self._lock:
            self._check_open()
            self.seed = self._planner.seed = seed
            self._forget_runs()
            self._next = cursor
            self._active = None
            self._epoch_changed(cursor.epoch)

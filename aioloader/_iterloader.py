"""``DataLoader`` over an iterable dataset (a torch ``IterableDataset``), as torch runs it:
every worker iterates its own copy, and the batches come round-robin from the workers.

``aioloader.DataLoader(dataset, ...)`` builds an :class:`IterableDataLoader` when
``dataset`` is a torch ``IterableDataset``; it is a ``DataLoader`` (the same lifecycle,
faces, pool and transport), with the epoch plan replaced by the shards of
:mod:`aioloader._engine.shards`. Its position is a :class:`ShardPosition`; its
``state_dict()`` resumes an epoch by replaying each worker's iteration past the batches
already delivered (an iterable dataset has no other position).
"""

from __future__ import annotations

import inspect
import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

from ._engine.epochs import WorkerSide
from ._engine.group import WINDOW_BUDGET, GroupPolicy
from ._engine.run import Run
from ._engine.shards import ShardPosition, ShardSource
from ._engine.units import Delivery, RunConfig
from ._facade import Pass
from ._stats import Recorder
from ._torch_compat import PinningPass
from ._validate import check_bool, check_int
from ._worker import tasks as _tasks
from .errors import StateDictError
from .loader import DataLoader

__all__ = ["IterableDataLoader"]

_SIGNATURE = inspect.signature(DataLoader.__init__)

_STATE_KIND = "iterable-dataset"
_STATE_VERSION = 1

# Arguments that mean nothing for an iterable dataset (torch refuses the first three):
# what was given -> why it is refused.
_REFUSED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "shuffle": (
        lambda v: v is not False and v is not None,  # None: torch's default
        "an iterable dataset sets its own order: shuffle inside its __iter__",
    ),
    "sampler": (lambda v: v is not None, "an iterable dataset has no indices to sample"),
    "batch_sampler": (lambda v: v is not None, "an iterable dataset has no indices to sample"),
    "shard": (lambda v: v is not None, "split the data by rank inside the dataset's __iter__, as with torch"),
    "fetch": (lambda v: v is not None, "fetch inside the dataset's __iter__, or use StreamLoader"),
    "on_error": (lambda v: v != "raise", "an exception ends a Python iterator, so no sample can be skipped"),
    "last_batch": (lambda v: v not in ("keep", "discard"), "samples cannot roll over into another epoch"),
    "pool": (
        lambda v: v is not None,
        "each shard holds a worker for its whole epoch: the loader needs its own pool",
    ),
    "executor": (
        lambda v: v is not None,
        "each shard holds a worker for its whole epoch: the loader needs its own pool",
    ),
}


class _ShardPass:
    """One consumer's pass over one epoch of an iterable dataset."""

    def __init__(
        self,
        run: Run,
        position: ShardPosition,
        lock: threading.RLock,
        recorder: Recorder,
        on_end: Callable[[_ShardPass], None],
    ) -> None:
        self.run = run
        self.position = position
        self.epoch = position.epoch
        self.lock = lock
        self.on_end = on_end
        self.rec = recorder.epoch_started(position.epoch)
        self.finished = False

    async def take(self) -> Delivery:
        return await self.run.take(self.epoch)

    def accept(self, d: Delivery, waited_ns: int | None = None) -> Any:
        self.run.release(d, self.rec, waited_ns)
        with self.lock:
            self.position = self.position.deliver(d.unit.shard, ended=d.data is None)  # type: ignore[attr-defined]
        return d.data

    async def finish(self) -> None:
        if self.finished:
            return
        self.finished = True
        self.on_end(self)
        await self.run.aclose()


class IterableDataLoader(DataLoader[Any]):
    """A :class:`~aioloader.DataLoader` whose dataset is iterable (see the module docstring).

    Each of the ``num_workers`` workers iterates its own copy of the dataset for each
    epoch; ``torch.utils.data.get_worker_info()`` gives it its id, the number of workers,
    its seed and its copy, so the dataset can split its data by worker (without that,
    every worker yields all of it, as in torch). Each worker cuts its samples into
    batches of ``batch_size`` (``drop_last`` drops each worker's short last batch), and
    the loader takes the workers' batches in turn (as they come with ``ordered=False``).
    ``num_workers=0`` iterates in one background thread.
    """

    _shards_by_rank = False  # the dataset splits its data by rank itself, as with torch

    def __init__(self, dataset: Any, *args: Any, **kwargs: Any) -> None:
        # torch's positional order is DataLoader's: bind it, then read every argument by name.
        bound = _SIGNATURE.bind(self, dataset, *args, **kwargs).arguments
        kwargs = {k: v for k, v in bound.items() if k not in ("self", "dataset")}
        batch_size = kwargs.pop("batch_size", 1)
        for name, (given, why) in _REFUSED.items():
            if name in kwargs and given(kwargs[name]):
                raise ValueError(f"{name}={kwargs[name]!r} cannot be used with an iterable dataset: {why}")
        kwargs.pop("prefetch_next_epoch", None)  # nothing to prefetch before an epoch's shards start
        kwargs.pop("seed_samples", None)  # each shard is seeded once, as it begins (docs/determinism.md)
        drop_last = kwargs.pop("drop_last", None)
        last_batch = kwargs.pop("last_batch", "keep")
        discard = (
            bool(check_bool("drop_last", drop_last)) if drop_last is not None else last_batch == "discard"
        )
        # The DataLoader's own validation, on a stand-in map-style dataset of length 0:
        # every other argument means the same here.
        super().__init__(_NoSamples(), batch_size, **kwargs)
        # No indices to sample: torch's samplers here would be endless placeholders.
        object.__setattr__(self, "sampler", None)
        object.__setattr__(self, "batch_sampler", None)
        # A shard task sends its batches itself (no grouping); the window still grows
        # while they are cheap, as a DataLoader's does.
        self._group = self._recorder.group = None
        if self._window_grows and self._pool.crosses_processes:
            self._group = self._recorder.group = GroupPolicy(
                None, self.prefetch, self._pool.concurrency, grow=True, groups=False
            )
            self._transport.allow_growth(self._group.most, WINDOW_BUDGET)
        self.__dict__["dataset"] = dataset  # past the frozen attributes' guard: set once, here
        self.__dict__["last_batch"] = "discard" if discard else "keep"  # drop_last reads it
        self._shards = self._pool.concurrency if self._pool.kind == "process" else 1
        self._next_position = ShardPosition.start(0, self._shards)
        self._iter_active: _ShardPass | None = None

    # -------------------------------------------------------------------- payload
    def _worker_context(self) -> _tasks.WorkerContext:
        return _tasks.WorkerContext(
            dataset=self.dataset,
            transform=self.transform,
            collate_fn=self._transport.wrap_collate(self._worker_collate()),
            worker_init_fn=self.worker_init_fn,
            seed_samples=False,
            encode=self._transport.encode,
            seed=self.seed,
            unbatched=self.batch_size is None,
            iterable=True,
            batch_size=self.batch_size or 1,
            drop_last=self.drop_last,
        )

    def _pickled_parts(self) -> Sequence[tuple[str, object]]:
        return (("dataset", self.dataset), ("transform", self.transform), ("collate_fn", self.collate_fn),
                ("worker_init_fn", self.worker_init_fn))  # fmt: skip

    # ------------------------------------------------------------------ iteration
    def __len__(self) -> int:
        """As torch computes it from ``len(dataset)`` (a ``TypeError`` without one):
        batches of ``batch_size``, the short last one counted unless ``drop_last``.
        The workers' own short batches can make an epoch longer than this."""
        n = len(self.dataset)
        if self.batch_size is None:
            return n
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    @property
    def epoch(self) -> int:
        return self._next_position.epoch

    def set_epoch(self, epoch: int) -> None:
        epoch = check_int("epoch", epoch, 0)
        with self._lock:
            self._next_position = ShardPosition.start(epoch, self._shards)

    async def _begin(self) -> Pass:
        await self._open()
        with self._lock:
            self._check_open()
            previous = self._iter_active
            if previous is not None:
                # Its shards hold the workers until their epoch ends: one pass at a time
                # (as with torch's persistent workers), the older one ends here.
                previous.run.close_threadsafe()
            position = self._next_position
            side = WorkerSide(self._token, self.seed, self._shared.get_payload)
            source = ShardSource(
                side, self._pool, self._recorder, position,
                timeout=self.timeout or None, max_retries=self.max_retries, is_closed=self._shared.is_closed,
            )  # fmt: skip
            run = Run(self._run_config(), source)
            self._runs.add(run)
            run.start()
            self._next_position = ShardPosition.start(position.epoch + 1, self._shards)
            p = self._iter_active = _ShardPass(
                run, position, self._lock, self._recorder, self._end_shard_pass
            )
            return p if self._pin is None else PinningPass(p, self._pin)

    def _run_config(self) -> RunConfig:
        # An exception ends the worker's Python iterator it came from: the epoch ends with it.
        return self._config(ordered=self.ordered, group=self._group, fail_fast=True)

    def _end_shard_pass(self, p: _ShardPass) -> None:
        with self._lock:
            if self._iter_active is p:
                self._iter_active = None

    # --------------------------------------------------------------------- resume
    def state_dict(self) -> dict[str, Any]:
        """Where the loader stands: the epoch, and per worker the batches delivered and
        whether its iteration ended. Loading it into a loader with the same dataset,
        ``num_workers`` and batching resumes with the next batch this one would yield;
        each worker's iteration is replayed past its delivered batches (they are built
        again, not collated or sent)."""
        with self._lock:
            p = self._iter_active
            pos = p.position if p is not None and not p.run.ended else self._next_position
            return {
                "kind": _STATE_KIND,
                "version": _STATE_VERSION,
                "seed": self.seed,
                "epoch": pos.epoch,
                "num_workers": pos.num_shards,
                "batch_size": self.batch_size,
                "drop_last": self.drop_last,
                "delivered": list(pos.delivered),
                "ended": list(pos.ended),
                "turn": pos.turn,
            }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (see :meth:`state_dict`); a
        :class:`~aioloader.StateDictError` names the first field that does not fit."""
        if not isinstance(state, dict) or state.get("kind") != _STATE_KIND:
            raise StateDictError(
                "state must come from the state_dict() of a DataLoader over an iterable dataset, got "
                f"{type(state).__name__ if not isinstance(state, dict) else 'kind=' + repr(state.get('kind'))}"
            )
        expected = {"version": _STATE_VERSION, "num_workers": self._shards, "batch_size": self.batch_size,
                    "drop_last": self.drop_last}  # fmt: skip
        for key, want in expected.items():
            if state.get(key) != want:
                raise StateDictError(
                    f"state[{key!r}] is {state.get(key)!r}, but this loader has {key}={want!r}"
                )
        n = self._shards
        try:
            epoch = check_int("epoch", state["epoch"], 0)
            seed = check_int("seed", state["seed"], 0)
            delivered = tuple(check_int("delivered", d, 0) for d in state["delivered"])
            ended = tuple(check_bool("ended", e) for e in state["ended"])
            turn = check_int("turn", state["turn"], 0)
        except (KeyError, TypeError, ValueError) as exc:
            raise StateDictError(f"state is malformed: {exc}") from None
        if len(delivered) != n or len(ended) != n or turn >= n:
            raise StateDictError(f"state['delivered'], ['ended'] and ['turn'] must describe {n} workers")
        with self._lock:
            self._check_open()
            self.seed = seed
            self._next_position = ShardPosition(epoch, n, delivered, ended, turn)
            self._iter_active = None

    def __repr__(self) -> str:
        return (
            f"<aioloader.DataLoader over an iterable dataset batch_size={self.batch_size} "
            f"num_workers={self.num_workers} prefetch={self.prefetch} {self._state.value}>"
        )


class _NoSamples:
    """The stand-in map-style dataset the DataLoader's own validation is run on."""

    def __len__(self) -> int:
        return 0

    def __getitem__(self, i: int) -> Any:  # pragma: no cover - never read
        raise IndexError(i)


DataLoader._iterable_cls = IterableDataLoader  # DataLoader(iterable_dataset) makes one of these

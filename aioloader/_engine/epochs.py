"""The DataLoader's unit source: the batches of an epoch plan, then, as a policy, the
next epoch's first batches while the consumer finishes this one; and the consumer's
side of it, one :class:`EpochPass` per epoch iterated.

Where a loader stands is one frozen :class:`Cursor`: an epoch, the samples rolled over
into it, and the batch positions already delivered (a prefix, plus the few delivered out
of order). ``state_dict()`` is the cursor written out; resuming is a cursor read back.
Nothing here is O(epoch length) beyond what the plan itself costs.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._plan.sampler import EpochPlan
from .._stats import Recorder
from .._worker import tasks as _tasks
from .._worker.channel import Carried
from ..errors import TooManySkippedError, add_note
from .run import Run
from .units import Delivery, Failed, add_context

__all__ = ["Cursor", "EpochPass", "EpochSource", "EpochUnit", "Parked", "WorkerSide"]

_KEYS = np.dtype(object)  # a sampler's own keys (batch_size=None), not indices

_EMPTY = np.zeros(0, dtype=np.int64)


@dataclass(frozen=True)
class Cursor:
    """The next batch to deliver: the first position of ``plan(epoch, carry, length)``
    that is neither below ``prefix`` nor in ``after``. ``length`` is the ``len(dataset)``
    the epoch is planned for; ``None`` until the epoch begins (it is read then, so a
    dataset that grew between epochs is seen whole by the next one)."""

    epoch: int
    carry: np.ndarray = field(default_factory=lambda: _EMPTY)
    prefix: int = 0
    after: frozenset[int] = frozenset()
    sampler_state: Any = None
    length: int | None = None

    @property
    def fresh(self) -> bool:
        """At the start of its epoch, with nothing to restore."""
        return self.prefix == 0 and not self.after and self.sampler_state is None

    @property
    def delivered(self) -> int:
        return self.prefix + len(self.after)

    def positions(self, n: int) -> Iterator[int]:
        """The positions of an ``n``-batch plan still to deliver, in plan order (lazily)."""
        after = self.after
        for p in range(self.prefix, n):
            if p not in after:
                yield p

    def remaining(self, n: int) -> int:
        return max(0, n - self.prefix) - sum(1 for p in self.after if self.prefix <= p < n)

    def moved(self, prefix: int, after: frozenset[int]) -> Cursor:
        """This cursor with the batches delivered so far given by ``prefix`` and ``after``."""
        return Cursor(self.epoch, self.carry, prefix, after, self.sampler_state, self.length)


@dataclass
class WorkerSide:
    """What a unit needs to build its pool task (shared by every unit of a loader)."""

    token: str
    seed: int
    payload: Callable[[], bytes | None]  # the pickled worker context, for workers that lack it
    inline: Any = None  # thread mode: a context object that rides along with every task
    keys: Any = None  # with fetch=: the dataset, read in this process (the items to fetch)


class EpochUnit:
    """Batch ``key`` of epoch ``group``."""

    __slots__ = ("_packed", "group", "indices", "key", "side", "size", "values")

    fn = staticmethod(_tasks.run_batch)

    def __init__(self, side: WorkerSide, epoch: int, pos: int, indices: Any) -> None:
        self.side = side
        self.group = epoch
        self.key = pos
        self.indices = indices
        self.size = len(indices)
        # Raw int64 bytes pickle ~5x faster than a numpy array (this runs for every batch).
        # A sampler's own keys (batch_size=None) go as they are, in a list.
        keyed = isinstance(indices, np.ndarray) and indices.dtype == _KEYS
        self._packed: Any = indices.tolist() if keyed else np.asarray(indices, dtype=np.int64).tobytes()
        self.values: Sequence[Any] | None = None  # fetched samples (fetch=), kept for resubmissions

    @property
    def label(self) -> str:
        return f"batch {self.key} of epoch {self.group}"

    def make_task(self, task_id: int, with_payload: bool) -> _tasks.BatchTask:
        side = self.side
        payload = side.payload() if with_payload else None
        return _tasks.BatchTask(
            side.token,
            task_id,
            self.group,
            self.key,
            self._packed,
            side.seed,
            payload,
            None if self.values is None else Carried(self.values),
        )

    def fetch_input(self, k: int, index: int) -> Any:
        """What to fetch for sample ``index``: ``dataset[index]``, read here in the main process."""
        try:
            return self.side.keys[index]
        except Exception as exc:
            add_note(exc, f"aioloader: raised by dataset[{index}] (sample index {index}) in the main process, "
                     "where the dataset of a loader with fetch= is read")  # fmt: skip
            raise

    def set_fetched(self, kept: list[int], values: list[Any]) -> None:
        """The unit's samples are fetched: ``kept`` indices (those not skipped), their values."""
        self._packed = np.asarray(kept, dtype=np.int64).tobytes()
        self.values = Carried(values)  # their large bytes travel beside the task's pickle

    def drop_fetched(self) -> None:
        """Called by the fetch stage once the unit's dispatch is over (built, or failed for
        good): no task of it is made again, so the fetched samples are not needed."""
        self.values = None


class EpochSource:
    """Units of ``plan`` from ``cursor`` on; then, while ``follow`` allows it, of the
    following epochs, at most one epoch ahead of the newest one a consumer has begun."""

    def __init__(
        self,
        side: WorkerSide,
        plan: EpochPlan,
        cursor: Cursor,
        follow: Callable[[int, np.ndarray], EpochPlan] | None,
    ) -> None:
        self.side = side
        self.plans: dict[int, EpochPlan] = {plan.epoch: plan}
        self.follow = follow
        self.consumed_epoch = plan.epoch  # the newest epoch a consumer has begun
        self._plan = plan
        self._positions = cursor.positions(len(plan))
        self._advanced = asyncio.Event()
        self._loop = asyncio.get_running_loop()  # the run's: where its producer waits

    def stop_following(self) -> None:
        """Produce no epoch beyond the ones already started. From any event loop: a pass
        on another one (its own, or one since closed) may still hold this source."""
        self.follow = None
        try:
            same = asyncio.get_running_loop() is self._loop
        except RuntimeError:
            same = False
        if same:
            self._advanced.set()
        else:
            with contextlib.suppress(RuntimeError):  # that loop is closed: nobody waits
                self._loop.call_soon_threadsafe(self._advanced.set)

    def begin(self, epoch: int) -> EpochPlan:
        """A consumer begins ``epoch``, which this source has already started."""
        self.consumed_epoch = epoch
        for e in [e for e in self.plans if e < epoch]:
            del self.plans[e]
        self._advanced.set()
        if epoch not in self.plans:
            # The previous epoch's units are all taken but the run has not asked for the
            # next unit yet (one event loop, no gap for it to run): start the epoch here.
            follow = self.follow
            assert follow is not None  # continues_into(epoch) said it goes on
            self._follow_on(follow)
        return self.plans[epoch]

    def continues_into(self, epoch: int) -> bool:
        return epoch in self.plans or (self.follow is not None and self._plan.epoch + 1 == epoch)

    async def next_unit(self) -> EpochUnit | None:
        while True:
            pos = next(self._positions, None)
            if pos is not None:
                plan = self._plan
                return EpochUnit(self.side, plan.epoch, pos, plan.batches[pos])
            while self.follow is not None and self._plan.epoch > self.consumed_epoch:
                self._advanced.clear()  # one epoch ahead at most: wait for a consumer
                await self._advanced.wait()
            follow = self.follow  # read once: stop_following may clear it from another thread
            if follow is None:
                return None
            self._follow_on(follow)

    def _follow_on(self, follow: Callable[[int, np.ndarray], EpochPlan]) -> None:
        """Go on into the epoch after the current plan's, planned by ``follow``."""
        plan = follow(self._plan.epoch + 1, self._plan.carry_out)
        self.plans[plan.epoch] = self._plan = plan
        self._positions = iter(range(len(plan)))

    async def aclose(self) -> None:
        self.follow = None
        self._advanced.set()


class Parked:
    """A run whose epoch ended while its source went on into the next one."""

    def __init__(self, run: Run, source: EpochSource, successor: Cursor) -> None:
        self.run = run
        self.source = source
        self.successor = successor


class EpochPass:
    """One consumer's pass over one epoch, from ``cursor`` (see
    :class:`~aioloader._facade.Pass`: ``take``, ``accept``, ``finish``). ``on_end(pass)``
    tells the loader it ended and returns whether the loader keeps the run (it went on
    into the next epoch); otherwise the pass closes it."""

    def __init__(
        self,
        run: Run,
        source: EpochSource,
        plan: EpochPlan,
        cursor: Cursor,
        successor: Cursor,
        *,
        lock: threading.RLock,
        recorder: Recorder,
        max_skipped: int | None,
        on_end: Callable[[EpochPass], bool],
    ) -> None:
        self.run = run
        self.source = source
        self.epoch = plan.epoch
        self.n = len(plan)
        # Where the consumer stands, kept as it moves (a frozen Cursor is built only
        # when state_dict() asks: building one per batch cost a few us of the consumer's
        # thread). Read and written under ``lock``.
        self._start = cursor
        self._prefix = cursor.prefix
        self._after = set(cursor.after)
        self.successor = successor
        self.left = cursor.remaining(self.n)  # batches the consumer has still to accept
        self.untaken = self.left  # batches the run has still to hand over
        self.skipped: list[tuple[int, str]] = []
        self.lock = lock
        self.recorder = recorder
        self.max_skipped = max_skipped
        self.on_end = on_end
        self.rec = recorder.epoch_started(plan.epoch)
        self.finished = False

    @property
    def cursor(self) -> Cursor:
        """Where the consumer stands: the batches it accepted (call under ``lock``)."""
        return self._start.moved(self._prefix, frozenset(self._after))

    async def take(self) -> Delivery:
        if self.untaken <= 0:
            raise StopAsyncIteration
        try:
            d = await self.run.take(self.epoch)
        except Exception as exc:
            if not isinstance(exc, StopAsyncIteration):
                add_context(exc, f"aioloader: raised while loading epoch {self.epoch}")
            raise
        self.untaken -= 1
        return d

    def accept(self, d: Delivery, waited_ns: int | None = None) -> Any:
        self.run.release(d, self.rec, waited_ns)
        self.left -= 1
        pos: int = d.unit.key  # type: ignore[attr-defined]
        with self.lock:
            if pos == self._prefix:
                pos += 1
                while pos in self._after:
                    self._after.discard(pos)
                    pos += 1
                self._prefix = pos
            else:
                self._after.add(pos)
        if d.error is not None:
            # The batch is passed as torch passes a failed one: the consumer gets its
            # error now and, if it asks again, the batch after it (state_dict() too).
            add_context(d.error, f"aioloader: raised while loading epoch {self.epoch}")
            return Failed(d.error)
        if d.skipped:
            self._count_skipped(d.skipped)
        return d.data

    def _count_skipped(self, skipped: tuple[tuple[int, str], ...]) -> None:
        self.skipped.extend(skipped)
        self.recorder.skipped += len(skipped)
        limit = self.max_skipped
        if limit is not None and len(self.skipped) > limit:
            self.run.close_threadsafe()
            raise TooManySkippedError(
                f"on_error='skip' dropped {len(self.skipped)} samples in epoch {self.epoch}, "
                f"more than max_skipped={limit}; first: index "
                f"{self.skipped[0][0]} ({self.skipped[0][1]})",
                skipped=list(self.skipped),
            )

    async def finish(self) -> None:
        if self.finished:
            return
        self.finished = True
        if not self.on_end(self):
            await self.run.aclose()

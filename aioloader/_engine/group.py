"""Grouping: several cheap batches in one pool task, a policy on the run.

Each pool task costs the consumer's process the same whatever it holds: its job and
wake-ups, pickling the task, unpickling the reply in the pool's I/O thread, and waking
the loop. When a batch takes a worker less than that
(small samples), those costs, not the workers, bound the loader. So when batches are
cheap, the run gives a worker several of them in one task:

* the **policy** (:class:`GroupPolicy`) picks how many: a fixed number, or, for
  ``"auto"``, enough that a task keeps its worker busy about :data:`TARGET_NS`, from the
  worker time per batch that it measures as the loader runs; at most
  ``window // workers``, so that every worker still has work; with a DataLoader's
  default ``prefetch`` it also grows the window while batches are cheap;
* the **stage** (:class:`GroupStage`) runs them: the run's producer reserves a group's
  window slots first and then takes its units, so the units still hold one slot each
  and the window bounds batches, not tasks; a group whose units ended early (the source
  waited) goes out as it is.

Nothing a user sees changes: each batch is built from its own position and seed, in
order; one that raises fails alone; each is delivered, counted and resumable on its own.
A worker that dies holding a group costs no retry, and a group that overruns ``timeout``
raises nothing: the group's batches run again one per task, so that only the batch that
kills its worker is charged (see ``max_retries``) and only the one that overruns is
named by :class:`~aioloader.LoaderTimeout`.
"""

from __future__ import annotations

import asyncio
import functools
import math
from collections.abc import Sequence
from typing import Any

from .._worker import tasks as _tasks
from .._worker.reply import Failed
from .dispatch import Dispatcher, Raised, Split

__all__ = [
    "GROWTH",
    "MAX_GROUP",
    "TARGET_NS",
    "WINDOW_BUDGET",
    "GroupPolicy",
    "GroupStage",
    "policy_for",
]

TARGET_NS = 2_000_000  # worker time a task should take before grouping stops paying
MAX_GROUP = 16  # batches in one task at most (a group's first batch waits for its last)
GROWTH = 16  # a growing window: at most this many times its start
WINDOW_BUDGET = 64 << 20  # a growing window: bytes of batches it may hold
_ALPHA = 0.25  # weight of the newest measurement of worker time per batch


class GroupPolicy:
    """How many batches go into one pool task: ``fixed`` (at most the window), or
    adapted to the measured worker time per batch (``fixed=None``), at most
    ``window // workers`` so that every worker has work.

    ``grow`` (a DataLoader's default ``prefetch``, or ``"auto"``): the window itself may
    grow, from ``window`` up to :data:`GROWTH` times it, to hold two groups per worker of
    the size the batches' cost asks for, within :data:`WINDOW_BUDGET` bytes of batches
    (:meth:`observe_bytes`; it does not grow before a batch was weighed); it never goes
    below where it started."""

    def __init__(
        self, fixed: int | None, window: int, workers: int = 1, grow: bool = False, groups: bool = True
    ) -> None:
        self.groups = groups  # False: only the window grows (an iterable dataset's batches)
        self.fixed = fixed
        self.base = self.window = max(1, window)
        self.workers = max(1, workers)
        self.grow = grow and fixed is None
        self.size = min(fixed, self.window) if fixed is not None else 1
        self.per_batch_ns: float | None = None
        self.batch_bytes: int | None = None

    @property
    def most(self) -> int:
        """The most batches the window may hold, ever."""
        return self.base * GROWTH if self.grow else self.base

    @property
    def limit(self) -> int:
        return self.window if self.fixed is not None else max(1, self.window // self.workers)

    def observe_bytes(self, nbytes: int) -> None:
        """A delivered batch held about ``nbytes`` (the largest seen counts)."""
        self.batch_bytes = nbytes if self.batch_bytes is None else max(self.batch_bytes, nbytes)

    def observe(self, batches: int, busy_ns: int) -> None:
        """A task of ``batches`` batches kept its worker busy ``busy_ns`` (the recorder
        reports every finished task of the loader here)."""
        if batches <= 0:
            return
        t = busy_ns / batches
        self.per_batch_ns = t if self.per_batch_ns is None else (1 - _ALPHA) * self.per_batch_ns + _ALPHA * t
        if self.fixed is None:
            want = min(MAX_GROUP, math.ceil(TARGET_NS / max(self.per_batch_ns, 1.0)))
            if self.grow and self.batch_bytes is not None:  # not before a batch was weighed
                window = min(self.most, 2 * self.workers * want)
                window = min(window, WINDOW_BUDGET // max(1, self.batch_bytes))
                self.window = max(self.base, window)
            self.size = max(1, min(self.limit, want))

    def describe(self) -> str:
        if not self.groups:
            return ""
        how = f"fixed at {self.fixed}" if self.fixed is not None else "auto"
        per = f", {self.per_batch_ns / 1e6:.3f} ms of worker time per batch" if self.per_batch_ns else ""
        return f"{self.size} per task ({how}, at most {self.limit}{per})"

    def describe_window(self) -> str:
        """The window's line of the stats, where it may grow (else empty)."""
        if not self.grow:
            return ""
        return f"{self.window} batches (from {self.base}, grows while batches are cheap)"


def policy_for(
    setting: Any, prefetch: int, pool: Any, fetching: bool, grow: bool = False
) -> GroupPolicy | None:
    """The policy for a loader's ``batches_per_task=setting`` (validated here), or
    ``None`` where every batch is a task of its own: threads, owned or borrowed (their
    tasks cost no pickling or pipe to spare), a loader with ``fetch=``, or ``1``."""
    if not (isinstance(setting, str) and setting == "auto"):
        if isinstance(setting, bool) or not isinstance(setting, int) or setting < 1:
            raise ValueError(f'batches_per_task must be an int >= 1 or "auto", got {setting!r}')
    if not pool.crosses_processes or fetching or setting == 1:
        return None
    if setting == "auto":
        return GroupPolicy(None, prefetch, pool.concurrency, grow=grow)
    return GroupPolicy(setting, prefetch)


class _Group:
    """Several units as one pool task: what the dispatcher names and submits."""

    def __init__(self, members: Sequence[Any]) -> None:
        self.members = members
        self.batches = len(members)  # what the policy counts (a unit alone is one)
        first, last = members[0], members[-1]
        if first.group == last.group:
            self.label = f"the group of batches {first.key}-{last.key} of epoch {first.group}"
        else:
            self.label = f"the group of batches {first.label} to {last.label}"

    @property
    def indices(self) -> list[int]:
        return [int(i) for m in self.members for i in m.indices]

    def make_task(self, task_id: int, with_payload: bool) -> _tasks.GroupTask:
        members = self.members
        side = members[0].side
        tasks = tuple(m.make_task(task_id, False) for m in members)
        return _tasks.GroupTask(side.token, task_id, tasks, side.payload() if with_payload else None)


class GroupStage:
    """Gathers units into groups of ``policy.size`` and runs each group as one task."""

    def __init__(self, dispatcher: Dispatcher, policy: GroupPolicy) -> None:
        self.dispatcher = dispatcher
        self.policy = policy
        self.loop = asyncio.get_running_loop()
        self._open: list[tuple[Any, asyncio.Future[Any]]] | None = None  # the group still gathering
        self.tasks: set[asyncio.Task[None]] = set()

    @property
    def size(self) -> int:
        return self.policy.size

    def add(self, unit: Any) -> asyncio.Future[Any] | None:
        """Put ``unit`` in the group being gathered; its future settles when it is built.

        The group's task is created with its first unit (so that it is a task of the
        run's loop from the start, cancelled with the others) and closes the group when
        it begins: the producer adds the units of a burst without yielding, so a group
        holds what the producer had ready, up to the policy's size. Returns ``None``
        when units go one a task now: the run runs the unit as it runs any other."""
        if self.policy.size == 1 and self._open is None:
            return None
        fut: asyncio.Future[Any] = self.loop.create_future()
        group = self._open
        if group is None:
            group = self._open = []
            task = self.loop.create_task(self._run(group))
            self.tasks.add(task)
            task.add_done_callback(functools.partial(self._done, group))
        group.append((unit, fut))
        if len(group) >= self.policy.size:
            self._open = None
        return fut

    def _done(self, group: list[tuple[Any, asyncio.Future[Any]]], task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        if self._open is group:
            self._open = None
        for _, fut in group:  # a task cancelled before it began settles nothing itself
            if not fut.done():
                fut.cancel()

    async def _run(self, members: list[tuple[Any, asyncio.Future[Any]]]) -> None:
        if self._open is members:
            self._open = None  # it begins: later units go into a new group
        units = [u for u, _ in members]
        try:
            if len(units) == 1:  # a group that ended with one unit, or a member split off
                u = units[0]
                outcomes: Sequence[Any] = (await self.dispatcher.run(u.fn, u.make_task, u),)
            else:
                group = _Group(units)
                res = await self.dispatcher.run(_tasks.run_group, group.make_task, group, split=True)
                outcomes = res.outcomes
        except Split:  # its worker died holding it, or it overran: each batch again, alone
            await asyncio.gather(*(self._run([m]) for m in members))
            return
        except asyncio.CancelledError:
            raise  # the run is closing: _done cancels the members' futures
        except BaseException as exc:  # the whole task failed (crashes, pool broken, closed)
            outcomes = [exc] * len(members)
        for (_, fut), out in zip(members, outcomes, strict=True):
            if fut.done():
                continue
            if isinstance(out, Failed):
                out = out.exception()
            if isinstance(out, (SystemExit, KeyboardInterrupt)):
                fut.set_result(Raised(out))
            elif isinstance(out, BaseException):
                fut.set_exception(out)
            else:
                fut.set_result(out)

    def stop(self) -> list[asyncio.Task[None]]:
        """The group tasks to cancel and await (the run is closing)."""
        self._open = None
        return [t for t in self.tasks if not t.done()]
